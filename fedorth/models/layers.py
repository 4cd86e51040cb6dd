"""Shared layers: a matmul-formulated convolution and reshape-based pooling.

Why these exist (docs/PERFORMANCE.md, "XLA:CPU traps"): on XLA:CPU the gradient of a
convolution inside a `lax.scan` body runs ~25x slower than outside it (jax-ml/jax#12868), and
`vmap` over a client axis turns convolutions into grouped convolutions, which are slow too. A
convolution written as im2col by shifted slices followed by one `jnp.dot` only uses slices,
concatenations and a matrix product, which stay fast inside loops and under `vmap`.

The loop slowdown comes from the *gradient* convolutions: XLA:CPU rewrites them into its fast
canonical form (batch-spatial-feature input, spatial-in-out kernel) with transposes at the top
level, but not inside loop bodies (the kernel gradient ran 100x slower there). `impl="canonical"`
keeps XLA's forward convolution and writes both gradients as canonical convolutions with explicit
transposes (`conv_general_dilated_canonical`): fast inside loops, `jax.grad`'s sums, the kernel
gradient summed over batch chunks that fit the core's cache (`canonical_kernel_grad`). Layers with
fewer than `CANONICAL_MIN_CHANNELS` (16) input channels (a network's stem) use im2col + dot under
`"canonical"` too, where XLA:CPU's convolution is slow.

`conv2d(features, kernel_size, impl=...)` returns a plain `flax.linen.Conv` in every case (only its
`conv_general_dilated` is swapped), so the parameter tree (`kernel` of shape `(kh, kw, in, out)`,
`bias`) is identical and checkpoints are interchangeable between the implementations. Both
replacements compute in their operands' dtype, which Flax sets (`nn.Conv(dtype=...)` casts input
and kernel): under `model.dtype="bfloat16"` the im2col product and the canonical convolution's
three convolutions (forward, dW, dx) take bfloat16 operands, like XLA's own convolution (dW's
chunks are summed in float32 and rounded once).
`impl="auto"` picks when the module is traced (`resolve_conv_impl`): on CPU the canonical
convolution (per layer, as above) where the round engine declares that clients run one at a time
and are only differentiated in reverse mode (`conv_trace_mode("reverse_unbatched")`, the
`"sequential"` strategy), im2col + dot everywhere else (fast in loops and under `vmap`, any
autodiff mode); `"lax"` on other backends. The canonical convolution's custom VJP admits no
forward-mode autodiff and becomes a grouped convolution under `vmap`, hence the declaration;
inside `conv_trace_mode("forward")` (the objective the engine hands to Sophia for its
Hessian-vector products) `"canonical"` falls back to im2col + dot. docs/PERFORMANCE.md has the
measurements.
"""

import contextlib
import contextvars
from collections.abc import Sequence
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

CONV_IMPLS = ("lax", "matmul", "canonical", "auto")


def check_choice(argument: str, value, choices: Sequence) -> None:
    """Raises a ValueError naming `argument`, its `value` and the valid `choices`."""
    if value not in choices:
        raise ValueError(f"{argument}={value!r} is not supported; valid choices: {list(choices)}.")


def check_image_size(images: jnp.ndarray, size: int, model: str) -> None:
    """Raises a ValueError unless ``images [B, H, W, C]`` are ``size × size`` (learned shapes)."""
    if images.shape[1] != size or images.shape[2] != size:
        raise ValueError(
            f"{model} expects {size}x{size} images; got {images.shape[1:3]}: resize the data "
            "(data.image_size) or set model.image_size."
        )


def as_float(x: jnp.ndarray) -> jnp.ndarray:
    """Casts integer/bool inputs to float32; floating inputs keep their dtype."""
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


# Values of the config key `model.dtype` (every model's `dtype` argument): the compute dtype.
MODEL_DTYPES = ("float32", "bfloat16")


def compute_dtype(dtype) -> jnp.dtype | None:
    """The Flax compute dtype (`dtype=` of its layers) for a model's `dtype` argument.

    Mixed precision: with `"bfloat16"` the activations, matrix products and convolutions run in
    bfloat16, while parameters stay float32 (Flax's `param_dtype`), so gradients, optimizer
    states, uploads and server averages stay float32 too; normalization statistics (BatchNorm,
    GroupNorm, LayerNorm, RMSNorm), softmax and the loss are computed in float32, and every
    model returns float32 logits. `"float32"` returns None: Flax infers the dtype from the
    inputs and parameters (float32; float64 under `jax.enable_x64` in the tests), exactly the
    computation of a model without the argument.

    Args:
      dtype: `"float32"` (or None, `jnp.float32`) or `"bfloat16"` (or `jnp.bfloat16`).

    Raises:
      ValueError: one line naming `model.dtype` and the valid values.
    """
    if dtype is None:
        return None
    try:
        name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in MODEL_DTYPES:
        raise ValueError(
            f"model.dtype={dtype!r} is not supported; valid choices: {list(MODEL_DTYPES)}."
        )
    return None if name == "float32" else jnp.dtype(name)


def float_logits(logits: jnp.ndarray) -> jnp.ndarray:
    """`logits` in float32 or wider: bfloat16 model outputs are cast before the loss/softmax."""
    return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


# What the convolutions traced inside a context are used for (`conv_trace_mode`): None (not known),
# "reverse_unbatched" (one client at a time, reverse-mode gradients only: the engine's sequential
# client loop) or "forward" (a forward-mode derivative will be taken: Sophia's Hessian-vector
# products).
CONV_TRACE_MODES = (None, "reverse_unbatched", "forward")
_CONV_TRACE_MODE: contextvars.ContextVar = contextvars.ContextVar(
    "fedorth_conv_trace_mode", default=None
)


@contextlib.contextmanager
def conv_trace_mode(mode: str | None):
    """Declares, while a model is traced inside it, how its convolutions will be transformed.

    `"reverse_unbatched"`: they run unbatched (no `vmap` over them) and are differentiated in
    reverse mode only, so `impl="auto"` may pick the canonical convolution on CPU
    (`resolve_conv_impl`); the round engine enters it around the sequential strategy's client
    loop. `"forward"`: a forward-mode derivative will be taken (jvp, e.g. forward-over-reverse
    Hessian-vector products), so the custom-VJP canonical convolution is replaced by im2col + dot
    (same values); the engine enters it around the objective it hands to the local optimizer.
    `None` resets to "not known". The mode is read when a convolution layer is traced, so enter
    it inside the function that is jitted (a jit cache does not see it).
    """
    check_choice("conv_trace_mode", mode, CONV_TRACE_MODES)
    token = _CONV_TRACE_MODE.set(mode)
    try:
        yield
    finally:
        _CONV_TRACE_MODE.reset(token)


# What `impl="auto"` stands for while a model is traced inside `auto_conv_impl` (None: the rule
# of `resolve_conv_impl`).
_AUTO_CONV_IMPL: contextvars.ContextVar = contextvars.ContextVar(
    "fedorth_auto_conv_impl", default=None
)


@contextlib.contextmanager
def auto_conv_impl(impl: str | None):
    """While a model is traced inside it, `impl="auto"` stands for `impl` (`"lax"` or `"matmul"`).

    The round engine's measured choice on one accelerator (`fedorth.fed.autotune`: a vmapped
    round with im2col convolutions, a sequential one with XLA's). `None` restores the rule of
    `resolve_conv_impl`. Read when a convolution is traced: enter it inside the jitted function.
    """
    check_choice("auto_conv_impl", impl, (None, "lax", "matmul"))
    token = _AUTO_CONV_IMPL.set(impl)
    try:
        yield
    finally:
        _AUTO_CONV_IMPL.reset(token)


def resolve_conv_impl(impl: str, mode: str | None = "context") -> str:
    """What `impl` stands for when traced now: resolves `"auto"` and guards `"canonical"`.

    `"auto"` on the CPU backend is `"canonical"` (per layer: the canonical convolution for layers
    with at least `CANONICAL_MIN_CHANNELS` input channels, im2col + dot below) inside
    `conv_trace_mode("reverse_unbatched")` and `"matmul"` (im2col + dot) otherwise; on other
    backends it is `"lax"`. Why: on XLA:CPU, `lax.conv_general_dilated`'s gradients inside a loop
    body (the local-step `lax.scan`, the client loop of sequential/chunked rounds) are 10-100x
    slower than at the top level (jax-ml/jax#12868), and under `vmap` over clients convolutions
    become slow grouped convolutions. im2col + dot is fast in both places and supports every
    autodiff mode; the canonical convolution is faster (ResNet-18 FedAvg rounds 1.3x,
    docs/PERFORMANCE.md) but has a custom VJP, so no forward mode, and is grouped under `vmap`:
    it is picked only where the round engine declares neither happens. GPU/TPU convolutions are
    fast either way, so the native convolution is kept there.

    `"canonical"` becomes `"matmul"` inside `conv_trace_mode("forward")` (same values; a custom
    VJP admits no jvp). Inside `auto_conv_impl(x)`, `"auto"` is `x`. Other values are returned
    unchanged.

    Args:
      impl: one of `CONV_IMPLS`.
      mode: a `CONV_TRACE_MODES` value, or `"context"` (the default) for the enclosing
        `conv_trace_mode`. The backend is `jax.default_backend()` at call time.
    """
    check_choice("conv_impl", impl, CONV_IMPLS)
    if mode == "context":
        mode = _CONV_TRACE_MODE.get()
    check_choice("mode", mode, CONV_TRACE_MODES)
    if impl == "auto" and _AUTO_CONV_IMPL.get() is not None:
        return _AUTO_CONV_IMPL.get()
    if impl == "auto":
        if jax.default_backend() != "cpu":
            return "lax"
        return "canonical" if mode == "reverse_unbatched" else "matmul"
    if impl == "canonical" and mode == "forward":
        return "matmul"
    return impl


def _explicit_padding(padding, in_spatial, window, strides) -> list[tuple[int, int]]:
    if isinstance(padding, str):
        return [tuple(p) for p in lax.padtype_to_pads(in_spatial, window, strides, padding)]
    return [(int(lo), int(hi)) for lo, hi in padding]


def _check_conv_args(
    who, lhs, rhs, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count
) -> None:
    """The subset of `lax.conv_general_dilated` the replacement convolutions implement."""
    if lhs.ndim != 4 or rhs.ndim != 4:
        raise ValueError(
            f"{who} supports 2-D convolutions only; got lhs.ndim={lhs.ndim}, "
            f"rhs.ndim={rhs.ndim} (expected 4 and 4)."
        )
    for name, dilation in (("lhs_dilation", lhs_dilation), ("rhs_dilation", rhs_dilation)):
        if dilation is not None and any(d != 1 for d in dilation):
            raise ValueError(f"{name}={dilation} is not supported by {who} (use 1).")
    if feature_group_count != 1:
        raise ValueError(
            f"feature_group_count={feature_group_count} is not supported by {who} (valid: 1)."
        )
    if dimension_numbers is not None:
        expected = lax.conv_dimension_numbers(lhs.shape, rhs.shape, ("NHWC", "HWIO", "NHWC"))
        if lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) != expected:
            raise ValueError(
                f"dimension_numbers={dimension_numbers} is not supported by {who}: it needs "
                "NHWC inputs and HWIO kernels."
            )
    if lhs.shape[-1] != rhs.shape[2]:
        raise ValueError(f"input channels {lhs.shape[-1]} != kernel input channels {rhs.shape[2]}.")


def conv_general_dilated_matmul(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    precision=None,
):
    """2-D convolution as im2col by shifted slices and one matrix product.

    y[b, p, q, o] = sum_{i, j, c} x_pad[b, s_h·p + i, s_w·q + j, c] · w[i, j, c, o]

    The kh·kw strided views `x_pad[:, i::s_h, j::s_w, :]` are concatenated on the channel axis in
    (i, j, c) order, which is exactly the row order of `w.reshape(kh·kw·in, out)`, so the result is
    one `jnp.dot`. Drop-in for `lax.conv_general_dilated` as called by `flax.linen.Conv` (keyword
    `conv_general_dilated`), restricted to what the models here use.

    Args:
      lhs: input `[B, H, W, C]` (NHWC).
      rhs: kernel `[kh, kw, C, O]` (HWIO, Flax's layout).
      window_strides: `(s_h, s_w)`.
      padding: `"SAME"`, `"VALID"` (or any `lax.padtype_to_pads` string) or `[(lo, hi), (lo, hi)]`.
      lhs_dilation: must be None or all ones.
      rhs_dilation: must be None or all ones.
      dimension_numbers: must describe NHWC/HWIO/NHWC (what `flax.linen.Conv` passes), or None.
      feature_group_count: must be 1.
      precision: passed to `jnp.dot`.

    Returns:
      `[B, H_out, W_out, O]`, equal to `lax.conv_general_dilated` up to summation order.
    """
    _check_conv_args(
        "conv_general_dilated_matmul",
        lhs,
        rhs,
        lhs_dilation,
        rhs_dilation,
        dimension_numbers,
        feature_group_count,
    )
    kh, kw, c_in, c_out = rhs.shape
    sh, sw = window_strides
    pads = _explicit_padding(padding, lhs.shape[1:3], (kh, kw), (sh, sw))
    x = jnp.pad(lhs, ((0, 0), pads[0], pads[1], (0, 0)))
    batch, height, width, _ = x.shape
    out_h = (height - kh) // sh + 1
    out_w = (width - kw) // sw + 1
    if out_h <= 0 or out_w <= 0:
        raise ValueError(f"kernel {(kh, kw)} is larger than the padded input {(height, width)}.")
    views = [
        lax.slice(
            x,
            (0, i, j, 0),
            (batch, i + (out_h - 1) * sh + 1, j + (out_w - 1) * sw + 1, c_in),
            (1, sh, sw, 1),
        )
        for i in range(kh)
        for j in range(kw)
    ]
    columns = views[0] if len(views) == 1 else jnp.concatenate(views, axis=-1)
    return jnp.dot(columns, rhs.reshape(kh * kw * c_in, c_out), precision=precision)


_NHWC = ("NHWC", "HWIO", "NHWC")


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _canonical_conv(x, w, strides, pads, precision):
    return lax.conv_general_dilated(
        x, w, strides, pads, dimension_numbers=_NHWC, precision=precision
    )


def _canonical_conv_fwd(x, w, strides, pads, precision):
    return _canonical_conv(x, w, strides, pads, precision), (x, w)


# The kernel gradient's convolution takes dy as its kernel, contracting the batch. XLA:CPU runs it
# up to 6x slower when that kernel outgrows the core's cache (a 5x5 conv's dW, 50x16x16x32 -> 64:
# 37 ms in one call, 20 ms in chunks of 5 images; a 3x3 64 -> 64 one on 32x32 images: 571 ms
# against 91 ms image by image; docs/PERFORMANCE.md, "Kernel gradients in batch chunks"), so the
# batch is cut into chunks whose share of dy stays under this many bytes.
KERNEL_GRAD_CHUNK_BYTES = 320 * 1024


def kernel_grad_chunk(batch: int, image_bytes: int, kernel_bytes: int) -> int:
    """Images per chunk of the canonical kernel gradient, from 1 to `batch`.

    As many as keep the chunk's share of dy (`image_bytes` per image) within
    `KERNEL_GRAD_CHUNK_BYTES`, but no fewer than `kernel_bytes / image_bytes`: each chunk adds a
    kernel-sized partial sum, and those additions must not move more bytes than dy itself (a
    3x3 512 -> 512 layer on 4x4 images has a 9.4 MB dW against 32 KB of dy per image, and runs
    fastest in one call)."""
    image_bytes = max(1, image_bytes)
    by_cache = KERNEL_GRAD_CHUNK_BYTES // image_bytes
    by_sums = -(-kernel_bytes // image_bytes)
    return max(1, min(batch, max(by_cache, by_sums)))


def canonical_kernel_grad(x, dy, w, strides, pads, precision=None, chunk=None):
    """dW of the canonical convolution, summed over batch chunks of `chunk` images.

    dW[i, j, c, o] = sum_{b, p, q} x_pad[b, s_h p + i, s_w q + j, c] dy[b, p, q, o]: a forward
    convolution with batch and feature axes swapped (C is the batch, B the contracted feature)
    and dy as a kernel dilated by the stride. Rows past (kh, kw) are cut (strided remainders).
    Chunks are summed in float32 at least (`preferred_element_type`), then cast to the kernel's
    dtype once, so a bfloat16 gradient is rounded once, as by one convolution.

    Args:
      x: the input `[B, H, W, C]`.
      dy: the output's cotangent `[B, H_out, W_out, O]`.
      w: the kernel `[kh, kw, C, O]` (its shape and dtype are read).
      strides: `(s_h, s_w)`.
      pads: `((lo, hi), (lo, hi))`.
      precision: passed to the convolutions.
      chunk: images per chunk; None: `kernel_grad_chunk` (the backward pass's choice), B: one
        convolution.

    Returns:
      dW `[kh, kw, C, O]` in `w`'s dtype.
    """
    kh, kw = w.shape[:2]
    acc_dtype = jnp.promote_types(dy.dtype, jnp.float32)

    def conv(x, dy):
        dw = lax.conv_general_dilated(
            jnp.transpose(x, (3, 1, 2, 0)),
            jnp.transpose(dy, (1, 2, 0, 3)),
            (1, 1),
            pads,
            rhs_dilation=strides,
            dimension_numbers=_NHWC,
            precision=precision,
            preferred_element_type=acc_dtype,
        )
        return dw[:, :kh, :kw, :]

    batch = x.shape[0]
    if chunk is None:
        itemsize = jnp.dtype(acc_dtype).itemsize
        chunk = kernel_grad_chunk(batch, dy[0].size * dy.dtype.itemsize, w.size * itemsize)
    if chunk >= batch:
        dw = conv(x, dy)
    else:
        full, rest = divmod(batch, chunk)

        def step(total, chunk_xy):
            return total + conv(*chunk_xy), None

        split = full * chunk
        chunks = (
            x[:split].reshape(full, chunk, *x.shape[1:]),
            dy[:split].reshape(full, chunk, *dy.shape[1:]),
        )
        zero = jnp.zeros((x.shape[-1], kh, kw, dy.shape[-1]), acc_dtype)
        dw, _ = lax.scan(step, zero, chunks)
        if rest:
            dw = dw + conv(x[split:], dy[split:])
    return jnp.transpose(dw, (1, 2, 0, 3)).astype(w.dtype)


def _canonical_conv_bwd(strides, pads, precision, residuals, dy):
    x, w = residuals
    kh, kw = w.shape[:2]
    dw = canonical_kernel_grad(x, dy, w, strides, pads, precision)
    # dx: dy dilated by the stride, correlated with the flipped kernel (in/out swapped); the
    # padding makes the output the input's size.
    dx_pads = []
    for axis, ((low, _), k, s) in enumerate(zip(pads, (kh, kw), strides, strict=True)):
        front = k - 1 - low
        back = x.shape[1 + axis] + k - 1 - front - ((dy.shape[1 + axis] - 1) * s + 1)
        dx_pads.append((front, back))
    dx = lax.conv_general_dilated(
        dy,
        jnp.flip(w, (0, 1)).transpose(0, 1, 3, 2),
        (1, 1),
        dx_pads,
        lhs_dilation=strides,
        dimension_numbers=_NHWC,
        precision=precision,
    )
    return dx, dw


_canonical_conv.defvjp(_canonical_conv_fwd, _canonical_conv_bwd)


def conv_general_dilated_canonical(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    precision=None,
):
    """`lax.conv_general_dilated` whose gradients are canonical convolutions (fast in loops).

    Forward: y = conv(x, w) (XLA's convolution). Backward, with s the strides:
      dW = conv(xᵀ, dyᵀ; kernel dilation s)ᵀ   (batch and feature axes of x and dy swapped),
      dx = conv(dilate_s(dy), flip(w)ᵀ)        (kernel flipped spatially, in/out swapped),
    both in the batch-spatial-feature / spatial-in-out layout that XLA:CPU runs fast inside loop
    bodies, where its own gradient convolutions fall back to a slow generic loop (module
    docstring). The gradients are `jax.grad`'s sums of `lax.conv_general_dilated`; dW is summed
    over batch chunks (`canonical_kernel_grad`), so it differs from one sum by float rounding.
    Drop-in for `flax.linen.Conv(conv_general_dilated=...)`, restricted as
    `conv_general_dilated_matmul`.

    Args:
      lhs: input `[B, H, W, C]` (NHWC).
      rhs: kernel `[kh, kw, C, O]` (HWIO).
      window_strides: `(s_h, s_w)`.
      padding: a `lax.padtype_to_pads` string or `[(lo, hi), (lo, hi)]`.
      lhs_dilation: must be None or all ones.
      rhs_dilation: must be None or all ones.
      dimension_numbers: must describe NHWC/HWIO/NHWC, or None.
      feature_group_count: must be 1.
      precision: passed to the three convolutions.

    Returns:
      `[B, H_out, W_out, O]`, equal to `lax.conv_general_dilated`.
    """
    _check_conv_args(
        "conv_general_dilated_canonical",
        lhs,
        rhs,
        lhs_dilation,
        rhs_dilation,
        dimension_numbers,
        feature_group_count,
    )
    strides = tuple(int(s) for s in window_strides)
    pads = tuple(
        tuple(p) for p in _explicit_padding(padding, lhs.shape[1:3], rhs.shape[:2], strides)
    )
    return _canonical_conv(lhs, rhs, strides, pads, precision)


# Layers with fewer input channels run im2col + dot under `impl="canonical"`: XLA:CPU's
# convolution is slow for them (a 3-channel 5x5 forward took 7.5 ms per CNN step as a
# convolution, 2.4 ms as im2col + dot; docs/PERFORMANCE.md).
CANONICAL_MIN_CHANNELS = 16


def _canonical_or_matmul(lhs, rhs, *args, **kwargs):
    """`impl="canonical"`: the canonical convolution for layers with >= `CANONICAL_MIN_CHANNELS`
    input channels, im2col + dot (`conv_general_dilated_matmul`) below that. Same results."""
    if lhs.shape[-1] >= CANONICAL_MIN_CHANNELS:
        return conv_general_dilated_canonical(lhs, rhs, *args, **kwargs)
    return conv_general_dilated_matmul(lhs, rhs, *args, **kwargs)


_CONV_FNS = {
    "lax": None,
    "matmul": conv_general_dilated_matmul,
    "canonical": _canonical_or_matmul,
}


def conv2d(
    features: int,
    kernel_size: tuple[int, int],
    *,
    strides: tuple[int, int] = (1, 1),
    padding="SAME",
    use_bias: bool = True,
    impl: str = "lax",
    name: str | None = None,
    **kwargs,
) -> nn.Conv:
    """A `flax.linen.Conv` computed by XLA's convolution (`"lax"`) or by im2col + dot (`"matmul"`).

    Args:
      features: output channels.
      kernel_size: `(kh, kw)`.
      strides: `(s_h, s_w)`.
      padding: as `flax.linen.Conv`.
      use_bias: add a bias.
      impl: `"lax"` (`lax.conv_general_dilated`), `"matmul"` (`conv_general_dilated_matmul`),
        `"canonical"` (`conv_general_dilated_canonical` for layers with at least
        `CANONICAL_MIN_CHANNELS` input channels, `"matmul"` for the others) or `"auto"`
        (`resolve_conv_impl`).
      name: module name (defaults to Flax's auto-naming, `Conv_0`, ...).
      **kwargs: forwarded to `flax.linen.Conv` (e.g. `kernel_init`).

    Returns:
      A `flax.linen.Conv` with the same parameter layout for both implementations.
    """
    conv_fn = _CONV_FNS[resolve_conv_impl(impl)]
    return nn.Conv(
        features,
        kernel_size,
        strides=strides,
        padding=padding,
        use_bias=use_bias,
        conv_general_dilated=conv_fn,
        name=name,
        **kwargs,
    )


class Dropout(nn.Module):
    """Inverted dropout drawing 16 random bits per element (half the PRNG work of `nn.Dropout`).

    Each element is kept with probability `t / 2**16`, `t = round((1 - rate) * 2**16)`, and kept
    elements are scaled by `2**16 / t`, so the output is an unbiased estimate of the input (as
    with `nn.Dropout`) and the drop probability is within `2**-17` of `rate` (`nn.Dropout`
    compares a 23-bit uniform float, so its probability is quantized too, more finely). One
    32-bit word of `jax.random.bits` decides two elements: its low half-word the first
    `ceil(d/2)` entries of the last axis, its high half-word the rest.

    Why: threefry random bits are the most expensive part of dropout on CPU; in ViT-Tiny (dropout
    0.1 on attention probabilities, attention output and both MLP layers) `nn.Dropout` took a
    quarter of a FedAvg round on a 2-core CPU, and halving the bits made the round 1.2x faster
    (docs/PERFORMANCE.md). The masks differ from `nn.Dropout`'s for the same key (another
    stream); everything else about dropout is unchanged.

    Attributes:
      rate: drop probability in [0, 1]; 1 drops everything.
      deterministic: if True, the input is returned unchanged (may also be given per call).
      rng_collection: the RNG stream the mask key is drawn from.
    """

    rate: float
    deterministic: bool | None = None
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(
        self, inputs: jnp.ndarray, deterministic: bool | None = None, rng=None
    ) -> jnp.ndarray:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"Dropout rate={self.rate} must be in [0, 1].")
        threshold = round((1.0 - self.rate) * 65536)
        if deterministic or threshold >= 65536:
            return inputs
        if threshold == 0:
            return jnp.zeros_like(inputs)
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        return dropout_mask_apply(rng, inputs, threshold)


def dropout_mask_apply(key: jax.Array, x: jnp.ndarray, threshold: int) -> jnp.ndarray:
    """`where(keep, x · 2**16 / threshold, 0)` with `keep` from 16-bit halves of random words.

    `keep[..., :h] = low16(bits) < threshold`, `keep[..., h:] = high16(bits) < threshold` for
    `bits = jax.random.bits(key, x.shape[:-1] + (h,), uint32)`, `h = ceil(d / 2)` (the last
    high half-word is unused when `d` is odd). `Dropout`'s body, public for its tests.
    """
    shape = x.shape if x.ndim else (1,)
    half = (shape[-1] + 1) // 2
    bits = jax.random.bits(key, (*shape[:-1], half), jnp.uint32)
    keep = jnp.concatenate([(bits & 0xFFFF) < threshold, (bits >> 16) < threshold], axis=-1)
    keep = keep[..., : shape[-1]].reshape(x.shape)
    # The scale in float32 (or wider): 2**16 / t rounded to bfloat16's 8-bit mantissa would bias
    # the kept values by up to 0.4%; each product is rounded once to x's dtype instead.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    scale = jnp.asarray(65536.0 / threshold, wide)
    return jnp.where(keep, (x.astype(wide) * scale).astype(x.dtype), jnp.zeros_like(x))


def _pool_windows(x: jnp.ndarray, window: tuple[int, int]) -> jnp.ndarray:
    """`[..., H, W, C]` → `[..., H//wh, wh, W//ww, ww, C]` (VALID: the remainder is cut)."""
    wh, ww = window
    *lead, height, width, channels = x.shape
    oh, ow = height // wh, width // ww
    if oh == 0 or ow == 0:
        raise ValueError(f"pool window {window} is larger than the input {(height, width)}.")
    x = x[..., : oh * wh, : ow * ww, :]
    return x.reshape(*lead, oh, wh, ow, ww, channels)


def max_pool(x: jnp.ndarray, window: tuple[int, int] = (2, 2)) -> jnp.ndarray:
    """Non-overlapping max pool (stride = window, VALID) by reshape: cheap under `vmap`.

    Equals `flax.linen.max_pool(x, window, strides=window, padding="VALID")`.
    """
    return _pool_windows(x, window).max(axis=(-4, -2))


def avg_pool(x: jnp.ndarray, window: tuple[int, int] = (2, 2)) -> jnp.ndarray:
    """Non-overlapping average pool (stride = window, VALID) by reshape: cheap under `vmap`.

    Equals `flax.linen.avg_pool(x, window, strides=window, padding="VALID")`.
    """
    return _pool_windows(x, window).mean(axis=(-4, -2))
