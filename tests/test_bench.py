"""Tests for the round benchmark (experiments/bench_round.py) and its PyTorch peer.

They check the pieces the numbers rest on: the FLOP count (a dense step against its analytic
count), that the ``--quick`` subcommand runs and writes every field, that the torch peer does the
same arithmetic as fedorth (SGD against float64 NumPy; Muon's Newton–Schulz and SOAP against
fedorth's), and that the automatic execution choices (``conv_impl="auto"``, ``strategy="auto"``)
and the canonical convolution give the numbers of the explicit ones.
"""

import json
import math
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench, bench_round, bench_round_runners
from fedorth import fed, models
from fedorth.data.federated import make_federated, sample_batch
from fedorth.fed.round import resolve_strategy
from fedorth.models.layers import (
    conv2d,
    conv_general_dilated_canonical,
    resolve_conv_impl,
)
from fedorth.optim.newton_schulz import newton_schulz, newton_schulz_flops

try:
    import torch

    from benchmarks import torch_peer
except ImportError:  # torch is the optional 'bench' extra
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed (pip install torch)")


# ----------------------------------------------------------------------------- FLOP counting


def test_dense_step_flops_match_the_analytic_count():
    """y = xW, loss ½Σy²: forward 2BIO + dW = xᵀ(dy) 2BIO = 4BIO (elementwise terms < 1%)."""
    b, i, o = 64, 256, 128

    def loss_fn(params, model_state, batch, key):
        del key
        y = batch["x"] @ params["w"]
        return 0.5 * jnp.sum(y * y), (model_state, {})

    params = {"w": jnp.ones((i, o))}
    flops = bench_round.step_flops(loss_fn, params, {}, {"x": jnp.ones((b, i))}, None)
    analytic = 4 * b * i * o
    assert abs(flops - analytic) / analytic < 0.01, (flops, analytic)


def test_muon_flops_sum_newton_schulz_over_matrix_views():
    """Conv kernels count as (kh·kw·in, out) matrices; vectors do not count."""
    params = {"conv": jnp.zeros((5, 5, 3, 32)), "bias": jnp.zeros(32), "dense": jnp.zeros((64, 10))}
    expected = newton_schulz_flops((75, 32), 5) + newton_schulz_flops((64, 10), 5)
    assert bench_round.muon_flops(params) == expected
    # 75×32: per step 4·32²·75 + 2·32³ (newton_schulz_flops' docstring).
    assert newton_schulz_flops((75, 32), 1) == 4 * 32 * 32 * 75 + 2 * 32**3


# ----------------------------------------------------------------------------- the subcommand

ROW_FIELDS = {
    "workload", "algorithm", "clients_per_round", "local_steps", "impl", "strategy", "round_s",
    "client_steps_per_s", "compile_s", "first_round_s", "memory", "persistent_bytes_per_client",
    "flops_per_round", "gflops", "fraction_of_matmul", "recompiles", "donated",
}  # fmt: skip


def test_quick_round_subcommand_writes_json_with_all_fields(tmp_path):
    path = tmp_path / "round.json"
    argv = ["round", "--quick", "--memory", "--json", str(path)]
    argv += [] if torch is not None else ["--peers", "jax_loop"]
    assert bench.main(["bench", *argv]) == 0
    result = json.loads(path.read_text())
    keys = ("date", "device", "cpu_threads", "jax", "openblas_threads", "command", "rows")
    for key in (*keys, "matmul_gflops"):
        assert key in result, key
    rows = {row["impl"]: row for row in result["rows"]}
    ours = rows["fedorth"]
    assert ROW_FIELDS <= set(ours), ROW_FIELDS - set(ours)
    assert ours["recompiles"] == 0, "the round recompiled after round 1"
    assert ours["donated"], "the server state passed to the round was not donated"
    assert ours["memory"]["peak_bytes"] > 0
    assert ours["client_steps_per_s"] == pytest.approx(2 * 2 / ours["round_s"])
    assert "speedup_vs_jax_loop" in ours and rows["jax_loop"]["round_s"] > 0
    if torch is not None:
        assert rows["torch"]["num_params"] == ours["num_params"]
        assert "speedup_vs_torch" in ours
    memory = result["memory"]
    extra = memory["persistent_bytes_per_client"] - 2 * 4 * memory["num_params"]
    assert 0 <= extra <= 16, "fedmuon_bc keeps M_i and C_i (float32) and int32 counters per client"
    assert memory["vmap"]["train_loss_finite"]


def test_entry_points_run_host_lapack_with_one_openblas_thread_unless_told_otherwise():
    # SOAP/FedPAC factorizations run SciPy's LAPACK on the host; with OpenBLAS's default threads
    # they spin against XLA's (lenet5 FedPAC_SOAP 145 vs 109 ms per 2-round period, PERFORMANCE.md),
    # so every `python -m experiments.X` must set the variable before NumPy loads: the package's
    # __init__ does it, ahead of any of its modules.
    def run(module, **extra):
        script = (
            f"import os, sys; import {module}; "
            "print(os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy' in sys.modules)"
        )
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"} | extra
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        return done.stdout.split()

    # Set before NumPy can load: importing the package alone loads no NumPy.
    assert run("experiments") == ["1", "False"], "the package did not set the variable first"
    for module in ("experiments.bench", "experiments.main"):
        assert run(module) == ["1", "True"], f"{module} did not default OPENBLAS_NUM_THREADS to 1"
        assert run(module, OPENBLAS_NUM_THREADS="2") == ["2", "True"], "an explicit value was lost"


def test_entry_points_split_the_cpu_into_one_jax_device_per_core_unless_told_otherwise():
    # `auto` shards convolutional clients over the CPU devices (cnn 1.22x torch at S = 10 x
    # K = 10 against 0.90x on one device, PERFORMANCE.md "Session 6"): the package sets
    # JAX_NUM_CPU_DEVICES before JAX loads, unless XLA_FLAGS forces a count or a value is given.
    def devices(**extra):
        script = "import experiments, jax; print(jax.device_count())"
        keep = {
            k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")
        }
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=keep | {"JAX_PLATFORMS": "cpu"} | extra,
            capture_output=True,
            text=True,
            check=True,
        )
        return int(done.stdout.split()[-1])

    assert devices() == min(len(os.sched_getaffinity(0)), 8)
    assert devices(JAX_NUM_CPU_DEVICES="1") == 1, "an explicit value was lost"
    forced = "--xla_force_host_platform_device_count=3"
    assert devices(XLA_FLAGS=forced) == 3, "the XLA flag was overridden"


def test_scaling_children_get_the_device_count_they_ask_for():
    """`--scaling` times `sharded` on 1 and 2 devices in child processes. The parent, like every
    `python -m experiments.*`, has JAX_NUM_CPU_DEVICES set, which wins over XLA_FLAGS' forced
    count: until session 7 both children inherited 2 devices (a 0.97x "speedup" for 2 vs 2)."""
    from experiments.bench_round_sections import cpu_devices_env

    parent = dict(os.environ) | {
        "JAX_NUM_CPU_DEVICES": "2",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math=false",
    }
    for want in (1, 2, 3):
        env = cpu_devices_env(want, parent)
        assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false", "other flags are kept"
        done = subprocess.run(
            [sys.executable, "-c", "import jax; print(jax.device_count())"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert int(done.stdout.split()[-1]) == want


def test_bad_choices_name_the_flag():
    with pytest.raises(ValueError, match="--workloads='vgg'"):
        bench_round.parse_args(["--workloads", "vgg"])
    with pytest.raises(ValueError, match="fed.unroll=0; valid: an int >= 1 or True"):
        fed.RoundConfig(4, 2, 3, 0.1, unroll=0).validate(
            fed.get_algorithm("fedavg", {"name": "sgd", "learning_rate": 0.1})
        )


# ----------------------------------------------------------------------------- the torch peer


@needs_torch
def test_peer_models_have_fedorth_parameter_counts():
    torch.manual_seed(0)
    for name, w in bench_round.WORKLOADS.items():
        model = bench_round.build_model(w, "auto")
        x = jnp.zeros((1, *w.input_shape))
        shapes = jax.eval_shape(lambda x, m=model: m.init(jax.random.key(0), x)[0], x)
        ours = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))
        peer = torch_peer.build_model(w.model, w.input_shape, w.num_classes, **dict(w.kwargs))
        assert sum(p.numel() for p in peer.parameters()) == ours, name


def _np_softmax_ce_grads(w, b, x, label):
    """Float64 gradient of CE(softmax(W x + b), label) for one example (W: [out, in])."""
    logits = w @ x + b
    p = np.exp(logits - logits.max())
    p /= p.sum()
    p[label] -= 1.0
    return np.outer(p, x), p


@needs_torch
def test_peer_fedavg_round_equals_numpy_sgd():
    """Two one-example clients, K = 2 SGD steps each, server mean (float64 NumPy)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 1, 2, 2)).astype(np.float32)  # NCHW, 4 features
    y = np.array([2, 0])
    model = torch_peer.build_model("mlp", (2, 2, 1), 3, hidden_sizes=())
    w0 = model.out.weight.detach().double().numpy().copy()
    b0 = model.out.bias.detach().double().numpy().copy()
    lr, steps = 0.3, 2
    peer = torch_peer.Peer(
        model, "fedavg", torch.from_numpy(x), torch.from_numpy(y), [np.array([0]), np.array([1])],
        clients_per_round=2, local_steps=steps, batch_size=3, learning_rate=lr, device="cpu",
    )  # fmt: skip
    # The bench shares JAX's device with the peer: the CPU here (cuda on a GPU machine).
    assert bench_round_runners.torch_device() == "cpu" and peer.x.device.type == "cpu"
    peer.run_round()
    peer.synchronize()
    finals = []
    for client in range(2):
        w, b = w0.copy(), b0.copy()
        for _ in range(steps):  # every batch repeats the client's only example
            gw, gb = _np_softmax_ce_grads(w, b, x[client].reshape(-1).astype(np.float64), y[client])
            w, b = w - lr * gw, b - lr * gb
        finals.append((w, b))
    np.testing.assert_allclose(
        peer.global_weights["out.weight"].numpy(), (finals[0][0] + finals[1][0]) / 2, atol=1e-6
    )
    np.testing.assert_allclose(
        peer.global_weights["out.bias"].numpy(), (finals[0][1] + finals[1][1]) / 2, atol=1e-6
    )


@needs_torch
def test_peer_newton_schulz_equals_fedorth():
    """Same quintic, same normalization, tall inputs on their short side."""
    for shape in [(24, 40), (40, 24)]:
        g = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        ours = np.asarray(newton_schulz(jnp.asarray(g), 5, "jordan", eps=1e-7))
        theirs = torch_peer.newton_schulz5(torch.from_numpy(g)).numpy()
        np.testing.assert_allclose(theirs, ours, atol=2e-5)


def _run_peer_optimizer(opt_class, grads, lr, **kwargs):
    """Parameter trajectory of the peer optimizer fed the gradients `grads` (no model)."""
    p = torch.nn.Parameter(torch.zeros(grads[0].shape, dtype=torch.float32))
    opt = opt_class([p], lr, **kwargs)
    for g in grads:
        p.grad = torch.from_numpy(g)
        opt.step()
    return p.detach().numpy()


def _run_fedorth_direction(tx, grads, lr):
    params = jnp.zeros(grads[0].shape)
    state = tx.init(params)
    for g in grads:
        d, state = tx.update(jnp.asarray(g), state, params)
        params = params - lr * d
    return np.asarray(params)


@needs_torch
def test_peer_soap_and_muon_follow_fedorth_step_for_step():
    """Six steps on one matrix (SOAP: the first builds the basis, refresh every 2 steps).

    SOAP's matrix is square so that both first factors, GGᵀ and GᵀG, have full rank: a zero
    eigenvalue's eigenvectors are arbitrary, and LAPACK builds may pick different ones.
    """
    from fedorth.optim.muon import scale_by_muon
    from fedorth.optim.soap import scale_by_soap

    rng = np.random.default_rng(2)
    lr = 0.1
    grads = [rng.standard_normal((5, 5)).astype(np.float32) for _ in range(6)]
    theirs = _run_peer_optimizer(torch_peer.SOAP, grads, lr, precondition_frequency=2)
    ours = _run_fedorth_direction(scale_by_soap(precondition_frequency=2), grads, lr)
    np.testing.assert_allclose(theirs, ours, atol=2e-4)
    grads = [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(6)]
    # Muon: torch weights are (out, in), Flax kernels (in, out): feed the peer the transposes.
    theirs = _run_peer_optimizer(torch_peer.Muon, [g.T.copy() for g in grads], lr)
    ours = _run_fedorth_direction(scale_by_muon(), grads, lr)
    np.testing.assert_allclose(theirs.T, ours, atol=2e-5)


# ----------------------------------------------------------------------------- auto choices


def test_auto_conv_resolves_to_matmul_on_cpu_and_equals_nn_conv():
    assert jax.default_backend() == "cpu"
    assert resolve_conv_impl("auto") == "matmul"
    assert resolve_conv_impl("lax") == "lax"
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (2, 9, 9, 3), jnp.float64)
        auto = conv2d(
            4, (3, 3), strides=(2, 2), padding="SAME", impl="auto", param_dtype=jnp.float64
        )
        plain = nn.Conv(4, (3, 3), strides=(2, 2), padding="SAME", param_dtype=jnp.float64)
        params = plain.init(jax.random.key(1), x)

        def loss(module):
            return lambda p, x: jnp.sum(jnp.sin(module.apply(p, x)))

        np.testing.assert_allclose(loss(auto)(params, x), loss(plain)(params, x), rtol=1e-12)
        g_auto = jax.jit(jax.grad(loss(auto), argnums=(0, 1)))(params, x)
        g_plain = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(params, x)
        for a, b in zip(jax.tree.leaves(g_auto), jax.tree.leaves(g_plain), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_conv_models_default_to_auto_and_match_lax():
    """A small CNN with the default conv_impl: same loss and gradients as nn.Conv (float64)."""
    assert models.get_model("lenet5").module.conv_impl == "auto"
    assert models.get_model("resnet18").module.conv_impl == "auto"
    small = dict(features=(2, 3), dense_sizes=(4,), num_classes=5)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3), jnp.float64)
        batch = {"x": x, "y": jnp.array([1, 3])}
        default = models.get_model("cnn", **small)
        lax_model = models.get_model("cnn", conv_impl="lax", **small)
        assert default.module.conv_impl == "auto"
        params, state = lax_model.init(jax.random.key(1), x)
        params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
        value = lambda m: jax.jit(
            jax.value_and_grad(lambda p: m.loss_fn(p, state, batch, None)[0])
        )(params)
        (l_auto, g_auto), (l_lax, g_lax) = value(default), value(lax_model)
        np.testing.assert_allclose(l_auto, l_lax, rtol=1e-12)
        for a, b in zip(jax.tree.leaves(g_auto), jax.tree.leaves(g_lax), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def _toy_federated(example_shape, examples):
    """Four clients with equal shares of `examples` random examples of 3 classes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((examples, *example_shape)).astype(np.float32)
    y = rng.integers(0, 3, examples)
    parts = np.split(np.arange(examples), 4)
    return x, make_federated(x, y, x[:4], y[:4], parts, name="t", num_classes=3)


def _toy_round(model, algorithm, x, *, strategy, local_steps, batch_size):
    """(round_fn, server): 4 clients, 2 per round (chunks of 2), lr 0.1, `model.init(key 0)`."""
    params, state = model.init(jax.random.key(0), x[:2])
    config = fed.RoundConfig(4, 2, local_steps, 0.1, strategy=strategy, chunk_size=2)
    round_fn = fed.make_round_fn(
        algorithm, model.loss_fn, lambda d, c, k: sample_batch(d, c, k, batch_size), config
    )
    server = fed.init_server(algorithm, params, state, num_clients=4, key=jax.random.key(1))
    return round_fn, server


def _one_round_params(model, algorithm, x, data, **round_options):
    """Server params after one `_toy_round`."""
    round_fn, server = _toy_round(model, algorithm, x, **round_options)
    return round_fn(server, data)[0].params


def _assert_trees_close(a, b, rtol, atol):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol)


def test_auto_strategy_resolves_per_backend_and_keeps_the_round():
    """ "auto" is "sequential" on CPU and gives the round of the explicit strategies."""
    assert resolve_strategy("auto") == "sequential" and resolve_strategy("vmap") == "vmap"
    assert fed.RoundConfig(4, 2, 3, 0.1).strategy == "auto"
    x, data = _toy_federated((6,), 40)
    model = models.get_model("mlp", hidden_sizes=(8,), num_classes=3)
    algorithm = fed.get_algorithm("fedavg", {"name": "sgd", "learning_rate": 0.1})
    vmap, auto = (
        _one_round_params(model, algorithm, x, data, strategy=s, local_steps=3, batch_size=5)
        for s in ("vmap", "auto")
    )
    _assert_trees_close(vmap, auto, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "strides, padding, kernel",
    [((1, 1), "SAME", (5, 5)), ((2, 1), "SAME", (3, 2)), ((2, 2), ((1, 1), (1, 1)), (3, 3)),
     ((2, 2), "VALID", (1, 1)), ((3, 2), ((2, 0), (1, 3)), (4, 3))],
)  # fmt: skip
def test_canonical_conv_gradients_equal_lax_in_float64(strides, padding, kernel):
    """Canonical dW/dx (swapped-axes and dilated convolutions) are the same sums as jax.grad's."""
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (2, 9, 7, 3), jnp.float64)
        w = jax.random.normal(jax.random.key(1), (*kernel, 3, 4), jnp.float64)
        dims = ("NHWC", "HWIO", "NHWC")

        def loss(conv):
            return lambda x, w: jnp.sum(
                jnp.sin(conv(x, w, strides, padding, dimension_numbers=dims))
            )

        theirs = jax.jit(jax.value_and_grad(loss(jax.lax.conv_general_dilated), (0, 1)))(x, w)
        ours = jax.jit(jax.value_and_grad(loss(conv_general_dilated_canonical), (0, 1)))(x, w)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def _toy_cnn(conv_impl):
    return models.get_model(
        "cnn", features=(16, 16), dense_sizes=(4,), num_classes=3, conv_impl=conv_impl
    )


def test_sequential_round_with_canonical_conv_equals_the_vmap_lax_round():
    """The opt-in canonical convolution (sequential clients) gives the round of nn.Conv."""
    x, data = _toy_federated((8, 8, 1), 16)
    algorithm = fed.get_algorithm("fedavg", {"name": "sgd", "learning_rate": 0.1})
    results = []
    for strategy, conv_impl in (("vmap", "lax"), ("sequential", "canonical")):
        # The first layer (1 input channel) runs im2col + dot under "canonical", the second
        # (16 input channels) the canonical convolution with its custom VJP.
        model = _toy_cnn(conv_impl)
        results.append(
            _one_round_params(
                model, algorithm, x, data, strategy=strategy, local_steps=2, batch_size=4
            )
        )
    _assert_trees_close(*results, rtol=1e-5, atol=1e-6)


def test_sharded_sophia_round_of_a_conv_model_equals_the_sequential_round():
    """FedPAC_Sophia (forward-over-reverse Hessian products) on the auto/sharded path gives the
    one-device sequential round: parameters, averaged optimizer states and metrics."""
    x, data = _toy_federated((8, 8, 1), 16)
    algorithm = fed.get_algorithm("fedpac", {"name": "sophia", "learning_rate": 0.01}, beta=0.5)
    model = _toy_cnn("auto")
    results = []
    for strategy in ("sequential", "auto"):
        round_fn, server = _toy_round(
            model, algorithm, x, strategy=strategy, local_steps=2, batch_size=4
        )
        for _ in range(2):
            server, metrics = round_fn(server, data)
        results.append((server.params, server.opt_state, metrics))
    assert round_fn.strategy == "sharded"
    _assert_trees_close(*results, rtol=2e-5, atol=1e-6)


# SOAP refreshing its bases every step; axes longer than 16 (Dense_0's 64 inputs) unrotated: a
# 64 x 64 factor of a 64 x 4 kernel has rank <= 4 and its 60-dimensional null space has no
# preferred basis, so the server's eigh of the averaged factor would pick an arbitrary one.
_SOAP_EVERY_STEP = {
    "name": "soap",
    "learning_rate": 0.01,
    "precondition_frequency": 1,
    "max_precond_dim": 16,
}


@pytest.mark.parametrize(
    "name, optim, options",
    [
        ("fedpac", _SOAP_EVERY_STEP, {"beta": 0.5}),
        ("local_soap", _SOAP_EVERY_STEP, {}),
        ("fedmuon", {"name": "muon", "learning_rate": 0.01}, {"svd_ratio": 0.5}),
    ],
)
def test_host_lapack_rounds_shard_and_equal_the_sequential_round(name, optim, options):
    """SOAP's QR/eigh (client refreshes every step here, FedPAC's server bases) and FedMuon's
    low-rank momentum compression (SVD) run LAPACK on the host inside the round. With
    `jax.pure_callback` a sharded FedPAC_SOAP round hung (its `device_put` of the operands
    needs a pool thread that the devices' callbacks all hold; py-spy). `fedorth.optim.linalg`'s
    own host call does not, so "auto" shards these rounds too, and the round equals the
    one-device sequential round: parameters, optimizer states and metrics.

    One round: each device runs the sequential round's per-client code, so only the all-reduced
    means differ (~1e-8). A second round starts from those slightly different parameters, and the
    Adam-type steps inside SOAP turn such differences in near-zero gradient coordinates into
    steps of up to +-lr (m / sqrt(v) is a sign when |g| >> eps): 1e-4 apart after two rounds here,
    as any change of summation order does (vmap vs sequential: 0.1)."""
    from fedorth.optim import linalg

    assert linalg.HOST_CALLS_SHARD, "the installed JAX lacks the host-call internals"
    x, data = _toy_federated((8, 8, 1), 16)
    model = _toy_cnn("auto")
    algorithm = fed.get_algorithm(name, optim, **options)
    results = []
    for strategy in ("sequential", "auto"):
        round_fn, server = _toy_round(
            model, algorithm, x, strategy=strategy, local_steps=2, batch_size=4
        )
        server, metrics = round_fn(server, data)
        results.append((server.params, server.opt_state, metrics))
    assert round_fn.strategy == "sharded"
    _assert_trees_close(*results, rtol=2e-5, atol=1e-6)


def test_without_the_host_call_internals_host_lapack_rounds_stay_on_one_cpu_device(monkeypatch):
    """Where the installed JAX lacks the internals `linalg`'s host call uses, `linalg` falls back
    to `jax.pure_callback` (HOST_CALLS_SHARD False), which hangs on sharded CPU rounds: "auto"
    then keeps SOAP states and low-rank compression on one device, and "sharded" is refused,
    while FedPAC_Sophia (no host LAPACK) still shards."""
    from fedorth.optim import linalg

    monkeypatch.setattr(linalg, "HOST_CALLS_SHARD", False)
    x, _ = _toy_federated((8, 8, 1), 16)
    model = _toy_cnn("auto")
    for name, optim, options in (
        ("fedpac", _SOAP_EVERY_STEP, {"beta": 0.5}),
        ("local_soap", _SOAP_EVERY_STEP, {}),
        ("fedmuon", {"name": "muon", "learning_rate": 0.01}, {"svd_ratio": 0.5}),
    ):
        algorithm = fed.get_algorithm(name, optim, **options)
        round_fn, _ = _toy_round(model, algorithm, x, strategy="auto", local_steps=1, batch_size=4)
        assert round_fn.strategy == "sequential", name
        with pytest.raises(ValueError, match="run LAPACK on the host"):
            _toy_round(model, algorithm, x, strategy="sharded", local_steps=1, batch_size=4)
    sophia = fed.get_algorithm("fedpac", {"name": "sophia", "learning_rate": 0.01}, beta=0.5)
    round_fn, _ = _toy_round(model, sophia, x, strategy="auto", local_steps=1, batch_size=4)
    assert round_fn.strategy == "sharded"


def test_auto_round_of_a_conv_model_shards_clients_and_equals_the_vmap_lax_round():
    """On CPU with several devices, "auto" lays a convolutional model's clients over the devices
    that divide S (here 2 of the 8 fake ones), each running its clients one at a time with the
    canonical convolution, and reads the federated data (gathered by `sample_batch`) replicated:
    the round equals the one-device vmap round with nn.Conv."""
    x, data = _toy_federated((8, 8, 1), 16)
    algorithm = fed.get_algorithm("fedavg", {"name": "sgd", "learning_rate": 0.1})
    results = []
    for strategy, conv_impl in (("vmap", "lax"), ("auto", "auto")):
        model = _toy_cnn(conv_impl)
        round_fn, server = _toy_round(
            model, algorithm, x, strategy=strategy, local_steps=2, batch_size=4
        )
        placed = round_fn.place(data)
        for _ in range(2):
            server, metrics = round_fn(server, placed)
        results.append((server.params, metrics))
    assert round_fn.strategy == "sharded"
    assert server.params["Dense_0"]["kernel"].sharding.mesh.shape == {"clients": 2}
    assert placed.x_train.sharding.is_fully_replicated
    _assert_trees_close(*results, rtol=1e-5, atol=1e-6)


def test_canonical_impl_uses_the_canonical_conv_from_16_input_channels():
    """Below CANONICAL_MIN_CHANNELS input channels "canonical" is im2col + dot (no conv op)."""
    from fedorth.models.layers import CANONICAL_MIN_CHANNELS

    assert CANONICAL_MIN_CHANNELS == 16
    model = models.get_model("cnn", features=(16, 8), dense_sizes=(4,), conv_impl="canonical")
    x = jnp.ones((2, 8, 8, 3))
    params, state = model.init(jax.random.key(0), x)
    batch = {"x": x, "y": jnp.zeros(2, jnp.int32)}
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: model.loss_fn(p, state, batch, None)[0]))(params))
    # Conv_0 (3 input channels) is im2col + dot; Conv_1 (16) the canonical convolution: one
    # custom-VJP call holding the forward convolution, and the two gradient convolutions.
    assert jaxpr.count("custom_vjp_call") == 1, jaxpr.count("custom_vjp_call")
    assert jaxpr.count("conv_general_dilated") == 3


def test_mean_over_clients_equals_the_float64_mean():
    """The pairwise slice-add tree (odd sizes fold the last row in) is the mean over axis 0."""
    from fedorth.optim.federated import mean_over_clients

    rng = np.random.default_rng(3)
    for clients in (1, 2, 3, 7, 16):
        x = rng.standard_normal((clients, 5, 3)).astype(np.float32)
        got = mean_over_clients(jnp.asarray(x))
        assert got.dtype == jnp.float32 and got.shape == (5, 3)
        np.testing.assert_allclose(got, x.astype(np.float64).mean(0), rtol=1e-6, atol=1e-7)
    counts = jnp.array([[1, 2], [4, 7]], jnp.int32)  # non-float: as jnp.mean (float result)
    np.testing.assert_allclose(mean_over_clients(counts), [2.5, 4.5])


def test_default_conv_supports_forward_mode_optimizers_in_a_sequential_round():
    """Sophia's Hessian-vector products (jvp of grad) run through the default conv (auto) in the
    default (sequential) round, where the gradient's wide layer is the custom-VJP canonical
    convolution (no forward mode: the objective handed to Sophia is traced with im2col + dot,
    layers.conv_trace_mode("forward")); the round equals the vmap round of nn.Conv. Explicit
    "canonical" takes the same path."""
    x, data = _toy_federated((8, 8, 1), 16)
    optim = {"name": "sophia", "learning_rate": 0.1, "update_interval": 1}
    algorithm = fed.get_algorithm("fedavg", optim)
    results = []
    for strategy, conv_impl in (("vmap", "lax"), ("sequential", "auto"), ("auto", "canonical")):
        model = models.get_model(
            "cnn", features=(16, 16), dense_sizes=(4,), num_classes=3, conv_impl=conv_impl
        )
        results.append(
            _one_round_params(
                model, algorithm, x, data, strategy=strategy, local_steps=2, batch_size=4
            )
        )
    _assert_trees_close(results[0], results[1], rtol=1e-5, atol=1e-6)
    _assert_trees_close(results[0], results[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "strategy, optim, custom_vjp_calls",
    [("sequential", "sgd", 1), ("sequential", "sophia", 1), ("vmap", "sgd", 0),
     ("chunked", "sgd", 0)],
)  # fmt: skip
def test_auto_conv_is_canonical_only_in_the_sequential_client_loop(
    strategy, optim, custom_vjp_calls
):
    """conv_impl="auto" on CPU: the canonical convolution (a custom-VJP call, for the layer with
    16 input channels) in the sequential round's gradient, im2col + dot under vmap/chunked (where
    it would be a grouped convolution) and in Sophia's Hessian-vector products (forward mode)."""
    x, data = _toy_federated((8, 8, 1), 16)
    model = models.get_model("cnn", features=(16, 16), dense_sizes=(4,), num_classes=3)
    algorithm = fed.get_algorithm("fedavg", {"name": optim, "learning_rate": 0.1})
    round_fn, server = _toy_round(
        model, algorithm, x, strategy=strategy, local_steps=2, batch_size=4
    )
    jaxpr = str(jax.make_jaxpr(round_fn)(server, data))
    assert jaxpr.count("custom_vjp_call") == custom_vjp_calls, jaxpr.count("custom_vjp_call")
    # Outside the round, nothing is declared: "auto" is im2col + dot (any transformation).
    batch = {"x": x[:2], "y": jnp.zeros(2, jnp.int32)}

    def loss(p):
        return model.loss_fn(p, server.model_state, batch, None)[0]

    assert str(jax.make_jaxpr(jax.grad(loss))(server.params)).count("custom_vjp_call") == 0
