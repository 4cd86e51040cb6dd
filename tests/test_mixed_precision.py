"""Mixed precision (`model.dtype`, issue 22 item 2): bfloat16 compute, float32 everything else.

For every registered model (ResNet-18 with BatchNorm and with GroupNorm), at toy widths on CPU:
the bfloat16 model's parameters and model state are float32 (same tree as float32's) and stay
float32 through SGD steps; every matrix product and convolution of its training step (forward and
backward) multiplies bfloat16 operands, while the float32 model has none; and its losses over a
few SGD steps from the same parameters stay within bfloat16's rounding of float32's.

Tolerance: bfloat16 keeps an 8-bit significand, so each rounding has relative error at most
u = 2^-8 ≈ 0.0039. The toy networks round their inputs, weights and every layer output (a
handful of roundings in sequence, errors of random sign), relative to the activations' scale,
which three small SGD steps (learning rate 0.01) do not change; the cross-entropy's derivative
with respect to the logits is bounded by 2 in l1 norm. So the losses differ by a few u times the
initial loss (≈ log(classes)): LOSS_TOL = 4u, applied as |L_bf16 - L_f32| <= 4u·|L_f32(step 0)|.
Measured (2026-11-24): at most 0.5u (rnn 0.49u, vit_tiny 0.46u, the others below 0.4u). The
FedPAC round's bfloat16 update differs from float32's by at most 1.7u of its norm (bound 8u).
"""

import inspect

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from helpers import equations
from jax import lax

from configs import base
from fedorth.models import MODELS, Model, get_model
from fedorth.models.layers import (
    MODEL_DTYPES,
    compute_dtype,
    conv_trace_mode,
    dropout_mask_apply,
)
from fedorth.models.llama import Llama
from fedorth.models.resnet import ResNet18
from fedorth.train import builders, validate

U = 2.0**-8  # unit roundoff of bfloat16 (8-bit significand)
LOSS_TOL = 4 * U
LEARNING_RATE = 0.01
STEPS = 3

# name -> (factory name, kwargs, input shape, token-id bound or None, classes or None)
CASES = {
    "mlp": ("mlp", dict(hidden_sizes=(16,)), (8, 8, 8), None, 10),
    "lenet5": ("lenet5", {}, (8, 28, 28, 1), None, 10),
    "cnn": ("cnn", dict(features=(4, 8), dense_sizes=(16,)), (8, 8, 8, 3), None, 10),
    "resnet18_bn": ("resnet18", dict(norm="batch"), (8, 8, 8, 3), None, 10),
    "resnet18_gn": ("resnet18", dict(norm="group"), (8, 8, 8, 3), None, 10),
    "vit_tiny": (
        "vit_tiny",
        dict(dim=16, depth=1, num_heads=2, num_classes=10),
        (8, 8, 8, 3),
        None,
        10,
    ),
    "vit_zg": (
        "vit_zg",
        dict(dim=16, depth=1, num_heads=2, head_dim=8, mlp_dim=32),
        (8, 8, 8, 3),
        None,
        10,
    ),
    "rnn": ("rnn", dict(hidden_size=8, vocab_size=20, embed_dim=6), (8, 5), 20, 2),
    "llama": ("llama", {}, (8, 9), 32, None),
    "auc": ("auc", dict(hidden_size=8, vocab_size=20, embed_dim=6, num_classes=2), (8, 5), 20, 2),
}


def make_model(case: str, dtype: str, **overrides) -> Model:
    name, kwargs, *_ = CASES[case]
    if name == "resnet18":
        # Stem, an identity block and a strided block with its 1x1 shortcut, at 1/8 width: every
        # ResNet-18 layer type, compiled in a fraction of the full depth's time.
        attributes = dict(
            num_classes=10, norm=kwargs["norm"], width=0.125, stage_sizes=(1, 1, 0, 0)
        )
        module = ResNet18(**(attributes | overrides), dtype=compute_dtype(dtype))
        return Model(module)
    if name == "llama":  # the "tiny" shape, smaller still (vocabulary 32, one layer)
        module = Llama(32, 16, 32, 2, 1, dtype=compute_dtype(dtype))
        return Model(module, task="lm")
    return get_model(name, dtype=dtype, **kwargs)


def make_batch(case: str) -> dict:
    """The case's batch, drawn with NumPy."""
    _, _, shape, high, classes = CASES[case]
    rng = np.random.default_rng(0)
    if high is None:
        batch = {"x": jnp.asarray(rng.normal(size=shape), jnp.float32)}
    else:  # token ids; 0 (the RNN's pad id) avoided
        batch = {"x": jnp.asarray(rng.integers(1, high, size=shape), jnp.int32)}
    if classes is not None:
        batch["y"] = jnp.asarray(rng.integers(0, classes, size=shape[:1]), jnp.int32)
    return batch


def sgd_run(model: Model, batch, key):
    """`STEPS` plain SGD steps on one batch: (params, state) -> (params, state, losses)."""

    def step(carry, _):
        params, state = carry
        (loss, (state, _)), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(
            params, state, batch, key
        )
        params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
        return (params, state), loss

    def run(params, state):
        (params, state), losses = lax.scan(step, (params, state), None, length=STEPS)
        return params, state, losses

    return run


def numpy_init(shapes, seed: int = 0):
    """Parameters and state of the given shapes drawn with NumPy (no compilation of an init):
    normalization scales and variances 1, biases, means and scalars 0, other leaves
    N(0, 1/fan_in) with fan_in the product of all but the last axis."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = str(getattr(path[-1], "key", ""))
        if name in ("scale", "var"):
            return jnp.ones(shape.shape, shape.dtype)
        if "bias" in name or name == "mean" or shape.ndim == 0:
            return jnp.zeros(shape.shape, shape.dtype)
        fan_in = int(np.prod(shape.shape[:-1])) or 1
        return jnp.asarray(rng.normal(size=shape.shape) / np.sqrt(fan_in), shape.dtype)

    return jax.tree_util.tree_map_with_path(leaf, shapes)


# Compile options of the tests' programs: XLA:CPU's LLVM optimizations and its fusion emitters
# take most of these toy programs' compile time (ResNet case: 9.4 s of CPU by default, 4.3 s
# without LLVM optimizations, 1.4-1.8 s without the fusion emitters as well); the float32 and
# bfloat16 programs compared are compiled alike. Other backends reject XLA:CPU's options (a GPU
# compiles these programs in seconds): `fast_compile()` gives them none.
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}


def fast_compile() -> dict:
    """FAST_COMPILE on the CPU backend, else no options."""
    return FAST_COMPILE if jax.default_backend() == "cpu" else {}


def both_runs(case: str):
    """The float32 and bfloat16 SGD runs from the same (params, state), compiled together (one
    compilation per case), and the products of each run's jaxpr."""
    batch = make_batch(case)
    key = jax.random.key(3, impl="rbg")  # dropout masks: the same bits in both dtypes
    f32, bf16 = make_model(case, "float32"), make_model(case, "bfloat16")
    shapes = jax.eval_shape(f32.init, jax.random.key(0, impl="rbg"), batch["x"])
    params, state = numpy_init(shapes)
    run32 = jax.jit(sgd_run(f32, batch, key), inline=False)
    run16 = jax.jit(sgd_run(bf16, batch, key), inline=False)
    traced = jax.jit(lambda p, s: (run32(p, s), run16(p, s))).trace(params, state)
    runs = [e for e in traced.jaxpr.eqns if e.params.get("name") == "run"]
    assert len(runs) == 2, [(e.primitive.name, e.params.get("name")) for e in traced.jaxpr.eqns]
    ops32, ops16 = (products(e.params["jaxpr"]) for e in runs)
    out32, out16 = traced.lower().compile(compiler_options=fast_compile())(params, state)
    return batch, bf16, (params, state), out32, out16, ops32, ops16


def products(closed_jaxpr) -> list[tuple[str, tuple[str, ...], str]]:
    """(primitive, operand dtypes, precision) of every dot_general / convolution, recursively."""
    return [
        (
            eqn.primitive.name,
            tuple(str(v.aval.dtype) for v in eqn.invars),
            str(eqn.params.get("precision")),
        )
        for eqn in equations(closed_jaxpr)
        if eqn.primitive.name in ("dot_general", "conv_general_dilated")
    ]


def bf16_arithmetic(product) -> bool:
    """Both operands bfloat16, or jax.nn.dot_product_attention's backward products, whose
    BF16_BF16_F32 algorithm rounds a float32 cotangent to bfloat16 (f32 accumulation)."""
    _, dtypes, precision = product
    return set(dtypes) == {"bfloat16"} or "BF16_BF16_F32" in precision


def float_leaves(tree) -> list:
    return [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)]


# Variants of a class above (ViT with learned positions and embedding dropout; the AUC loss on
# the RNN) are traced, not compiled: the same layers, half a minute less of CPU compilation.
TRACED_ONLY = ("vit_zg", "auc")


@pytest.mark.parametrize("case", [c for c in CASES if c not in TRACED_ONLY])
def test_bfloat16_model_keeps_float32_state_and_tracks_float32_loss(case):
    batch, bf16, (params0, state0), out32, out16, ops32, ops16 = both_runs(case)
    (_, state32, losses32), (params16, state16, losses16) = out32, out16

    # Parameters and model state: float32, the same tree as the float32 model's.
    shapes = jax.eval_shape(bf16.init, jax.random.key(0, impl="rbg"), batch["x"])
    assert jax.tree.structure(shapes) == jax.tree.structure((params0, state0))
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(shapes)} == {"float32"}
    logits = jax.eval_shape(bf16.predict_fn, params0, state0, batch["x"])
    assert logits.dtype == jnp.float32, "logits are cast to float32 before the loss"

    # Every product of the bfloat16 training steps is bfloat16 arithmetic; none of float32's is.
    assert len(ops16) >= 3 and all(map(bf16_arithmetic, ops16)), ops16
    assert len(ops32) == len(ops16) and not any(map(bf16_arithmetic, ops32)), ops32

    assert jax.tree.structure(params16) == jax.tree.structure(params0)
    assert {str(leaf.dtype) for leaf in float_leaves((params16, state16))} == {"float32"}
    assert losses16.dtype == jnp.float32
    if case == "resnet18_bn":  # BatchNorm running statistics were updated, in float32
        mean0 = state0["batch_stats"]["stem_norm"]["mean"]
        mean16 = state16["batch_stats"]["stem_norm"]["mean"]
        assert mean16.dtype == jnp.float32 and not np.allclose(mean16, mean0)
        mean32 = state32["batch_stats"]["stem_norm"]["mean"]
        scale = float(np.max(np.abs(mean32)))
        np.testing.assert_allclose(mean16, mean32, rtol=0, atol=LOSS_TOL * scale)
    losses16, losses32 = np.asarray(losses16), np.asarray(losses32)
    assert losses32[-1] < losses32[0], f"float32 SGD did not lower the loss: {losses32}"
    np.testing.assert_allclose(
        losses16,
        losses32,
        rtol=0,
        atol=LOSS_TOL * abs(losses32[0]),
        err_msg=f"{case}: bfloat16 losses beyond 4 bf16 roundings (of the initial loss)",
    )


@pytest.mark.parametrize("case", TRACED_ONLY)
def test_bfloat16_variants_trace_to_bfloat16_products_and_float32_outputs(case):
    batch = make_batch(case)
    f32, bf16 = make_model(case, "float32"), make_model(case, "bfloat16")
    key = jax.random.key(3, impl="rbg")
    shapes = jax.eval_shape(bf16.init, jax.random.key(0, impl="rbg"), batch["x"])
    assert shapes == jax.eval_shape(f32.init, jax.random.key(0, impl="rbg"), batch["x"])
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(shapes)} == {"float32"}
    ops16 = products(jax.make_jaxpr(sgd_run(bf16, batch, key))(*shapes))
    ops32 = products(jax.make_jaxpr(sgd_run(f32, batch, key))(*shapes))
    assert len(ops16) >= 3 and all(map(bf16_arithmetic, ops16)), ops16
    assert len(ops32) == len(ops16) and not any(map(bf16_arithmetic, ops32)), ops32
    outputs = jax.eval_shape(sgd_run(bf16, batch, key), *shapes)
    assert {str(leaf.dtype) for leaf in float_leaves(outputs)} == {"float32"}
    assert jax.eval_shape(bf16.predict_fn, *shapes, batch["x"]).dtype == jnp.float32


def test_bfloat16_dropout_scales_by_the_float32_factor():
    """Kept values are round_bf16(x · 2^16/t), not x · round_bf16(2^16/t): the bfloat16 scale for
    rate 0.1 is 1.109375 instead of 1.111111, which biased every kept value by -0.16% (0.4u).
    The per-element roundings have random signs, so the mean ratio over ~9,000 kept values is
    within u/sqrt(9000) ≈ 4e-5 of the exact factor; 2e-4 separates it from the old bias 1.7e-3."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(0.5, 2.0, size=(100, 100)), jnp.bfloat16)
    threshold = round(0.9 * 65536)
    out = dropout_mask_apply(jax.random.key(0, impl="rbg"), x, threshold)
    assert out.dtype == jnp.bfloat16
    out, x = np.asarray(out, np.float64), np.asarray(x, np.float64)
    kept = out != 0
    assert 8800 < kept.sum() < 9200
    ratio = out[kept] / x[kept]
    np.testing.assert_allclose(ratio, 65536 / threshold, rtol=U)  # one rounding each
    assert abs(ratio.mean() - 65536 / threshold) < 2e-4, ratio.mean()


@pytest.mark.parametrize("conv_impl", ["lax", "matmul", "canonical"])
def test_convolution_implementations_run_in_bfloat16(conv_impl):
    """XLA's convolution, im2col + dot and the canonical convolution's custom VJP (forward, dW,
    dx) all multiply bfloat16 operands; kernel gradients come back float32 (traced only)."""
    model = make_model("resnet18_bn", "bfloat16", width=0.25, conv_impl=conv_impl)
    batch = make_batch("resnet18_bn")
    params, state = jax.eval_shape(model.init, jax.random.key(0, impl="rbg"), batch["x"])

    def grads(p, s):
        with conv_trace_mode("reverse_unbatched"):
            return jax.grad(lambda q: model.loss_fn(q, s, batch, None)[0])(p)

    ops = products(jax.make_jaxpr(grads)(params, state))
    convs = [op for op in ops if op[0] == "conv_general_dilated"]
    # 6 convolutions (channels 3->16, 16->16 twice, 16->32, 32->32, 16->32 shortcut): lax has 6
    # forward, 6 dW and 5 dx (the input's is not needed); the canonical convolution serves the 5
    # with >= 16 input channels (im2col + dot the stem), each with forward, dW and dx.
    expected = {"lax": 6 + 6 + 5, "matmul": 0, "canonical": 3 * 5}[conv_impl]
    assert len(convs) == expected, (conv_impl, len(convs))
    assert all(map(bf16_arithmetic, ops)), ops
    shapes = jax.eval_shape(grads, params, state)
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(shapes)} == {"float32"}


def test_model_dtype_is_a_config_key_of_every_model_with_a_one_line_error():
    for name, factory in MODELS.items():
        parameter = inspect.signature(factory).parameters.get("dtype")
        assert parameter is not None and parameter.default == "float32", name
    assert MODEL_DTYPES == ("float32", "bfloat16")
    assert compute_dtype("float32") is None and compute_dtype(jnp.float32) is None
    assert compute_dtype("bfloat16") == jnp.bfloat16 == compute_dtype(jnp.bfloat16)

    with pytest.raises(ValueError) as error:
        get_model("cnn", dtype="float16")
    message = str(error.value)
    assert message == (
        "model.dtype='float16' is not supported; valid choices: ['float32', 'bfloat16']."
    )

    config = base.get_base_config()
    assert config.model.dtype == "float32"
    config.model.dtype = "bf16"
    with pytest.raises(validate.ConfigError) as error:
        validate.validate(config)
    lines = str(error.value).splitlines()[1:]
    assert [line.strip() for line in lines] == [
        "model.dtype='bf16' is unknown; valid choices: ['bfloat16', 'float32']."
    ]

    # --config.model.name=cnn on the MLP file drops hidden_sizes but keeps dtype.
    config = base.get_base_config()
    config.model.dtype = "bfloat16"
    config.model.name = "cnn"
    config.lock()
    assert validate.drop_keys_of_another_model(config, {"model.name": "cnn"}) == [
        "model.hidden_sizes"
    ]
    assert config.model.to_dict() == {"name": "cnn", "dtype": "bfloat16"}
    validate.validate(config)


@pytest.mark.parametrize(
    "module, arg",
    [
        ("fedavg", "cifar100_resnet18"),
        ("fedavg", "c4_llama60m"),
        ("fedavg", "fedmuon_lmo_fmnist_lenet5_beta10"),
        ("f_sagda", "sentiment140_homo_p4"),
        ("f_sagda", None),
    ],
)
def test_presets_that_replace_the_model_keep_the_dtype_key(module, arg):
    """A locked config only takes `--config.model.dtype=bfloat16` if the key exists."""
    config = __import__(f"configs.{module}", fromlist=["get_config"]).get_config(arg)
    assert config.model.dtype == "float32", config.model


def test_federated_round_in_bfloat16_keeps_float32_server_state():
    """One FedPAC round (server-aggregated momentum, global direction) of an MLP in bfloat16 via
    the builders: every float leaf of the server state is float32 before and after, and the
    averaged parameters stay within bf16 rounding of the float32 round's."""
    config = base.get_base_config()
    config.data.num_clients = 4
    config.fed.clients_per_round = 2
    config.fed.local_steps = 2
    config.fed.algorithm = "fedpac"
    config.fed.strategy = "sequential"
    config.optim = ml_collections.ConfigDict(
        {"name": "sgd", "learning_rate": 0.05, "momentum": 0.9, "schedule": "constant"}
    )
    config.model = ml_collections.ConfigDict(
        {"name": "mlp", "hidden_sizes": (16,), "dtype": "float32"}
    )
    results = {}
    for dtype in ("float32", "bfloat16"):
        config.model.dtype = dtype
        validate.validate(config)
        experiment = builders.build(config)
        server = builders.init_server(experiment)
        before = jax.tree.map(lambda a: a.dtype, float_leaves(server))
        start = jax.tree.map(np.asarray, server.params)
        lowered = experiment.round_fn.lower(server, experiment.data)
        server, _ = lowered.compile(compiler_options=fast_compile())(server, experiment.data)
        assert jax.tree.map(lambda a: a.dtype, float_leaves(server)) == before
        assert {str(d) for d in before} == {"float32"}
        results[dtype] = jax.tree.map(np.asarray, server.params)
    for p0, p32, p16 in zip(
        *(jax.tree.leaves(t) for t in (start, results["float32"], results["bfloat16"])),
        strict=True,
    ):
        step32, step16 = p32 - p0, p16 - p0
        assert np.linalg.norm(step32) > 0
        # The round's update in bf16 differs from float32's by a few bf16 roundings of it.
        assert np.linalg.norm(step16 - step32) <= 8 * U * np.linalg.norm(step32)
