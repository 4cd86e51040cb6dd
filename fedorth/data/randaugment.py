"""RandAugment and bilinear resizing on the device, inside the compiled round.

FedPAC (Liu et al.) Appendix D.5 fine-tunes ViT-B/16 on CIFAR-100 "resized to 224×224
(bilinear), random crop, horizontal flip and RandAugment" on the clients. This module does the
resize and RandAugment in ``jax.numpy`` on a ``[B, H, W, C]`` batch, so they run per local step
with no host round trip (``fedorth.train.builders.make_batch_fn``).

RandAugment (Cubuk et al. 2020) as timm's ``rand-m9-mstd0.5-inc1`` (the DeiT/ViT fine-tuning
recipe): each image gets ``num_ops`` = 2 operations drawn uniformly from the 15 "increasing"
ones (AutoContrast, Equalize, Invert, Rotate, Posterize, Solarize, SolarizeAdd, Color, Contrast,
Brightness, Sharpness, ShearX, ShearY, TranslateX, TranslateY), each applied with probability
0.5 at magnitude m ~ N(9, 0.5) clipped to [0, 10], with timm's level maps (rotate ±30°·m/10,
shear ±0.3·m/10, translate ±0.45·m/10 of the side, enhance factors 1 ± 0.9·m/10, posterize to
4 − ⌊4·m/10⌋ bits, solarize above 256 − ⌊256·m/10⌋, solarize-add ⌊110·m/10⌋ below 128).
Pixel operations follow PIL's on the 0..255 grid (tests compare them with PIL); geometric
operations sample bilinearly and fill with the ImageNet mean, as timm does.

Choice (stated because it is not the paper's order): crop, flip and RandAugment run at the
dataset's own resolution (32×32 for CIFAR), *then* the batch is resized to 224×224. Every
operation above is defined relative to the image size or pixel-wise, so the distribution of
augmentations is the same up to interpolation, on 1/49 of the pixels: 102 ms against 2804 ms
for 16 images on the 2-core CPU (docs/PERFORMANCE.md, "A user's guide";
benchmarks/augment_cost.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NUM_OPS = 15
# timm's fill: the ImageNet mean. NumPy, not jnp: nothing may start a JAX backend at import
# (jax.distributed.initialize must come first).
_FILL = np.asarray([0.485, 0.456, 0.406], np.float32)


def resize(images: jax.Array, size: int) -> jax.Array:
    """Bilinear resize of ``[B, H, W, C]`` to ``[B, size, size, C]`` (antialiased if shrinking)."""
    batch, _, _, channels = images.shape
    return jax.image.resize(images, (batch, size, size, channels), "bilinear")


def _grey(v):
    # PIL's "L" conversion (Convert.c, L24): (R·19595 + G·38470 + B·7471 + 2^15) >> 16.
    weighted = v[..., 0] * 19595 + v[..., 1] * 38470 + v[..., 2] * 7471 + 32768
    return jnp.floor(weighted / 65536)[..., None]


def _blend(degenerate, v, factor):
    # PIL's Image.blend (Blend.c): in1 + α(in2 − in1) in float, clipped, then truncated to 8 bits.
    return jnp.floor(jnp.clip(degenerate + factor * (v - degenerate), 0, 255))


def autocontrast(v):
    """PIL's ImageOps.autocontrast (no cutoff): lut[i] = ⌊i·s − lo·s⌋, s = 255/(hi − lo)."""
    lo = v.min(axis=(0, 1), keepdims=True)
    hi = v.max(axis=(0, 1), keepdims=True)
    scale = 255.0 / jnp.maximum(hi - lo, 1.0)
    stretched = jnp.clip(jnp.floor(v * scale - lo * scale), 0, 255)
    return jnp.where(hi > lo, stretched, v)


def equalize(v):
    """PIL's ImageOps.equalize per channel: lut[i] = (step//2 + Σ_{j<i} h_j) // step."""

    def channel(c):
        levels = c.astype(jnp.int32).reshape(-1)
        hist = jnp.zeros(256, jnp.int32).at[levels].add(1)
        last = jnp.max(jnp.where(hist > 0, jnp.arange(256), -1))
        step = (levels.size - hist[last]) // 255
        before = jnp.cumsum(hist) - hist
        lut = jnp.minimum((step // 2 + before) // jnp.maximum(step, 1), 255)
        return jnp.where(step > 0, lut[levels].reshape(c.shape).astype(c.dtype), c)

    return jnp.stack([channel(v[..., k]) for k in range(v.shape[-1])], -1)


def posterize(v, bits):
    step = 2.0 ** (8 - bits)
    return jnp.floor(v / step) * step


def solarize(v, threshold):
    return jnp.where(v >= threshold, 255 - v, v)


def solarize_add(v, add, threshold=128):
    return jnp.where(v < threshold, jnp.minimum(v + add, 255), v)


def color(v, factor):
    return _blend(_grey(v), v, factor)


def contrast(v, factor):
    mean = jnp.floor(jnp.mean(_grey(v)) + 0.5)
    return _blend(mean, v, factor)


def brightness(v, factor):
    return _blend(jnp.zeros_like(v), v, factor)


def sharpness(v, factor):
    """PIL's SHARPEN-smoothed image ([[1,1,1],[1,5,1],[1,1,1]]/13) inside, borders kept."""
    kernel = jnp.asarray([[1, 1, 1], [1, 5, 1], [1, 1, 1]], v.dtype) / 13.0
    padded = jnp.pad(v, ((1, 1), (1, 1), (0, 0)), mode="edge")
    smooth = sum(
        kernel[i, j] * padded[i : i + v.shape[0], j : j + v.shape[1]]
        for i in range(3)
        for j in range(3)
    )
    smooth = jnp.round(smooth)
    inner = jnp.zeros(v.shape[:2], bool).at[1:-1, 1:-1].set(True)[..., None]
    return _blend(jnp.where(inner, smooth, v), v, factor)


def affine(v, matrix):
    """Output pixel (y, x) samples the input at ``matrix @ (x, y, 1)`` about the centre
    (bilinear), filling outside with the ImageNet mean."""
    height, width, channels = v.shape
    ys, xs = jnp.meshgrid(jnp.arange(height), jnp.arange(width), indexing="ij")
    cy, cx = (height - 1) / 2.0, (width - 1) / 2.0
    src_x = matrix[0, 0] * (xs - cx) + matrix[0, 1] * (ys - cy) + matrix[0, 2] + cx
    src_y = matrix[1, 0] * (xs - cx) + matrix[1, 1] * (ys - cy) + matrix[1, 2] + cy
    inside = (src_x > -1) & (src_x < width) & (src_y > -1) & (src_y < height)
    out = jnp.stack(
        [
            jax.scipy.ndimage.map_coordinates(v[..., k], [src_y, src_x], order=1, mode="nearest")
            for k in range(channels)
        ],
        -1,
    )
    fill = jnp.round(_FILL[:channels] * 255) if channels == 3 else jnp.full((channels,), 128.0)
    return jnp.where(inside[..., None], out, fill[None, None, :])


def _geometric(kind, v, level, sign):
    height, width, _ = v.shape
    eye = jnp.eye(3)
    if kind == "rotate":
        angle = jnp.deg2rad(sign * 30.0 * level)
        c, s = jnp.cos(angle), jnp.sin(angle)
        matrix = jnp.asarray([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    elif kind == "shear_x":
        matrix = eye.at[0, 1].set(sign * 0.3 * level)
    elif kind == "shear_y":
        matrix = eye.at[1, 0].set(sign * 0.3 * level)
    elif kind == "translate_x":
        matrix = eye.at[0, 2].set(sign * 0.45 * level * width)
    else:
        matrix = eye.at[1, 2].set(sign * 0.45 * level * height)
    return affine(v, matrix)


def _ops():
    """The 15 operations as ``f(v, level, sign)``, ``level = m/10`` in [0, 1]."""

    def enhance(fn):
        return lambda v, level, sign: fn(v, 1.0 + sign * 0.9 * level)

    return [
        lambda v, level, sign: autocontrast(v),
        lambda v, level, sign: equalize(v),
        lambda v, level, sign: 255 - v,
        lambda v, level, sign: _geometric("rotate", v, level, sign),
        lambda v, level, sign: posterize(v, 4 - jnp.floor(4 * level)),
        lambda v, level, sign: solarize(v, 256 - jnp.floor(256 * level)),
        lambda v, level, sign: solarize_add(v, jnp.floor(110 * level)),
        enhance(color),
        enhance(contrast),
        enhance(brightness),
        enhance(sharpness),
        lambda v, level, sign: _geometric("shear_x", v, level, sign),
        lambda v, level, sign: _geometric("shear_y", v, level, sign),
        lambda v, level, sign: _geometric("translate_x", v, level, sign),
        lambda v, level, sign: _geometric("translate_y", v, level, sign),
    ]


def rand_augment(
    key: jax.Array,
    images: jax.Array,
    *,
    num_ops: int = 2,
    magnitude: float = 9.0,
    magnitude_std: float = 0.5,
    prob: float = 0.5,
) -> jax.Array:
    """RandAugment of a ``[B, H, W, 3]`` batch with pixel values in [0, 1].

    Args:
      key: PRNG key.
      images: ``[B, H, W, C]`` in [0, 1] (de-normalize first).
      num_ops: operations per image (2).
      magnitude: m in [0, 10] (9).
      magnitude_std: std of the per-operation Gaussian noise on m (0.5).
      prob: probability of applying each drawn operation (0.5).

    Returns:
      The augmented batch, in [0, 1], on the 1/255 grid.
    """
    ops = _ops()

    def one(key, image):
        v = jnp.round(jnp.clip(image, 0.0, 1.0) * 255.0)
        for k in jax.random.split(key, num_ops):
            k_op, k_apply, k_mag, k_sign = jax.random.split(k, 4)
            index = jax.random.randint(k_op, (), 0, NUM_OPS)
            m = magnitude + magnitude_std * jax.random.normal(k_mag)
            level = jnp.clip(m, 0.0, 10.0) / 10.0
            sign = jnp.where(jax.random.bernoulli(k_sign), 1.0, -1.0)
            out = jax.lax.switch(index, [lambda v, f=f: f(v, level, sign) for f in ops], v)
            v = jnp.where(jax.random.bernoulli(k_apply, prob), out, v)
        return v / 255.0

    return jax.vmap(one)(jax.random.split(key, images.shape[0]), images)
