"""RandAugment and resizing on the device (fedorth.data.randaugment): the pixel operations are
PIL's (ImageOps / ImageEnhance, which timm's RandAugment calls) on the 0..255 grid."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fast_jit
from PIL import Image, ImageEnhance, ImageOps

from fedorth.data import randaugment as R

IMAGE = np.random.default_rng(0).integers(20, 236, (12, 10, 3)).astype(np.uint8)


def _pil(fn):
    return np.asarray(fn(Image.fromarray(IMAGE)), np.float64)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (R.equalize, ImageOps.equalize),
        (lambda v: R.posterize(v, 2), lambda im: ImageOps.posterize(im, 2)),
        (lambda v: R.solarize(v, 100), lambda im: ImageOps.solarize(im, 100)),
    ],
    ids=["equalize", "posterize", "solarize"],
)
def test_exact_pixel_operations_equal_pil(ours, theirs):
    out = np.asarray(ours(jnp.asarray(IMAGE, jnp.float32)))
    np.testing.assert_array_equal(out, _pil(theirs))


def test_autocontrast_equals_pil_but_at_float32_ties():
    """PIL evaluates ⌊i·s − lo·s⌋ in float64, ours in float32: they may differ by one level only
    where the float64 value lies within float32 rounding of an integer."""
    out = np.asarray(R.autocontrast(jnp.asarray(IMAGE, jnp.float32)))
    expected = _pil(ImageOps.autocontrast)
    v = IMAGE.astype(np.float64)
    lo, hi = v.min(axis=(0, 1)), v.max(axis=(0, 1))
    exact = v * (255.0 / (hi - lo)) - lo * (255.0 / (hi - lo))
    ties = np.abs(exact - np.round(exact)) < 1e-4
    assert np.max(np.abs(out - expected)) <= 1.0
    assert np.all(ties[out != expected])


@pytest.mark.parametrize(
    "ours, enhancer",
    [
        (R.color, ImageEnhance.Color),
        (R.contrast, ImageEnhance.Contrast),
        (R.brightness, ImageEnhance.Brightness),
        (R.sharpness, ImageEnhance.Sharpness),
    ],
    ids=["color", "contrast", "brightness", "sharpness"],
)
@pytest.mark.parametrize("factor", [0.19, 1.81])
def test_enhance_operations_equal_pil(ours, enhancer, factor):
    """The same grey conversion, smoothing and float32 blend with truncation as PIL."""
    out = np.asarray(ours(jnp.asarray(IMAGE, jnp.float32), factor))
    np.testing.assert_array_equal(out, _pil(lambda im: enhancer(im).enhance(factor)))


def test_translation_by_whole_pixels_shifts_and_fills_with_the_mean():
    v = jnp.asarray(IMAGE, jnp.float32)
    level = 2.0 / (0.45 * 10)  # 2 pixels of a width of 10
    out = np.asarray(R._geometric("translate_x", v, level, 1.0))
    np.testing.assert_allclose(out[:, :-2], IMAGE[:, 2:], atol=1e-4)
    np.testing.assert_allclose(out[:, -2:], np.broadcast_to([124, 116, 104], (12, 2, 3)))
    rotated = np.asarray(R._geometric("rotate", v, 0.0, 1.0))
    np.testing.assert_allclose(rotated, IMAGE, atol=1e-4)  # 0 degrees: identity


def test_rand_augment_draws_ops_uniformly_and_keeps_shape_and_range():
    images = jnp.asarray(np.broadcast_to(IMAGE / 255.0, (64, 12, 10, 3)), jnp.float32)
    out = fast_jit(R.rand_augment)(jax.random.key(0), images)
    assert out.shape == images.shape and float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    changed = np.any(np.abs(np.asarray(out) - np.asarray(images)) > 1e-6, axis=(1, 2, 3))
    # Each of 2 ops applies w.p. 1/2 (a few ops can be no-ops): P(untouched) >= 1/4.
    assert 0.1 < 1 - changed.mean() < 0.5
    again = fast_jit(R.rand_augment)(jax.random.key(0), images)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))


def test_resize_is_bilinear_to_the_target_size():
    images = jnp.asarray(np.random.default_rng(1).random((2, 32, 32, 3)), jnp.float32)
    out = R.resize(images, 224)
    assert out.shape == (2, 224, 224, 3)
    # Upsampling a constant image is exact; the mean is kept to within interpolation error.
    np.testing.assert_allclose(R.resize(jnp.ones((1, 32, 32, 3)), 224), 1.0, rtol=1e-6)
    np.testing.assert_allclose(out.mean(), images.mean(), atol=2e-3)


def test_batches_are_augmented_then_resized_on_device_and_test_batches_resized():
    import tensorflow_datasets as tfds

    from configs import base
    from fedorth.train import builders

    config = base.get_base_config()
    config.data.name = "cifar10"
    config.data.num_clients = 2
    config.data.partition = "iid"
    config.data.dataset_kwargs.max_train = 8
    config.data.dataset_kwargs.max_test = 4
    config.data.rand_augment = True
    config.data.image_size = 48
    config.fed.batch_size = 4
    with tfds.testing.mock_data(num_examples=8, policy=tfds.testing.MockPolicy.USE_CODE):
        fed_data = builders.build_data(config, 0)
    batch_fn = builders.make_batch_fn(config)
    batch = fast_jit(batch_fn)(fed_data, 0, jax.random.key(0))
    assert batch["x"].shape == (4, 48, 48, 3)
    config.data.rand_augment = False
    plain = fast_jit(builders.make_batch_fn(config))(fed_data, 0, jax.random.key(0))
    # Same examples (the sampling key is unchanged by RandAugment), different pixels.
    np.testing.assert_array_equal(batch["y"], plain["y"])
    assert float(jnp.abs(batch["x"] - plain["x"]).max()) > 0.1
    config.data.name = "digits"
    config.data.rand_augment = True
    with pytest.raises(ValueError, match=r"data.rand_augment=True needs an RGB image dataset"):
        builders.make_batch_fn(config)
