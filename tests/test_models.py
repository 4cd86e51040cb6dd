"""Tests for fedorth.models: sizes, train/eval contract, matmul convolution, masks, vmap.

Compilation dominates the run time on CPU, so every model function is jitted once per shape and
the heavy ones run at toy sizes: ResNet-18's layer types (CIFAR stem, a BasicBlock with an
identity shortcut, a stride-2 BasicBlock with a 1x1 projection shortcut, BN/GN) at width 1/8 in two
stages of one block; parameter counts of the full models use `jax.eval_shape` (no memory, no
compilation).
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fast_jit
from jax import lax

from fedorth.models import MODELS, Model, get_model
from fedorth.models.layers import (
    Dropout,
    avg_pool,
    conv2d,
    conv_trace_mode,
    dropout_mask_apply,
    max_pool,
    resolve_conv_impl,
)
from fedorth.models.llama import LLAMA_SIZES, Llama, apply_rotary, rms_norm
from fedorth.models.resnet import ResNet18
from fedorth.models.vit import patchify, sinusoidal_positions

# Model maths against float64 NumPy or one program against another: tests/helpers.py.
jit = fast_jit


def num_params(tree) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


def shape_count(model, x) -> tuple[int, int]:
    """Parameter and state counts from `jax.eval_shape` (no memory is allocated)."""
    params, state = jax.eval_shape(model.init, jax.random.key(0), x)
    return num_params(params), num_params(state)


def to_f64(tree):
    """Casts floating leaves to float64 NumPy arrays (integer tokens and labels stay integers);
    NumPy, not jnp: an eager cast compiles a program per leaf shape."""
    cast = lambda a: np.asarray(a, np.float64 if jnp.issubdtype(a.dtype, jnp.floating) else None)
    return jax.tree.map(cast, tree)


def stack(trees):
    """Stacks trees leaf by leaf along a new leading (client) axis, in NumPy."""
    return jax.tree.map(lambda *leaves: np.stack([np.asarray(x) for x in leaves]), *trees)


def assert_trees_close(a, b, *, rtol, atol, msg=""):
    assert jax.tree.structure(a) == jax.tree.structure(b), msg
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=msg)


IMAGES = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
TOKENS = jax.ShapeDtypeStruct((2, 16), jnp.int32)

# Toy configurations of every registered model: (kwargs, batch shape, input high, classes).
TINY = {
    "mlp": (dict(hidden_sizes=(16,)), (4, 8, 8), None, 10),
    "lenet5": ({}, (4, 28, 28, 1), None, 10),
    "cnn": (dict(features=(4, 8), dense_sizes=(16, 8)), (4, 16, 16, 3), None, 10),
    "resnet18": (dict(width=0.125), (4, 8, 8, 3), None, 10),
    "vit_tiny": (dict(dim=16, depth=1, num_heads=2, num_classes=10), (4, 8, 8, 3), None, 10),
    "vit_zg": (dict(dim=16, depth=1, num_heads=2, head_dim=8, mlp_dim=32), (4, 8, 8, 3), None, 10),
    "rnn": (dict(hidden_size=8, vocab_size=20, embed_dim=6), (4, 5), 20, 2),
    "llama": (dict(num_layers=1), (4, 9), 256, None),  # the "tiny" shape, one layer
}


def tiny_model(name: str, **overrides) -> Model:
    if name == "resnet18":
        # Every ResNet-18 layer type at 1/8 width: stage 1's block keeps its input (identity
        # shortcut), stage 2's strides by 2 (1x1 projection shortcut); stages 3-4 repeat stage 2's
        # layers at more channels, which the full-size counts above check through eval_shape.
        kwargs = dict(num_classes=10, width=0.125, stage_sizes=(1, 1, 0, 0)) | overrides
        return Model(ResNet18(**kwargs))
    if name == "llama":
        # The "tiny" shape with one decoder layer instead of two: every layer type (embedding,
        # rotary attention, SwiGLU MLP, RMSNorms, untied output), half the compile; the sizes'
        # full depths are counted through eval_shape above.
        s = LLAMA_SIZES["tiny"]
        layer = (s.vocab_size, s.hidden_size, s.intermediate_size, s.num_heads)
        return Model(Llama(*layer, **(TINY[name][0] | overrides)), task="lm")
    return get_model(name, **(TINY[name][0] | overrides))


def tiny_batch(name: str, seed: int, batch_size: int | None = None) -> dict:
    """A batch drawn with NumPy (no per-shape compilation of random kernels)."""
    _, shape, high, classes = TINY[name]
    if batch_size is not None:
        shape = (batch_size,) + shape[1:]
    rng = np.random.default_rng(seed)
    if high is None:
        batch = {"x": jnp.asarray(rng.normal(size=shape), jnp.float32)}
    else:  # token ids; the RNN's pad id 0 is avoided here
        low = 0 if name == "llama" else 1
        batch = {"x": jnp.asarray(rng.integers(low, high, size=shape), jnp.int32)}
    if classes is not None:
        batch["y"] = jnp.asarray(rng.integers(0, classes, size=shape[:1]), jnp.int32)
    return batch


def perturbed(tree, seed: int, scale: float = 0.1):
    """tree ⊙ (1 + scale·N(0, 1)) leaf-wise, in NumPy (distinct clients, no compile)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: np.asarray(a) * (1.0 + scale * rng.normal(size=a.shape)).astype(a.dtype), tree
    )


def rbg_key(seed: int) -> jax.Array:
    """A PRNG key whose random draws compile fast on CPU (see `tiny_setup`)."""
    return jax.random.key(seed, impl="rbg")


@functools.cache
def tiny_setup(name: str):
    """(model, params, state, batch) shared by the tests of one model (one init compile).

    Flax's init draws every parameter with the key's PRNG; with threefry keys XLA:CPU spends
    ~0.1-0.3 s compiling each draw, with "rbg" keys (XLA's RngBitGenerator) ~5x less. So the toy
    models are initialized once per test process, from rbg keys.
    """
    model = tiny_model(name)
    batch = tiny_batch(name, 4)
    params, state = jit(model.init)(rbg_key(5), batch["x"])
    return model, params, state, batch


@functools.cache
def contract_fn(name: str):
    """One compiled program per toy model for the train/eval contract tests:
    ``((loss, (new_state, metrics)), grads), eval sums, eval-mode logits`` of a batch."""
    model = tiny_model(name)

    def run(params, state, batch, key):
        inputs, _ = inputs_targets(model, batch)
        step = jax.value_and_grad(model.loss_fn, has_aux=True)(params, state, batch, key)
        return step, model.eval_fn(params, state, batch), model.predict_fn(params, state, inputs)

    return jit(run)


@functools.cache
def f64_train_step(name: str, conv_impl: str | None = None):
    """Jitted value_and_grad(loss_fn) of a toy model, shared by tests (one compile per shape)."""
    model = tiny_model(name, **({} if conv_impl is None else {"conv_impl": conv_impl}))
    return jit(jax.value_and_grad(model.loss_fn, has_aux=True))


# ---------------------------------------------------------------- registry and arguments


def test_registry_names_and_unknown_name():
    assert set(TINY) <= set(MODELS), "every architecture model is registered"
    with pytest.raises(ValueError, match=r"resnet50.*valid names.*resnet18"):
        get_model("resnet50")


@pytest.mark.parametrize(
    "name,kwargs,argument",
    [
        ("resnet18", dict(norm="layer"), "norm"),
        ("resnet18", dict(norm="group", num_groups=3), "num_groups"),
        ("cnn", dict(conv_impl="fft"), "conv_impl"),
        ("lenet5", dict(pool="median"), "pool"),
        ("vit_tiny", dict(pool="max"), "pool"),
        ("vit_tiny", dict(num_heads=5), "num_heads"),
        ("llama", dict(size="7b"), "size"),
        ("rnn", dict(hidden_size=0), "hidden_size"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(name, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        get_model(name, **kwargs)


# ---------------------------------------------------------------- parameter counts


def test_lenet5_has_61706_parameters_for_28_and_32_inputs():
    # conv1 5·5·1·6+6, conv2 5·5·6·16+16, fc 400·120+120, 120·84+84, 84·10+10.
    expected = (25 * 6 + 6) + (25 * 6 * 16 + 16) + (400 * 120 + 120) + (120 * 84 + 84) + 850
    assert expected == 61_706
    model = get_model("lenet5")
    for hw in (28, 32):
        x = jax.ShapeDtypeStruct((2, hw, hw, 1), jnp.float32)
        assert shape_count(model, x) == (61_706, 0), f"LeNet-5 on {hw}x{hw} must have 61,706"


def test_cnn_and_mlp_parameter_counts():
    # 5·5·3·32+32, 5·5·32·64+64, 8·8·64·384+384, 384·192+192, 192·10+10 (SAME convs, 2 pools).
    expected = 2432 + 51_264 + (8 * 8 * 64 * 384 + 384) + (384 * 192 + 192) + (192 * 10 + 10)
    assert shape_count(get_model("cnn"), IMAGES) == (expected, 0) == (1_702_794, 0)
    digits = jax.ShapeDtypeStruct((2, 8, 8), jnp.float32)
    expected_mlp = (64 * 200 + 200) + (200 * 200 + 200) + (200 * 10 + 10)
    assert shape_count(get_model("mlp"), digits) == (expected_mlp, 0)
    assert shape_count(get_model("mlp", hidden_sizes=()), digits) == (64 * 10 + 10, 0)


def test_resnet18_cifar_parameter_count():
    # 11,173,962 is the standard CIFAR ResNet-18 (3x3 stem, BN, 10 classes) count; BN keeps
    # mean/var for its 4,800 channels (stem 64, stage widths 4·64, 5·128, 5·256, 5·512).
    batch_channels = 64 + 4 * 64 + 5 * 128 + 5 * 256 + 5 * 512
    assert shape_count(get_model("resnet18"), IMAGES) == (11_173_962, 2 * batch_channels)
    # GroupNorm has the same affine parameters and no state.
    assert shape_count(get_model("resnet18", norm="group"), IMAGES) == (11_173_962, 0)
    # 100 classes: +90 rows of the 512-wide head (+ 90 biases).
    assert shape_count(get_model("resnet18", num_classes=100), IMAGES)[0] == 11_173_962 + 90 * 513


def vit_param_count(*, dim, depth, inner, mlp, patch_dim, tokens, classes, qkv_bias, learned_pos):
    block = (
        2 * dim  # norm1
        + dim * 3 * inner
        + (3 * inner if qkv_bias else 0)  # qkv
        + inner * dim
        + dim  # out projection
        + 2 * dim  # norm2
        + dim * mlp
        + mlp
        + mlp * dim
        + dim  # MLP
    )
    embed = patch_dim * dim + dim + dim + (tokens + 1) * dim * learned_pos  # patch, cls, pos
    return embed + depth * block + 2 * dim + dim * classes + classes


def test_vit_parameter_counts_follow_the_seeds_shapes():
    # FedPAC (Liu et al.) D.4: dim 192, depth 6, 3 heads, patch 4 (64 tokens), MLP ratio 4, 100
    # classes.
    tiny = vit_param_count(
        dim=192,
        depth=6,
        inner=192,
        mlp=768,
        patch_dim=48,
        tokens=64,
        classes=100,
        qkv_bias=True,
        learned_pos=False,
    )
    assert tiny == 2_698_468
    assert shape_count(get_model("vit_tiny"), IMAGES) == (tiny, 0)
    # FedMuon (Zhang & Gao) Table 2: 8 heads x 64, depth 6, MLP 512, dim 512 (reference script), 10
    # classes.
    zg = vit_param_count(
        dim=512,
        depth=6,
        inner=512,
        mlp=512,
        patch_dim=48,
        tokens=64,
        classes=10,
        qkv_bias=False,
        learned_pos=True,
    )
    assert zg == 9_523_722
    assert shape_count(get_model("vit_zg"), IMAGES) == (zg, 0)


def test_rnn_parameter_count_seed_shapes():
    # Two tanh layers (300→4096, 4096→4096, each with W_hh 4096² and one bias) + 4096→2 head.
    h = 4096
    expected = (300 * h + h * h + h) + (h * h + h * h + h) + (h * 2 + 2)
    vectors = jax.ShapeDtypeStruct((2, 7, 300), jnp.float32)
    assert shape_count(get_model("rnn"), vectors) == (expected, 0) == (51_576_834, 0)
    tokens = jax.ShapeDtypeStruct((2, 7), jnp.int32)
    assert shape_count(get_model("rnn", vocab_size=1000), tokens)[0] == expected + 1000 * 300


@pytest.mark.parametrize(
    "size,nominal,exact",
    [("60m", 60e6, 58_073_600), ("130m", 130e6, 134_105_856), ("350m", 350e6, 367_969_280)],
)
def test_llama_parameter_counts(size, nominal, exact):
    s = LLAMA_SIZES[size]
    d, f = s.hidden_size, s.intermediate_size
    per_layer = 4 * d * d + 3 * d * f + 2 * d  # q,k,v,o; gate,up,down; two RMSNorms
    analytic = 2 * s.vocab_size * d + s.num_layers * per_layer + d  # untied embeddings
    assert analytic == exact
    assert shape_count(get_model("llama", size=size), TOKENS) == (exact, 0)
    # The GaLore names round these counts: 58.1M→"60M", 134.1M→"130M", 368.0M→"350M".
    assert abs(exact - nominal) / nominal < 0.06, "LLaMA size drifted from its nominal name"
    tied = shape_count(get_model("llama", size=size, tie_embeddings=True), TOKENS)[0]
    assert tied == exact - s.vocab_size * d


# ---------------------------------------------------------------- matmul convolution


@pytest.mark.parametrize(
    "kernel_size,strides,padding",
    [
        ((3, 3), (1, 1), "SAME"),
        ((3, 3), (2, 2), "SAME"),
        ((5, 3), (1, 1), "VALID"),
        ((5, 3), (2, 2), "VALID"),
        ((3, 3), (2, 2), ((2, 1), (0, 1))),
        ((1, 1), (2, 2), "VALID"),
    ],
)
def test_matmul_conv_equals_flax_conv_values_and_gradients(kernel_size, strides, padding):
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        x = jnp.asarray(rng.normal(size=(2, 9, 8, 3)))
        reference = nn.Conv(5, kernel_size, strides=strides, padding=padding)
        matmul = conv2d(5, kernel_size, strides=strides, padding=padding, impl="matmul")
        params = {
            "params": {
                "kernel": jnp.asarray(rng.normal(size=kernel_size + (3, 5))),
                "bias": jnp.asarray(rng.normal(size=(5,))),
            }
        }
        # Same parameter layout as nn.Conv: a checkpoint of one loads into the other.
        for module in (reference, matmul):
            shapes = jax.eval_shape(module.init, jax.random.key(0), x)
            assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, params)
        out_shape = jax.eval_shape(reference.apply, params, x).shape
        cotangent = jnp.asarray(rng.normal(size=out_shape))

        def value_and_grads(module):
            objective = lambda p, x: jnp.sum(module.apply(p, x) * cotangent)
            return module.apply(params, x), jax.grad(objective, argnums=(0, 1))(params, x)

        y_ref, g_ref = jit(lambda: value_and_grads(reference))()
        y_mat, g_mat = jit(lambda: value_and_grads(matmul))()
        assert y_ref.shape == y_mat.shape
        np.testing.assert_allclose(y_mat, y_ref, rtol=1e-12, atol=1e-12)
        assert_trees_close(g_mat, g_ref, rtol=1e-12, atol=1e-12, msg="conv gradients differ")


def test_auto_conv_impl_is_matmul_on_cpu():
    # Convolutions inside lax.scan / under vmap are 10-100x slower on XLA:CPU (DESIGN.md).
    assert jax.default_backend() == "cpu"
    assert resolve_conv_impl("auto") == "matmul"
    assert [resolve_conv_impl(i) for i in ("lax", "matmul")] == ["lax", "matmul"]
    with pytest.raises(ValueError, match="conv_impl"):
        resolve_conv_impl("winograd")


def test_conv_trace_mode_steers_auto_and_canonical():
    """ "auto" is the canonical convolution on CPU only where the engine declares unbatched,
    reverse-mode-only use; "canonical" (custom VJP, no jvp) is im2col + dot where forward mode
    is declared; the context nests and resets."""
    expected = {
        None: {"auto": "matmul", "canonical": "canonical", "lax": "lax", "matmul": "matmul"},
        "reverse_unbatched": {"auto": "canonical", "canonical": "canonical"},
        "forward": {"auto": "matmul", "canonical": "matmul", "lax": "lax"},
    }
    for mode, table in expected.items():
        for impl, resolved in table.items():
            assert resolve_conv_impl(impl, mode) == resolved, (impl, mode)
            with conv_trace_mode(mode):
                assert resolve_conv_impl(impl) == resolved, (impl, mode)
    with conv_trace_mode("reverse_unbatched"):
        with conv_trace_mode("forward"):
            assert resolve_conv_impl("auto") == "matmul"
        assert resolve_conv_impl("auto") == "canonical"
    assert resolve_conv_impl("auto") == "matmul"
    with pytest.raises(ValueError, match="conv_trace_mode"):
        with conv_trace_mode("batched"):
            pass
    with pytest.raises(ValueError, match="mode"):
        resolve_conv_impl("auto", "batched")


@pytest.mark.parametrize("window", [(2, 2), (3, 2)])
def test_reshape_pools_equal_flax_pools(window):
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 7, 9, 3)), jnp.float32)
    ref_max = nn.max_pool(x, window, strides=window, padding="VALID")
    ref_avg = nn.avg_pool(x, window, strides=window, padding="VALID")
    np.testing.assert_array_equal(max_pool(x, window), ref_max)
    np.testing.assert_allclose(avg_pool(x, window), ref_avg, rtol=1e-6, atol=1e-7)


def numpy_dropout(key, x, rate):
    """float64 NumPy reference of `layers.Dropout`: the documented half-word layout."""
    x = np.asarray(x, np.float64)
    shape = x.shape if x.ndim else (1,)
    threshold = round((1.0 - rate) * 65536)
    half = (shape[-1] + 1) // 2
    bits = np.asarray(jax.random.bits(key, (*shape[:-1], half), jnp.uint32)).astype(np.int64)
    keep = np.concatenate([(bits & 0xFFFF) < threshold, (bits >> 16) < threshold], -1)
    keep = keep[..., : shape[-1]].reshape(x.shape)
    return np.where(keep, x * 65536.0 / threshold, 0.0), keep


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 8), (2, 5, 9)])
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.97])
def test_dropout_equals_numpy_reference(shape, rate):
    x = np.random.default_rng(3).normal(size=shape).astype(np.float32) + 2.0
    key = jax.random.key(11)
    out = Dropout(rate).apply({}, jnp.asarray(x), deterministic=False, rng=key)
    ref, keep = numpy_dropout(key, x, rate)
    assert out.shape == x.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-7, atol=0)
    # The gradient is the mask times the same scale.
    grad = jax.grad(lambda v: jnp.sum(dropout_mask_apply(key, v, round((1 - rate) * 65536))))(
        jnp.asarray(x)
    )
    np.testing.assert_allclose(grad, np.where(keep, 65536.0 / round((1 - rate) * 65536), 0.0))


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_drop_frequency_and_unbiasedness(rate):
    """2^20 draws: drop frequency within 5 binomial sigmas of `rate` (the threshold's rounding
    is < 2^-17, far below that), halves independent (the high and low half-words decide
    different elements), and the mean of the output equals the input's (inverted dropout)."""
    n = 1 << 20
    key = jax.random.key(5)
    out = np.asarray(Dropout(rate).apply({}, jnp.ones((64, n // 64)), False, rngs={"dropout": key}))
    dropped = out == 0
    sigma = math.sqrt(rate * (1 - rate) / n)
    assert abs(dropped.mean() - rate) < 5 * sigma, (dropped.mean(), rate)
    lo, hi = dropped[:, : n // 128].ravel(), dropped[:, n // 128 :].ravel()
    corr = np.corrcoef(lo, hi)[0, 1]
    assert abs(corr) < 5 / math.sqrt(lo.size), f"low/high half-words correlated: {corr}"
    # Kept entries are 2^16 / t exactly; E[out] = 1 within 5 sigma of the sample mean.
    scale = 65536.0 / round((1 - rate) * 65536)
    np.testing.assert_allclose(out[~dropped], np.float32(scale))
    assert abs(out.mean() - 1.0) < 5 * scale * sigma


def test_dropout_deterministic_and_extreme_rates():
    x = jnp.arange(6.0).reshape(2, 3)
    key = {"dropout": jax.random.key(0)}
    np.testing.assert_array_equal(Dropout(0.5).apply({}, x, True), x)
    np.testing.assert_array_equal(Dropout(0.5, deterministic=True).apply({}, x), x)
    np.testing.assert_array_equal(Dropout(0.0).apply({}, x, False, rngs=key), x)
    np.testing.assert_array_equal(Dropout(1.0).apply({}, x, False, rngs=key), jnp.zeros_like(x))
    a = Dropout(0.5).apply({}, x, False, rngs=key)
    b = Dropout(0.5).apply({}, x, False, rngs={"dropout": jax.random.key(1)})
    assert (a == Dropout(0.5).apply({}, x, False, rngs=key)).all(), "same key, same mask"
    assert (a != b).any(), "another key, another mask"
    with pytest.raises(ValueError, match="rate"):
        Dropout(1.5).apply({}, x, False, rngs=key)


@pytest.mark.parametrize(
    "name", ["lenet5", "cnn", pytest.param("resnet18", marks=pytest.mark.slow)]
)
def test_conv_models_lax_and_matmul_agree(name):
    """Same params → same loss, gradients and BN statistics for both conv_impl (float64)."""
    _, params, state, batch = tiny_setup(name)
    with jax.enable_x64(True):
        params, state, batch = to_f64((params, state, batch))
        mat_model = tiny_model(name, conv_impl="matmul")
        shapes = jax.eval_shape(mat_model.init, jax.random.key(3), batch["x"])
        assert jax.tree.structure(shapes) == jax.tree.structure((params, state))
        step = lambda impl: f64_train_step(name, impl)(params, state, batch, None)
        (loss_lax, (s_lax, _)), g_lax = step("lax")
        (loss_mat, (s_mat, _)), g_mat = step("matmul")
        np.testing.assert_allclose(loss_mat, loss_lax, rtol=1e-12)
        assert_trees_close(g_mat, g_lax, rtol=1e-9, atol=1e-12, msg="gradients differ")
        assert_trees_close(s_mat, s_lax, rtol=1e-9, atol=1e-12, msg="batch stats differ")


# ---------------------------------------------------------------- train/eval contract


def numpy_cross_entropy(logits, targets):
    """Per-example (per-token) −log softmax(logits)[target] in float64 NumPy."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]


def inputs_targets(model, batch):
    if model.task == "lm":
        return batch["x"][:, :-1], batch["x"][:, 1:]
    return batch["x"], batch["y"]


@pytest.mark.parametrize("name", sorted(TINY))
def test_every_model_loss_and_eval_against_numpy_cross_entropy(name):
    """loss_fn is finite with finite grads; eval_fn sums equal a float64 NumPy reference."""
    model, params, state, batch = tiny_setup(name)
    _, targets = inputs_targets(model, batch)
    run = contract_fn(name)
    ((loss, (new_state, metrics)), grads), sums, logits = run(params, state, batch, rbg_key(6))
    assert np.isfinite(loss) and set(metrics) == {"loss", "accuracy"}
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["loss"] == loss
    assert jax.tree.structure(new_state) == jax.tree.structure(state), "scan carries need this"
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert sum(float(np.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0
    nll = numpy_cross_entropy(logits, targets)
    np.testing.assert_allclose(sums["loss_sum"], nll.sum(), rtol=1e-5)
    assert sums["correct"] == np.sum(np.asarray(logits).argmax(-1) == np.asarray(targets))
    assert sums["count"] == np.asarray(targets).size


@pytest.mark.parametrize("name", ["cnn", "llama"])
def test_eval_sum_equals_mean_loss_times_count_and_respects_mask(name):
    model, params, state, _ = tiny_setup(name)
    key = rbg_key(7)
    batch = tiny_batch(name, 7)
    # No dropout/BN in these models: the train loss is the eval loss.
    ((loss, (_, metrics)), _), sums, _ = contract_fn(name)(params, state, batch, key)
    np.testing.assert_allclose(sums["loss_sum"], loss * sums["count"], rtol=1e-6)
    np.testing.assert_allclose(sums["correct"], metrics["accuracy"] * sums["count"], atol=1e-5)
    # Masked examples (filled with garbage) contribute nothing: equal to the 2 real examples.
    loss_and_eval = jit(lambda p, s, b, k: (model.loss_fn(p, s, b, k)[0], model.eval_fn(p, s, b)))
    garbage = {k: np.asarray(v) for k, v in tiny_batch(name, 8).items()}
    real = {k: np.asarray(v)[:2] for k, v in batch.items()}
    padded = {k: np.concatenate([real[k], garbage[k][2:]]) for k in batch}
    padded["mask"] = np.array([1.0, 1.0, 0.0, 0.0], np.float32)
    loss_padded, sums_padded = loss_and_eval(params, state, padded, key)
    loss_real, sums_real = loss_and_eval(params, state, real, key)
    assert_trees_close(
        sums_padded, sums_real, rtol=1e-5, atol=1e-5, msg="eval_fn does not respect the mask"
    )
    np.testing.assert_allclose(loss_padded, loss_real, rtol=1e-5)


def test_batchnorm_updates_running_statistics_with_momentum_0_9():
    """running ← 0.9·running + 0.1·batch statistic (init mean 0, var 1); eval uses running."""
    model, params, state, batch = tiny_setup("resnet18")
    run, key = contract_fn("resnet18"), rbg_key(6)  # the loss-vs-NumPy test's program
    ((_, (new_state, _)), _), _, logits = run(params, state, batch, key)
    # The stem: a 3x3 convolution, stride 1, padding 1, in float64 NumPy.
    x = np.pad(np.asarray(batch["x"], np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
    kernel = np.asarray(params["stem_conv"]["kernel"], np.float64)
    h, w = batch["x"].shape[1:3]
    stem = sum(x[:, i : i + h, j : j + w] @ kernel[i, j] for i in range(3) for j in range(3))
    stats = new_state["batch_stats"]["stem_norm"]
    np.testing.assert_allclose(stats["mean"], 0.1 * stem.mean((0, 1, 2)), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats["var"], 0.9 + 0.1 * stem.var((0, 1, 2)), rtol=1e-4)
    # Eval mode reads the running statistics: new statistics change the predictions.
    assert not np.allclose(logits, run(params, new_state, batch, key)[2])
    group = tiny_model("resnet18", norm="group")
    assert jax.eval_shape(group.init, jax.random.key(0), batch["x"])[1] == {}


@pytest.mark.parametrize("name", ["vit_tiny", "vit_zg"])
def test_dropout_on_in_loss_fn_and_off_in_eval_fn(name):
    model, params, state, batch = tiny_setup(name)
    run = contract_fn(name)  # the loss-vs-NumPy test's program
    loss = lambda key: run(params, state, batch, key)[0][0][0]
    assert loss(rbg_key(1)) == loss(rbg_key(1)), "same key, same dropout mask"
    assert loss(rbg_key(1)) != loss(rbg_key(2)), "dropout must be active"
    # eval_fn equals the train loss of the same network with every dropout rate at 0.
    no_dropout = {"dropout": 0.0}
    if name == "vit_zg":
        no_dropout["embedding_dropout"] = 0.0
    plain = tiny_model(name, **no_dropout)
    sums = run(params, state, batch, rbg_key(3))[1]
    reference = jit(plain.loss_fn)(params, state, batch, rbg_key(3))[0]
    np.testing.assert_allclose(sums["loss_sum"], reference * sums["count"], rtol=1e-6)


# ---------------------------------------------------------------- model-specific math


def test_llama_is_causal():
    _, params, state, batch = tiny_setup("llama")
    tokens = np.asarray(batch["x"])  # [4, 9]: the logits of positions 0-7
    changed = tokens.copy()
    changed[:, 6] = (tokens[:, 6] + 1) % 256
    run, key = contract_fn("llama"), rbg_key(6)  # the loss-vs-NumPy test's program
    a, b = (run(params, state, {"x": x}, key)[2] for x in (tokens, changed))
    np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=1e-6, atol=1e-6)
    assert np.all(np.abs(a[:, 6:] - b[:, 6:]).max(-1) > 1e-4), "later positions must see token 6"


def test_rotary_scores_depend_only_on_relative_position():
    """<R(m)q, R(n)k> = <R(m+s)q, R(n+s)k>; R(0) = I; rotations preserve norms (float64)."""
    with jax.enable_x64(True):
        q, k = jnp.asarray(np.random.default_rng(10).normal(size=(2, 1, 1, 1, 16)))
        rot = lambda v, t: np.asarray(apply_rotary(v, jnp.array([t]))[0, 0, 0])
        for m, n, shift in [(3, 1, 5), (0, 7, 11), (9, 9, 2)]:
            np.testing.assert_allclose(
                rot(q, m) @ rot(k, n), rot(q, m + shift) @ rot(k, n + shift), rtol=1e-5
            )
        np.testing.assert_allclose(rot(q, 0), q[0, 0, 0], rtol=1e-12)
        np.testing.assert_allclose(np.linalg.norm(rot(q, 13)), jnp.linalg.norm(q), rtol=1e-6)


def test_rms_norm_matches_numpy():
    x = np.random.default_rng(0).normal(size=(3, 4, 8))
    scale = np.linspace(0.5, 2.0, 8)
    expected = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * scale
    actual = rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=1e-5)


def test_vit_patch_embedding_is_a_strided_convolution_and_positions_are_sinusoids():
    with jax.enable_x64(True):
        rng = np.random.default_rng(11)
        x = jnp.asarray(rng.normal(size=(2, 8, 12, 3)))
        kernel = jnp.asarray(rng.normal(size=(4 * 4 * 3, 5)))
        dense = patchify(x, 4) @ kernel
        conv = lax.conv_general_dilated(
            x, kernel.reshape(4, 4, 3, 5), (4, 4), "VALID",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )  # fmt: skip
        np.testing.assert_allclose(dense, conv.reshape(2, 6, 5), rtol=1e-12, atol=1e-12)
    table = sinusoidal_positions(5, 6)
    for t in range(5):
        for i in range(3):
            angle = t / 10000 ** (2 * i / 6)
            assert math.isclose(table[t, 2 * i], math.sin(angle), abs_tol=1e-6)
            assert math.isclose(table[t, 2 * i + 1], math.cos(angle), abs_tol=1e-6)


def test_rnn_matches_numpy_recurrence_and_ignores_padding():
    with jax.enable_x64(True):
        model = get_model("rnn", hidden_size=6, num_layers=2, embed_dim=4)
        rng = np.random.default_rng(13)
        x = rng.normal(size=(3, 5, 4))
        # Any weights serve the recurrence: drawn in NumPy on init's shapes (no init compile).
        shapes, state = jax.eval_shape(model.init, jax.random.key(14), x)
        params = jax.tree.map(lambda a: rng.normal(scale=0.5, size=a.shape), shapes)
        p = params
        h_seq = x
        for layer in range(2):
            w_ih, w_hh, b = (p[f"layer_{layer}_{n}"] for n in ("w_ih", "w_hh", "bias"))
            h, outputs = np.zeros((3, 6)), []
            for t in range(5):
                h = np.tanh(h_seq[:, t] @ w_ih + h @ w_hh + b)
                outputs.append(h)
            h_seq = np.stack(outputs, 1)
        expected = h @ p["readout"]["kernel"] + p["readout"]["bias"]
        actual = jit(model.predict_fn)(params, state, x)
        np.testing.assert_allclose(actual, expected, rtol=1e-10)
    # Token inputs: trailing pad_id=0 tokens leave the state unchanged.
    model, params, state, _ = tiny_setup("rnn")
    tokens = np.array([[3, 7, 5, 0, 0], [4, 4, 9, 2, 0]], np.int32)
    predict = functools.partial(jit(model.predict_fn), params, state)  # one program per length
    padded = predict(tokens)
    # Programs of different lengths round differently, by a few float32 ulps of the row's
    # largest logit (4.5e-8 on a logit of 0.038 on an AVX2 CPU): the tolerance is relative to
    # the row's scale, not to each logit. A pad token that moved the state would move the
    # logits by far more.
    for row, length in ((0, 3), (1, 4)):
        alone = predict(tokens[row : row + 1, :length])[0]
        scale = float(np.max(np.abs(alone)))
        np.testing.assert_allclose(padded[row], alone, rtol=1e-6, atol=1e-6 * scale)


# ---------------------------------------------------------------- vmap over clients


@pytest.mark.parametrize(
    "name,conv_impl,dropout",
    [("cnn", "matmul", False), ("resnet18", "matmul", False), ("vit_tiny", None, True),
     ("llama", None, False)],
)  # fmt: skip
def test_vmap_over_clients_equals_per_client_loop(name, conv_impl, dropout):
    """jax.vmap(value_and_grad(loss_fn)) over stacked client params == a per-client loop (f64).

    Clients differ in params (perturbed copies), batches and (with dropout) keys.
    """
    _, params, state, _ = tiny_setup(name)
    clients = 3
    with jax.enable_x64(True):
        model = tiny_model(name, **({} if conv_impl is None else {"conv_impl": conv_impl}))
        batches = [to_f64(tiny_batch(name, 20 + c)) for c in range(clients)]
        inits = [to_f64((perturbed(params, 30 + c), state)) for c in range(clients)]
        keys = jax.random.split(jax.random.key(16), clients) if dropout else [None] * clients
        params_c, state_c = stack([i[0] for i in inits]), stack([i[1] for i in inits])
        step = jax.value_and_grad(model.loss_fn, has_aux=True)
        keys_c = keys if dropout else None
        vmapped = jit(jax.vmap(step))(params_c, state_c, stack(batches), keys_c)
        single = f64_train_step(name, conv_impl)
        looped = stack([single(*inits[c], batches[c], keys[c]) for c in range(clients)])
        assert_trees_close(vmapped, looped, rtol=1e-9, atol=1e-12, msg="vmap != loop")
