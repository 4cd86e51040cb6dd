"""Tests for the benchmark package (experiments/bench/) and its PyTorch peer.

They check the pieces the numbers rest on: the FLOP count (a dense step against its analytic
count), that the ``--quick`` subcommand runs and writes every field, that the torch peer does the
same arithmetic as fedorth (SGD against float64 NumPy; Muon's Newton–Schulz and SOAP against
fedorth's), and that the automatic execution choices (``conv_impl="auto"``, ``strategy="auto"``)
and the canonical convolution give the numbers of the explicit ones.
"""

import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import blas_threads_seen, equations, fast_jit

from experiments.bench import (
    budget,
    cases,
    cli,
    flops,
    jax_loop,
    output,
    presets,
    rounds,
    runners,
    workloads,
)
from fedorth import fed, models
from fedorth.data.federated import make_federated, sample_batch
from fedorth.models.layers import (
    conv2d,
    conv_general_dilated_canonical,
    kernel_grad_chunk,
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
    counted = flops.step_flops(loss_fn, params, {}, {"x": jnp.ones((b, i))}, None)
    analytic = 4 * b * i * o
    assert abs(counted - analytic) / analytic < 0.01, (counted, analytic)


def test_muon_flops_sum_newton_schulz_over_matrix_views():
    """Conv kernels count as (kh·kw·in, out) matrices; vectors do not count."""
    params = {"conv": jnp.zeros((5, 5, 3, 32)), "bias": jnp.zeros(32), "dense": jnp.zeros((64, 10))}
    expected = newton_schulz_flops((75, 32), 5) + newton_schulz_flops((64, 10), 5)
    assert flops.muon_flops(params) == expected
    # 75×32: per step 4·32²·75 + 2·32³ (newton_schulz_flops' docstring).
    assert newton_schulz_flops((75, 32), 1) == 4 * 32 * 32 * 75 + 2 * 32**3


@pytest.mark.parametrize("impl", ["lax", "matmul", "canonical"])
def test_conv_step_flops_match_the_hand_count(impl):
    """One 3x3 SAME convolution (16 -> 4 channels, 8x8, batch 2), each way it can run: forward
    2·B·H·W·kh·kw·cin·cout (padded borders included, as im2col's dot computes them), a step
    3× that (backward = input and weight gradients, one product each). XLA:GPU's cost analysis
    counted none of it (cuDNN calls): full-width resnet18 read 88 GFLOP/s where ~50 TFLOP/s ran."""
    from fedorth.models.layers import _CONV_FNS

    b, h, w, cin, cout, k = 2, 8, 8, 16, 4, 3
    conv = _CONV_FNS[impl] or jax.lax.conv_general_dilated

    def loss_fn(params, model_state, batch, key):
        del key
        y = conv(
            batch["x"], params["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return 0.5 * jnp.sum(y * y), (model_state, {})

    params = {"w": jnp.ones((k, k, cin, cout))}
    flops_count = flops.model_step_flops(loss_fn, params, {}, {"x": jnp.ones((b, h, w, cin))}, None)
    assert flops_count == 3 * 2 * b * h * w * k * k * cin * cout


def test_resnet18_cifar100_step_flops_match_the_layer_by_layer_count():
    """The papers' ResNet-18 (CIFAR stem, full width, 100 classes) at batch 50: 3 × (2 × the
    multiply-adds of every convolution and the classifier), counted by hand from the layer
    shapes; 0.56 GMAC per image forward, the figure usually quoted for this network."""

    workload = workloads.WORKLOADS["resnet18_cifar100"]
    assert (workload.model, workload.num_classes, dict(workload.kwargs)) == (
        "resnet18", 100, {"width": 1.0}
    )  # fmt: skip
    model = workloads.build_model(workload, "auto")
    x = jax.ShapeDtypeStruct((50, 32, 32, 3), jnp.float32)
    params, state = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), x)
    batch = {"x": x, "y": jax.ShapeDtypeStruct((50,), jnp.int32)}
    flops_count = flops.model_step_flops(model.loss_fn, params, state, batch, jax.random.key(1))
    macs = 32 * 32 * 9 * 3 * 64 + 4 * 32 * 32 * 9 * 64 * 64  # stem, stage 1
    for side, c_in, c in ((16, 64, 128), (8, 128, 256), (4, 256, 512)):
        macs += side * side * (9 * c_in * c + 3 * 9 * c * c + c_in * c)  # 3x3 convs + 1x1 shortcut
    macs += 512 * 100
    assert round(macs / 1e7) == 56, macs
    assert flops_count == 3 * 2 * 50 * macs, (flops_count, 3 * 2 * 50 * macs)


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
    assert cli.main(["bench", *argv]) == 0
    result = json.loads(path.read_text())
    keys = ("date", "device", "cpu_threads", "jax", "openblas_threads", "command", "rows")
    keys += ("fedpac_aligned",)
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


def test_optim_subcommand_writes_json_with_consistent_figures(tmp_path):
    """`python -m experiments.bench optim` on one small leaf: the update table, then Newton–Schulz
    alone, whose GFLOP/s is newton_schulz_flops over the measured time and whose fraction of the
    reference matmul uses the faster of the two matmul measurements."""
    path = tmp_path / "optim.json"
    argv = ["optim", "--shapes", "8x12", "--repeats", "1", "--warmup", "0"]
    argv += ["--optimizers", "optax.adamw", "--ns-steps", "3", "--json", str(path)]
    assert cli.main(["bench", *argv]) == 0
    result = json.loads(path.read_text())
    assert set(result["update_ms"]["8x12"]) == {"optax.adamw"} and not result["skipped"]
    ns = result["newton_schulz"]["8x12"]
    assert ns["matrix"] == [8, 12]
    seconds = ns["fedorth_ms"] / 1e3
    assert ns["fedorth_gflops"] == pytest.approx(newton_schulz_flops((8, 12), 3) / seconds / 1e9)
    assert ns["fraction_of_matmul"] == pytest.approx(
        ns["fedorth_gflops"] / max(result["matmul_2048_gflops"])
    )
    with pytest.raises(SystemExit):  # argparse: an unknown optimizer names the valid ones
        cli.main(["bench", "optim", "--optimizers", "sgd"])
    assert cli.main(["bench", "sweep-typo"]) == 2, "an unknown subcommand prints the usage"


def test_entry_points_run_host_lapack_with_one_openblas_thread_unless_told_otherwise():
    # SOAP/FedPAC factorizations run SciPy's LAPACK on the host; with OpenBLAS's default threads
    # they spin against XLA's (lenet5 FedPAC_SOAP 145 vs 109 ms per 2-round period, PERFORMANCE.md),
    # so every `python -m experiments.X` must set the variable before NumPy loads: the package's
    # __init__ does it, ahead of any of its modules.
    def run(module, **extra):
        # NumPy is imported after the module, as a run's first use of it would be (experiments.main
        # loads fedorth lazily, so importing it alone no longer loads NumPy).
        script = (
            f"import os, sys; import {module}; "
            "numpy_first = 'numpy' in sys.modules; import numpy; "
            "print(os.environ.get('OPENBLAS_NUM_THREADS'), numpy_first)"
        )
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"} | extra
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        return done.stdout.split()

    # Set before NumPy can load: importing the package alone loads no NumPy.
    assert run("experiments") == ["1", "False"], "the package did not set the variable first"
    for module in ("experiments.bench", "experiments.main"):
        assert run(module)[0] == "1", f"{module} did not default OPENBLAS_NUM_THREADS to 1"
        assert run(module, OPENBLAS_NUM_THREADS="2")[0] == "2", "an explicit value was lost"


def test_entry_points_split_the_cpu_into_one_jax_device_per_core_unless_told_otherwise():
    # `auto` shards convolutional clients over the CPU devices (cnn 1.22x torch at S = 10 x
    # K = 10 against 0.90x on one device, PERFORMANCE.md "CPU: rounds against the PyTorch
    # peer"): the package sets JAX_NUM_CPU_DEVICES before JAX loads, unless XLA_FLAGS forces a
    # count or a value is given.
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
    from experiments.bench.sections import cpu_devices_env

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
        rounds.parse_args(["--workloads", "vgg"])
    with pytest.raises(ValueError, match="fed.unroll=0; valid: an int >= 1 or True"):
        fed.RoundConfig(4, 2, 3, 0.1, unroll=0).validate(
            fed.get_algorithm("fedavg", {"name": "sgd", "learning_rate": 0.1})
        )


# ----------------------------------------------------------------------------- the package


def _bench_imports() -> dict[str, tuple[set[str], list[str]]]:
    """Module of experiments/bench -> (the package's modules it imports at top level, the
    package's modules it imports inside a function or class), read from the source."""
    import ast
    import pathlib

    folder = pathlib.Path(cli.__file__).parent
    modules = {path.stem for path in folder.glob("*.py")}
    found = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        top, nested = set(), []
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = "experiments.bench" if node.level else (node.module or "")
                if node.level and node.module:
                    base += f".{node.module}"
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            targets = set()
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["experiments", "bench"]:
                    targets.add(parts[2] if len(parts) > 2 and parts[2] in modules else "__init__")
            (top.update if node in tree.body else nested.extend)(targets)
        found[path.stem] = (top - {path.stem}, nested)
    return found


def _documented_bench_commands() -> list[tuple[str, list[str]]]:
    """Every ``python -m experiments.bench ...`` command in README.md, docs/ and benchmarks/
    (inline code spans and code blocks, continuation lines joined), as (where, argv)."""
    import pathlib
    import shlex

    root = pathlib.Path(cli.__file__).resolve().parents[2]
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md")),
                 *sorted((root / "benchmarks").glob("*.md"))]:  # fmt: skip
        text = path.read_text().replace("\\\n", " ")
        spans = re.findall(r"`(python -m experiments\.bench\b[^`]*)`", text)
        spans += re.findall(r"^\s*(python -m experiments\.bench\b.*)$", text, flags=re.M)
        for span in spans:
            command = re.split(r"&&|;|\||>", " ".join(span.split()))[0]
            found.append((str(path.relative_to(root)), shlex.split(command)[3:]))
    return found


def test_every_documented_bench_command_parses():
    """The benchmark commands the documentation gives name a registered subcommand whose
    options parse (the subcommand module's parse_args, as ``main`` runs it)."""
    commands = _documented_bench_commands()
    assert len(commands) >= 15 and {"round", "optim"} <= {argv[0] for _, argv in commands}
    for where, argv in commands:
        assert argv and argv[0] in cli.SUBCOMMANDS, (where, argv)
        module = sys.modules[cli.SUBCOMMANDS[argv[0]].__module__]
        assert hasattr(module, "parse_args"), (
            f"{module.__name__} needs parse_args(argv) beside main (experiments/bench/__init__.py)"
        )
        try:
            module.parse_args(argv[1:])
        except SystemExit as exit_:
            raise AssertionError(f"{where}: {' '.join(argv)} does not parse") from exit_


def test_bench_finds_the_checkout_it_runs_from():
    """The JSON header's commit is this checkout's HEAD, and the PyTorch peer is the checkout's
    benchmarks/torch_peer.py (both found from the package's own path)."""
    head = subprocess.run(
        ["git", "-C", os.path.dirname(cli.__file__), "rev-parse", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert output.project_commit() == head
    assert runners.TORCH_PEER.is_file() and runners.TORCH_PEER.parent.name == "benchmarks"


def test_bench_package_has_no_import_cycle_and_no_lazy_imports():
    """experiments/bench's modules import each other at the top only, along an acyclic graph
    (the order of the package docstring), and its __init__ imports none of them, so each module
    imports alone."""
    graph = _bench_imports()
    assert {"cli", "rounds", "optim", "jax_loop", "__main__"} <= set(graph)
    assert graph["__init__"] == (set(), []), "the package's __init__ imports no module of it"
    for module, (_, nested) in graph.items():
        assert not nested, f"{module} imports {nested} inside a function (a hidden cycle)"
    order, done = [], set()
    while len(done) < len(graph):
        ready = [
            m for m, (deps, _) in graph.items() if m not in done and deps - {"__init__"} <= done
        ]
        assert ready, f"import cycle among {sorted(set(graph) - done)}"
        done.update(ready)
        order.append(sorted(ready))
    assert order[-1] == ["__main__"] and ["cli"] in order


# ----------------------------------------------------------------------------- the jax_loop peer

# The bench's algorithms with the local optimizers it runs them with (workloads.ALGORITHMS),
# then one case for each other path of the peer: a warm start from the whole averaged state
# (FedMuon), a server optimizer (FedAdam), the global server step x <- x - gamma g_G, server
# quantities updated without reports (FedAvg-VR's).
_PEER_CASES = {name: (name, optim, {}) for name, optim in workloads.ALGORITHMS.items()}
_PEER_CASES |= {
    "fedmuon": ("fedmuon", {"name": "muon"}, {}),
    "fedadam": ("fedadam", {"name": "sgd"}, {}),
    "fedpac_muon[server_lr]": ("fedpac_muon", {"name": "muon"}, {"server_lr": 0.5}),
    "fedavg_vr": ("fedavg_vr", {"name": "sgd"}, {}),
}


def _peer_problem():
    """fed_problems' quadratic clients with terms read off the batch and model keys
    (``fed_problems.key_noise``: the two implementations must derive the same keys) and a float
    model state the server averages."""
    import fed_problems as fp

    data = jax.tree.map(jnp.asarray, fp.quadratic_clients(6, seed=5))

    def batch_fn(data, client, key):
        batch = fp.batch_fn(data, client, key)
        return {**batch, "B": batch["B"] + 0.1 * fp.key_noise(key)}

    def loss_fn(params, model_state, batch, key):
        loss, _ = fp.noisy_loss_fn(params, model_state, batch, key)
        return loss, ({"ema": 0.9 * model_state["ema"] + 0.1 * params["b"]}, {})

    return data, fp.zero_params(), {"ema": jnp.zeros(3)}, loss_fn, batch_fn


@pytest.mark.parametrize("case", sorted(_PEER_CASES))
def test_jax_loop_peer_agrees_with_the_engine_for_three_rounds(case):
    """The jax_loop peer runs the engine's algorithm through its axis specs (server state, keys,
    client start, corrections, server step): 3 rounds equal the engine's sequential round to
    float32 rounding on every float leaf of the server state, for every algorithm the bench runs
    (FedPAC warm-starts Theta only) and each other path of the peer."""
    name, optim, options = _PEER_CASES[case]
    algorithm = fed.get_algorithm(name, {**optim, "learning_rate": 0.05}, **options)
    data, params, model_state, loss_fn, batch_fn = _peer_problem()
    config = fed.RoundConfig(6, 4, 2, 0.05, strategy="sequential")
    servers = []
    for make in (fed.make_round_fn, jax_loop.JaxLoopRound):
        round_fn = make(algorithm, loss_fn, batch_fn, config)
        server = fed.init_server(
            algorithm, params, model_state, num_clients=6, key=jax.random.key(1)
        )
        # float32 products on every backend (a GPU's default runs them in TF32), so that what
        # may differ is the order of float32 operations only.
        with jax.default_matmul_precision("float32"):
            for _ in range(3):
                server = round_fn(server, data)
                server = server[0] if isinstance(server, tuple) else server  # the engine's metrics
        servers.append(server.replace(key=jax.random.key_data(server.key)))
    engine, loop = servers
    leaves = jax.tree_util.tree_leaves_with_path(engine)
    for (path, a), b in zip(leaves, jax.tree.leaves(loop), strict=True):
        where = jax.tree_util.keystr(path)
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=where)
        else:
            np.testing.assert_array_equal(a, b, err_msg=where)


def test_jax_loop_peer_refuses_what_it_does_not_implement(monkeypatch):
    """Every registered algorithm outside the peer's design-axis values (clients that keep their
    own state, control variates, reports, a pre-pass, compressed uploads) is refused, naming
    them, before anything compiles; the bench's round skips its jax_loop row with that reason."""
    refused = {}
    for name in sorted(fed.ALGORITHMS):
        for optimizer in ("sgd", "muon", "soap", "sophia", "adamw", "lmo"):
            try:
                algorithm = fed.get_algorithm(name, {"name": optimizer, "learning_rate": 0.05})
                break
            except ValueError:  # a preset of another optimizer
                continue
        why = jax_loop.unsupported(algorithm)
        if why is not None:
            refused[name] = why
            config = fed.RoundConfig(6, 4, 2, 0.05)
            with pytest.raises(ValueError, match=re.escape(why)):
                jax_loop.JaxLoopRound(algorithm, None, None, config)
    assert "clients that keep their own state" in refused["fedmuon_bc"]
    assert "control variates" in refused["scaffold"]
    assert "low-rank state compression" in refused["fedpac_soap_light"]
    assert set(workloads.ALGORITHMS).isdisjoint(refused), "the bench's algorithms all run"
    monkeypatch.setitem(
        workloads.ALGORITHMS, "fedpac_soap_light", workloads.ALGORITHMS["fedpac_soap"]
    )
    case = workloads.Case("mlp_small", "fedpac_soap_light", 2, 2, 8)
    with pytest.raises(cases.Skip, match="low-rank state compression"):
        cases.make_runner(("jax_loop",), case, None, None)


# ----------------------------------------------------------------------------- the torch peer


@needs_torch
def test_peer_models_have_fedorth_parameter_counts():
    torch.manual_seed(0)
    for name, w in workloads.WORKLOADS.items():
        model = workloads.build_model(w, "auto")
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
    assert runners.torch_device() == "cpu" and peer.x.device.type == "cpu"
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


def test_every_side_of_a_fedpac_case_runs_the_asked_alignment_mode():
    """fedorth, jax_loop and the torch peer of a case all run ``--aligned`` (default: fedorth's
    own default, Theta only), and each FedPAC row says which."""
    from fedorth.optim import federated

    for argv, mask in (([], federated.align_mask), (["--aligned", "state"], None)):
        args = rounds.parse_args(
            ["--workloads", "mlp", "--algorithms", "fedpac_soap,fedavg", *argv]
        )
        soap_case, fedavg_case = rounds.make_cases(args)
        assert soap_case.fed_algorithm().start.mask is mask
        assert soap_case.aligned_mode == (argv[-1] if argv else "theta")
        assert fedavg_case.aligned_mode is None  # no optimizer state aligned: nothing to say
        preset = rounds.make_cases(rounds.parse_args(["--preset", "targets", *argv]))
        assert {case.aligned for case in preset} == {soap_case.aligned}
    with pytest.raises(SystemExit):  # argparse names the valid modes
        rounds.parse_args(["--aligned", "whole"])


def test_lapack_threads_rows_lower_their_round_with_their_count(monkeypatch):
    """``--lapack-threads 1,2`` makes one fedorth row per count, and each row's round is lowered
    with its count: its host eigh calls run with that many OpenBLAS threads."""
    args = rounds.parse_args(["--lapack-threads", "1,2", "--peers", "none"])
    specs = cases.runner_specs(rounds.make_cases(args)[0], args)
    assert [spec[-1] for spec in specs] == ["1", "2"]
    with pytest.raises(ValueError, match="--lapack-threads='0'"):
        rounds.parse_args(["--lapack-threads", "0"])
    seen = blas_threads_seen(monkeypatch)
    case = workloads.Case("mlp_small", "fedpac_soap", 2, 2, 8)
    data, fed_data = workloads.case_data(case)
    runner = runners.FedorthRunner(
        case, data, fed_data, strategy="sequential", conv_impl=None, unroll=1, lapack_threads="2"
    )
    runner.warmup()
    runner.run()
    assert seen and set(seen) == {2}, seen
    assert runner.settings["lapack_threads"] == "2"
    assert os.environ.get("FEDORTH_LAPACK_THREADS") == "1", "the row's count was left set"


def test_rows_count_the_seconds_of_their_host_lapack_calls():
    """A FedPAC_SOAP row's ``lapack_s`` is the median over its timed rounds of the seconds its
    host eigh calls took (each client's update-free call, the server's basis), never more than
    the round; a FedAvg row, which makes none, has no such field. The clock counts what a call
    takes: an eager host eigh adds more than 0 and at most the wall time around it."""
    from fedorth.optim import linalg

    before = linalg.host_seconds()
    start = time.perf_counter()
    linalg.eigh(jnp.eye(64, dtype=jnp.float32))[1].block_until_ready()
    wall = time.perf_counter() - start
    assert 0 < linalg.host_seconds() - before <= wall
    rows = {}
    for algorithm in ("fedpac_soap", "fedavg"):
        case = workloads.Case("mlp_small", algorithm, 2, 2, 8)
        data, fed_data = workloads.case_data(case)
        runner = runners.FedorthRunner(
            case, data, fed_data, strategy="sequential", conv_impl=None, unroll=1
        )
        runner.warmup()
        times = [runner.run() for _ in range(3)]
        rows[algorithm] = (runner.finish(), times)
    soap, times = rows["fedpac_soap"]
    assert len(soap["lapack_s_all"]) == 3
    assert soap["lapack_s"] == statistics.median(soap["lapack_s_all"])
    for seconds, round_s in zip(soap["lapack_s_all"], times, strict=True):
        assert 0 < seconds <= round_s
    assert "lapack_s" not in rows["fedavg"][0]


def _fedorth_soap_rounds(grads, lr, per_round, **kwargs):
    """fedorth's SOAP over rounds of ``per_round`` steps, each round restarting what FedPAC's
    Theta alignment restarts (one client: the server's average is its own state)."""
    from fedorth.optim.soap import scale_by_soap, soap_align_mask

    tx = scale_by_soap(**kwargs)
    params = jnp.zeros(grads[0].shape)
    state = tx.init(params)
    for step, g in enumerate(grads):
        if step and step % per_round == 0:
            fresh = tx.init(params)
            keep = soap_align_mask(fresh)
            state = jax.tree.map(lambda k, s, f: s if k else f, keep, state, fresh)
        d, state = tx.update(jnp.asarray(g), state, params)
        params = params - lr * d
    return np.asarray(params)


@needs_torch
def test_peer_theta_alignment_runs_fedorths_soap_rounds():
    """Three rounds of three steps: the peer's Theta-aligned SOAP (L, R, Q and the schedule
    counter warm-started, the moments restarted) follows fedorth's step for step, including
    each round's update-free eigh call and a basis refresh counted over the whole training."""
    rng = np.random.default_rng(3)
    lr, per_round = 0.1, 3
    grads = [rng.standard_normal((5, 5)).astype(np.float32) for _ in range(3 * per_round)]
    p = torch.nn.Parameter(torch.zeros(grads[0].shape, dtype=torch.float32))
    eighs = []
    original = torch_peer.soap_eigenbasis
    saved = None
    for step, g in enumerate(grads):
        if step % per_round == 0:
            opt = torch_peer.SOAP([p], lr, precondition_frequency=2)
            if saved is not None:
                opt.state[p] = {k: v for k, v in saved.items() if k in opt.ALIGNED}
        torch_peer.soap_eigenbasis = lambda gg: eighs.append(step) or original(gg)
        try:
            p.grad = torch.from_numpy(g)
            opt.step()
        finally:
            torch_peer.soap_eigenbasis = original
        saved = opt.state[p]
    assert eighs == [0, 0, 3, 3, 6, 6], "one eigh per factor at each round's first call"
    ours = _fedorth_soap_rounds(grads, lr, per_round, precondition_frequency=2)
    np.testing.assert_allclose(p.detach().numpy(), ours, atol=2e-4)


@needs_torch
@pytest.mark.parametrize("aligned", ["theta", "state"])
def test_peer_warm_starts_what_the_mode_aligns(aligned):
    """A peer FedPAC round warm-starts Theta (SOAP: L, R, Q, count) under ``theta``, every key
    under ``state``."""
    torch.manual_seed(0)
    model = torch_peer.build_model("mlp", (2, 2, 1), 3, hidden_sizes=(4,))
    x = torch.randn(8, 1, 2, 2)
    y = torch.randint(0, 3, (8,))
    peer = torch_peer.Peer(
        model, "fedpac_soap", x, y, [np.arange(4), np.arange(4, 8)], clients_per_round=2,
        local_steps=2, batch_size=2, learning_rate=0.01, aligned=aligned,
    )  # fmt: skip
    peer.run_round()
    opt = peer._optimizer()
    state = next(iter(opt.state.values()))
    want = {"GG", "Q", "count"}
    if aligned == "state":
        want |= {"exp_avg", "exp_avg_sq", "moment_count"}
    assert set(state) == want
    with pytest.raises(ValueError, match="aligned='whole'"):
        torch_peer.Peer(
            model, "fedpac_soap", x, y, [np.arange(8)], clients_per_round=1, local_steps=1,
            batch_size=2, learning_rate=0.01, aligned="whole",
        )  # fmt: skip


# ----------------------------------------------------------------------------- auto choices


def _normal(seed, shape):
    """Float64 standard normal values drawn by NumPy: an eager ``jax.random.normal`` compiles
    a program per shape and dtype (most of the CPU time of the float64 tests below)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float64)


def test_auto_conv_resolves_to_matmul_on_cpu_and_equals_nn_conv():
    assert jax.default_backend() == "cpu"
    assert resolve_conv_impl("auto") == "matmul"
    assert resolve_conv_impl("lax") == "lax"
    with jax.enable_x64(True):
        x = _normal(0, (2, 9, 9, 3))
        auto = conv2d(
            4, (3, 3), strides=(2, 2), padding="SAME", impl="auto", param_dtype=jnp.float64
        )
        plain = nn.Conv(4, (3, 3), strides=(2, 2), padding="SAME", param_dtype=jnp.float64)
        params = fast_jit(plain.init)(jax.random.key(1), x)

        def loss(module):
            return lambda p, x: jnp.sum(jnp.sin(module.apply(p, x)))

        # One program per module: the loss and its gradients, compiled at XLA's level 0
        # (helpers.fast_jit: the same IEEE operations; tolerances 1e4x float64's rounding).
        both = lambda module: fast_jit(jax.value_and_grad(loss(module), (0, 1)))(params, x)  # noqa: E731
        (v_auto, g_auto), (v_plain, g_plain) = both(auto), both(plain)
        np.testing.assert_allclose(v_auto, v_plain, rtol=1e-12)
        for a, b in zip(jax.tree.leaves(g_auto), jax.tree.leaves(g_plain), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_conv_models_default_to_auto_and_match_lax():
    """A small CNN with the default conv_impl: same loss and gradients as nn.Conv (float64)."""
    assert models.get_model("lenet5").module.conv_impl == "auto"
    assert models.get_model("resnet18").module.conv_impl == "auto"
    small = dict(features=(2, 3), dense_sizes=(), num_classes=5)  # the convolutions and logits
    with jax.enable_x64(True):
        x = _normal(0, (2, 8, 8, 3))
        batch = {"x": x, "y": jnp.array([1, 3])}
        default = models.get_model("cnn", **small)
        lax_model = models.get_model("cnn", conv_impl="lax", **small)
        assert default.module.conv_impl == "auto"

        def init(key, x):  # one program: the init and the float64 casts (eager: one per leaf)
            params, state = lax_model.init(key, x)
            return jax.tree.map(lambda p: p.astype(jnp.float64), params), state

        params, state = fast_jit(init)(jax.random.key(1), x)
        value = lambda m: fast_jit(  # level 0: tolerances far above float64's rounding
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
    """(round_fn, server): 4 clients, 2 per round (chunks of 2), lr 0.1, `model.init(key 0)`.

    The algorithms' optim dicts name the same learning rate, 0.1 (RoundConfig refuses a
    different one: the round's learning rate is RoundConfig's)."""
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
    assert fed.resolve_strategy("auto") == "sequential" and fed.resolve_strategy("vmap") == "vmap"
    assert fed.RoundConfig(4, 2, 3, 0.1).strategy == "auto"
    x, data = _toy_federated((6,), 40)
    model = models.get_model("mlp", hidden_sizes=(), num_classes=3)
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
        x, w = _normal(0, (2, 9, 7, 3)), _normal(1, (*kernel, 3, 4))
        dims = ("NHWC", "HWIO", "NHWC")

        def loss(conv):
            return lambda x, w: jnp.sum(
                jnp.sin(conv(x, w, strides, padding, dimension_numbers=dims))
            )

        # XLA's level 0 (helpers.fast_jit): the same sums; 1e-12 is 1e4x float64's rounding.
        theirs = fast_jit(jax.value_and_grad(loss(jax.lax.conv_general_dilated), (0, 1)))(x, w)
        ours = fast_jit(jax.value_and_grad(loss(conv_general_dilated_canonical), (0, 1)))(x, w)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch", [5, 6])
def test_canonical_kernel_gradient_in_batch_chunks_equals_lax_in_float64(batch):
    """The kernel gradient summed over batch chunks (`kernel_grad_chunk`: 2 images of a
    16 x 16 x 80 float64 dy here, 160 KB each) is jax.grad's dW: two full chunks and a remainder
    image (batch 5), three full chunks (batch 6); the chunks run in a scan."""
    assert kernel_grad_chunk(batch, 16 * 16 * 80 * 8, 3 * 3 * 3 * 80 * 8) == 2
    # Float32: the cnn's second layer (64 KB of dy per image, a 200 KB dW): chunks of 5; a
    # 3x3 512 -> 512 layer on 4x4 images (32 KB per image, a 9.4 MB dW): one call.
    assert kernel_grad_chunk(50, 16 * 16 * 64 * 4, 5 * 5 * 32 * 64 * 4) == 5
    assert kernel_grad_chunk(50, 4 * 4 * 512 * 4, 3 * 3 * 512 * 512 * 4) == 50
    assert kernel_grad_chunk(3, 1, 1) == 3 and kernel_grad_chunk(3, 10**9, 1) == 1
    with jax.enable_x64(True):
        x, w = _normal(0, (batch, 16, 16, 3)), _normal(1, (3, 3, 3, 80))
        dims = ("NHWC", "HWIO", "NHWC")

        def loss(conv):
            return lambda x, w: jnp.sum(jnp.sin(conv(x, w, (1, 1), "SAME", dimension_numbers=dims)))

        grad = jax.grad(loss(conv_general_dilated_canonical), 1)
        scans = [
            e for e in equations(jax.make_jaxpr(grad)(x, w).jaxpr) if e.primitive.name == "scan"
        ]
        assert [e.params["length"] for e in scans] == [batch // 2], scans
        # XLA's level 0 (helpers.fast_jit): 1e-12 is 1e4x float64's rounding of these sums.
        theirs = fast_jit(jax.grad(loss(jax.lax.conv_general_dilated), 1))(x, w)
        np.testing.assert_allclose(fast_jit(grad)(x, w), theirs, rtol=1e-12, atol=1e-12)


def test_the_benchs_kernel_gradient_rows_time_the_same_gradient_both_ways():
    """`python -m experiments.bench round --micro` times the canonical kernel gradient in one
    convolution and in the backward pass's batch chunks (4 images of an 80 KB dy and a
    remainder image here); both are the float64 NumPy sum of x_pad[b, p + i, q + j, c] ·
    dy[b, p, q, o] at float32 rounding."""
    from experiments.bench.sections import kernel_grad_chunks

    (row,) = kernel_grad_chunks(((5, 16, 4, 80, 3, 1),), repeats=1, keep_values=True)
    assert row["chunk"] == 4 and row["shape"] == [5, 16, 16, 4, 80, 3, 1]
    assert row["one_call_ms"] > 0 and row["chunks_ms"] > 0
    x = np.asarray(jax.random.normal(jax.random.key(3), (5, 16, 16, 4)), np.float64)
    dy = np.asarray(jax.random.normal(jax.random.key(4), (5, 16, 16, 80)), np.float64)
    x_pad = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    expected = np.stack(
        [
            np.stack(
                [np.einsum("bpqc,bpqo->co", x_pad[:, i : i + 16, j : j + 16], dy) for j in range(3)]
            )
            for i in range(3)
        ]
    )
    # Float32 sums of 1,280 products of entries up to |132|: 1.3e-4 and 1.8e-4 apart here.
    for name in ("one_call", "chunks"):
        np.testing.assert_allclose(row[name], expected, rtol=1e-5, atol=1e-3, err_msg=name)


def _toy_cnn(conv_impl):
    """Two convolutions, the second with 16 input channels (where "canonical" starts), and the
    classifier (every layer adds to each compiled round)."""
    return models.get_model(
        "cnn", features=(16, 4), dense_sizes=(), num_classes=3, conv_impl=conv_impl
    )


def _tiny_cnn():
    """One convolution and the classifier: a convolutional model, so "auto" shards it."""
    return models.get_model("cnn", features=(2,), dense_sizes=(), num_classes=3)


_CNN_ALGORITHMS = {
    "fedavg": ("fedavg", {"name": "sgd", "learning_rate": 0.1}, {}),
    # Hessian-vector products (forward over reverse) at every step; averaged states.
    "fedpac_sophia": (
        "fedpac",
        {"name": "sophia", "learning_rate": 0.1, "update_interval": 1},
        {"beta": 0.5},
    ),
}


@functools.cache
def _cnn_rounds(algorithm_name: str, strategy: str, conv_impl: str) -> dict:
    """Two rounds of `_toy_cnn(conv_impl)` on `_toy_federated`: the resolved strategy, where the
    parameters and data lay, and (params, opt_state, metrics) after each round as NumPy arrays.

    Cached: the tests comparing strategies share each run (one compilation per program)."""
    x, data = _toy_federated((8, 8, 1), 16)
    name, optim, options = _CNN_ALGORITHMS[algorithm_name]
    algorithm = fed.get_algorithm(name, optim, **options)
    round_fn, server = _toy_round(
        _toy_cnn(conv_impl), algorithm, x, strategy=strategy, local_steps=2, batch_size=4
    )
    placed = round_fn.place(data)
    rounds = []
    for _ in range(2):
        server, metrics = round_fn(server, placed)
        rounds.append(jax.tree.map(np.asarray, (server.params, server.opt_state, metrics)))
    return {
        "strategy": round_fn.strategy,
        "params_mesh": getattr(server.params["Dense_0"]["kernel"].sharding, "mesh", None),
        "data_replicated": placed.x_train.sharding.is_fully_replicated,
        "rounds": rounds,
    }


def test_sequential_round_with_canonical_conv_equals_the_vmap_lax_round():
    """The opt-in canonical convolution (sequential clients) gives the rounds of nn.Conv: the
    first layer (1 input channel) runs im2col + dot under "canonical", the second (16 input
    channels) the canonical convolution with its custom VJP."""
    vmap = _cnn_rounds("fedavg", "vmap", "lax")
    canonical = _cnn_rounds("fedavg", "sequential", "canonical")
    for ours, theirs in zip(vmap["rounds"], canonical["rounds"], strict=True):
        _assert_trees_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.cpu_devices
def test_sharded_sophia_round_of_a_conv_model_equals_the_sequential_round():
    """FedPAC_Sophia (forward-over-reverse Hessian products) on the auto/sharded path gives the
    one-device sequential rounds: parameters, averaged optimizer states and metrics."""
    sequential = _cnn_rounds("fedpac_sophia", "sequential", "auto")
    sharded = _cnn_rounds("fedpac_sophia", "auto", "auto")
    assert sharded["strategy"] == "sharded"
    _assert_trees_close(sequential["rounds"], sharded["rounds"], rtol=2e-5, atol=1e-6)


# SOAP refreshing its bases every step; axes longer than 16 (Dense_0's 32 inputs) unrotated: a
# 32 x 32 factor of a 32 x 3 kernel has rank <= 3 and its 29-dimensional null space has no
# preferred basis, so the server's eigh of the averaged factor would pick an arbitrary one.
_SOAP_EVERY_STEP = {
    "name": "soap",
    "learning_rate": 0.1,
    "precondition_frequency": 1,
    "max_precond_dim": 16,
}


# The algorithms whose rounds run host LAPACK: FedPAC_SOAP (the clients' QR/eigh refreshes and
# the server's eigh of the averaged factors), Local SOAP (the clients' refreshes alone) and
# FedMuon's low-rank momentum upload (SVD).
_HOST_LAPACK = {
    "fedpac_soap": ("fedpac", _SOAP_EVERY_STEP, {"beta": 0.5}),
    "local_soap": ("local_soap", _SOAP_EVERY_STEP, {}),
    "fedmuon_svd": ("fedmuon", {"name": "muon", "learning_rate": 0.1}, {"svd_ratio": 0.5}),
}


@pytest.mark.cpu_devices
@pytest.mark.parametrize("case", ["fedpac_soap", "fedmuon_svd"])
def test_host_lapack_rounds_shard_and_equal_the_sequential_round(case):
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
    as any change of summation order does (vmap vs sequential: 0.1).

    Local SOAP's host calls are the client refreshes FedPAC_SOAP's clients make here too; that
    "auto" shards its rounds as well is checked by
    test_auto_shards_host_lapack_rounds_only_with_the_host_call_internals."""
    from fedorth.optim import linalg

    assert linalg.HOST_CALLS_SHARD, "the installed JAX lacks the host-call internals"
    x, data = _toy_federated((8, 8, 1), 16)
    model = _tiny_cnn()
    name, optim, options = _HOST_LAPACK[case]
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


@pytest.mark.cpu_devices
def test_auto_shards_host_lapack_rounds_only_with_the_host_call_internals(monkeypatch):
    """With the internals `linalg`'s host call uses, "auto" shards the host-LAPACK rounds of a
    convolutional model. Where the installed JAX lacks them, `linalg` falls back to
    `jax.pure_callback` (HOST_CALLS_SHARD False), which hangs on sharded CPU rounds: "auto"
    then keeps SOAP states and low-rank compression on one device, and "sharded" is refused,
    while FedPAC_Sophia (no host LAPACK) still shards."""
    from fedorth.optim import linalg

    x, _ = _toy_federated((8, 8, 1), 16)
    model = _tiny_cnn()
    assert linalg.HOST_CALLS_SHARD, "the installed JAX lacks the host-call internals"
    for name, optim, options in _HOST_LAPACK.values():
        algorithm = fed.get_algorithm(name, optim, **options)
        round_fn, _ = _toy_round(model, algorithm, x, strategy="auto", local_steps=1, batch_size=4)
        assert round_fn.strategy == "sharded", name
    monkeypatch.setattr(linalg, "HOST_CALLS_SHARD", False)
    for name, optim, options in _HOST_LAPACK.values():
        algorithm = fed.get_algorithm(name, optim, **options)
        round_fn, _ = _toy_round(model, algorithm, x, strategy="auto", local_steps=1, batch_size=4)
        assert round_fn.strategy == "sequential", name
        with pytest.raises(ValueError, match="run LAPACK on the host"):
            _toy_round(model, algorithm, x, strategy="sharded", local_steps=1, batch_size=4)
    sophia = fed.get_algorithm("fedpac", {"name": "sophia", "learning_rate": 0.1}, beta=0.5)
    round_fn, _ = _toy_round(model, sophia, x, strategy="auto", local_steps=1, batch_size=4)
    assert round_fn.strategy == "sharded"


@pytest.mark.cpu_devices
def test_auto_round_of_a_conv_model_shards_clients_and_equals_the_vmap_lax_round():
    """On CPU with several devices, "auto" lays a convolutional model's clients over the devices
    that divide S (here 2 of the 8 fake ones), each running its clients one at a time with the
    canonical convolution, and reads the federated data (gathered by `sample_batch`) replicated:
    the rounds equal the one-device vmap rounds with nn.Conv."""
    vmap = _cnn_rounds("fedavg", "vmap", "lax")
    auto = _cnn_rounds("fedavg", "auto", "auto")
    assert auto["strategy"] == "sharded"
    assert auto["params_mesh"].shape == {"clients": 2}
    assert auto["data_replicated"]
    for ours, theirs in zip(vmap["rounds"], auto["rounds"], strict=True):
        _assert_trees_close((ours[0], ours[2]), (theirs[0], theirs[2]), rtol=1e-5, atol=1e-6)


def test_canonical_impl_uses_the_canonical_conv_from_16_input_channels():
    """Below CANONICAL_MIN_CHANNELS input channels "canonical" is im2col + dot (no conv op)."""
    from fedorth.models.layers import CANONICAL_MIN_CHANNELS

    assert CANONICAL_MIN_CHANNELS == 16
    model = models.get_model("cnn", features=(16, 8), dense_sizes=(4,), conv_impl="canonical")
    x = jnp.ones((2, 8, 8, 3))
    # The program depends on shapes only: abstract parameters (jax.eval_shape) trace the same
    # jaxpr without the ~40 per-operation compilations of an eager init.
    params, state = jax.eval_shape(model.init, jax.random.key(0), x)
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
    layers.conv_trace_mode("forward")); the rounds equal the vmap rounds of nn.Conv. Explicit
    "canonical" (here on the auto/sharded path) takes the same path."""
    vmap = _cnn_rounds("fedpac_sophia", "vmap", "lax")
    for strategy, conv_impl in (("sequential", "auto"), ("auto", "canonical")):
        other = _cnn_rounds("fedpac_sophia", strategy, conv_impl)
        for ours, theirs in zip(vmap["rounds"], other["rounds"], strict=True):
            _assert_trees_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


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


# ----------------------------------------------------------------------------- budget and output


class _FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class _FakeRunner:
    def __init__(self, clock, seconds):
        self.clock, self.seconds = clock, seconds

    def run(self):
        self.clock.now += self.seconds
        return self.seconds


def test_budget_shares_the_time_left_and_repeats_stop_at_the_share():
    """`--budget-s 30` over 3 cases: the first case gets 10 s; two runners of 1.5 s per round
    (3 s a repeat) fit 3 repeats (9 s; a 4th would end at 12 s), not the 10 asked for. The next
    case gets (30 − 9) / 2 = 10.5 s. A runner slower than its share still runs once."""
    clock = _FakeClock()
    allowance = budget.Budget(30.0, 3, clock=clock)
    deadline = allowance.next_case()
    assert deadline == pytest.approx(110.0)
    runners = [_FakeRunner(clock, 1.5), _FakeRunner(clock, 1.5)]
    times, _ = budget.time_repeats(runners, 10, deadline, clock=clock)
    assert times == [[1.5] * 3, [1.5] * 3]
    assert allowance.next_case() == pytest.approx(109.0 + 10.5)
    times, _ = budget.time_repeats([_FakeRunner(clock, 50.0)], 10, deadline, clock=clock)
    assert times == [[50.0]] and allowance.spent() and allowance.left() == pytest.approx(-29.0)
    assert budget.Budget(None, 3, clock=clock).left() == math.inf


def test_a_spent_budget_runs_no_case_and_says_so(tmp_path):
    path = tmp_path / "round.json"
    argv = ["round", "--quick", "--peers", "none", "--budget-s", "1e-3", "--json", str(path)]
    assert cli.main(["bench", *argv]) == 0
    result = json.loads(path.read_text())
    assert result["rows"] == [] and result["complete"] and result["budget_s"] == 1e-3
    assert result["notes"] == ["mlp_small/fedavg/S=2,K=2,B=8/float32: not run (budget spent)"]


def test_a_run_killed_mid_way_keeps_the_rows_written_so_far(tmp_path):
    """`--budget-s 60 --quick` over six cases, killed as soon as the first case's row is in the
    JSON file: the file (rewritten atomically after every case) parses and holds the rows."""
    path = tmp_path / "round.json"
    command = [
        sys.executable, "-m", "experiments.bench", "round", "--quick", "--peers", "none",
        "--local-steps", "1,2,3,4,5,6", "--budget-s", "60", "--json", str(path),
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    try:
        for _ in range(1200):  # 60 s at most
            if path.exists() and json.loads(path.read_text())["rows"]:
                break
            assert process.poll() is None, "the run ended before writing a row"
            time.sleep(0.05)
        process.kill()
        assert process.wait(timeout=30) != 0, "killed before finishing"
    finally:
        process.kill()
    result = json.loads(path.read_text())
    assert not result["complete"], "the run was cut off"
    assert 1 <= len(result["rows"]) < 6
    for k, row in enumerate(result["rows"], start=1):
        assert (row["local_steps"], row["impl"]) == (k, "fedorth")
        assert row["client_steps_per_s"] == pytest.approx(2 * k / row["round_s"])


def test_each_row_has_its_own_peak_memory():
    """A row's memory is its own round's executable (arguments + outputs − donated +
    temporaries), not the process's peak: the S = 2 round, measured after the bigger S = 8
    round, reads less (a process peak only rises; on the GPU it was the same for every row)."""
    peaks = []
    for s in (8, 2):
        case = workloads.Case("mlp_small", "fedavg", s, 2, 8)
        data, fed_data = workloads.case_data(case)
        runner = cases.make_runner(("fedorth", "sequential", None, 1, None), case, data, fed_data)
        memory = runner.warmup()["memory"]
        assert memory["source"] == "memory_analysis"
        parts = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
        assert memory["peak_bytes"] == parts
        # The data alone (N = 2S clients x 64 examples x 8x8x1 float32) is an argument.
        assert memory["argument"] >= 2 * s * 64 * 64 * 4
        peaks.append(memory["peak_bytes"])
    assert peaks[1] < peaks[0], peaks


def test_targets_summary_ratios():
    """Issue 22's targets from rows of `--preset targets` (ratios of medians, golden values)."""

    def row(impl, workload, round_s, algorithm="fedavg", dtype="float32", batch=50, steps=500):
        images = steps * batch / round_s
        return {"impl": impl, "workload": workload, "algorithm": algorithm, "dtype": dtype,
                "batch_size": batch, "round_s": round_s, "images_per_s": images}  # fmt: skip

    rows = [
        row("fedorth", "resnet18_cifar100", 1.0),
        row("torch", "resnet18_cifar100", 3.5),
        row("fedorth", "resnet18_cifar100", 0.5, dtype="bfloat16"),  # 50,000 img/s
        row("torch_amp", "resnet18_cifar100", 1.0, dtype="bfloat16 autocast", batch=500,
            steps=20),  # 10,000 img/s
        row("fedorth", "vit_tiny", 1.0),
        row("torch", "vit_tiny", 8.0),
        row("fedorth", "resnet18_cifar100", 1.4, algorithm="fedpac_muon"),
    ]  # fmt: skip
    _, summary = presets.format_targets(presets.targets_summary(rows))
    assert [t["value"] for t in summary[:4]] == pytest.approx([3.5, 5.0, 8.0, 1.4])
    assert summary[4]["value"] is None
    assert [t["met"] for t in summary] == [True, True, False, True, None]


def test_targets_preset_names_the_papers_workloads():
    """resnet18_cifar100 and vit_tiny at S = 10, K = 50, B = 50 (FedMuon (Liu et al.) Table 2)."""
    args = rounds.parse_args(["--preset", "targets"])
    assert args.isolate, "the preset runs each row in its own process"
    cases = rounds.make_cases(args)
    fed_cases = [c for c in cases if c.batch_size == 50]
    assert {c.workload_name for c in fed_cases} == {"resnet18_cifar100", "vit_tiny"}
    assert {(c.clients_per_round, c.local_steps) for c in fed_cases} == {(10, 50)}
    assert {c.dtype for c in fed_cases if c.workload_name == "resnet18_cifar100"} == {
        "float32", "bfloat16"
    }  # fmt: skip
    throughput = [c for c in cases if c.batch_size == 500]
    assert [c.impls for c in throughput] == [("torch", "torch_amp")]
    w = workloads.WORKLOADS["resnet18_cifar100"]
    assert (w.input_shape, w.num_classes) == ((32, 32, 3), 100)


@needs_torch
def test_peer_makes_every_tensor_on_its_device_for_every_algorithm():
    """Run under `torch.device("meta")` as the default device, a tensor the peer makes without
    naming a device lands on "meta" and mixing it with the peer's CPU tensors raises, as a CPU
    tensor did on cuda (`SOAP._update_factors`: "found at least two devices, cuda:0 and cpu")."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((32, 1, 4, 4)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, 32))
    for algorithm in torch_peer.ALGORITHMS:
        torch.manual_seed(0)
        model = torch_peer.build_model("mlp", (4, 4, 1), 3, hidden_sizes=(6,))
        peer = torch_peer.Peer(
            model, algorithm, x, y, [np.arange(16), np.arange(16, 32)], clients_per_round=2,
            local_steps=11, batch_size=4, learning_rate=0.01, device="cpu",
        )  # fmt: skip
        with torch.device("meta"):
            for _ in range(2):  # SOAP/Sophia refresh inside, FedPAC's server states
                peer.run_round()
        for value in peer.global_weights.values():
            assert value.device.type == "cpu" and torch.isfinite(value).all(), algorithm


@needs_torch
def test_torch_amp_peer_runs_bfloat16_autocast_in_channels_last():
    """`torch_amp`: the same FedAvg round in channels_last + bfloat16 autocast. The convolutions
    compute in bfloat16 (a forward hook sees their outputs), the weights stay float32, and the
    round's update is the float32 peer's up to bfloat16 rounding: 8 mantissa bits (0.4% per
    value) through five layers and two steps of a random-data CNN measured 5.8% (norm of the
    difference over the norm of the update); bound 10%."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((64, 3, 8, 8)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 64))
    updates = []
    for amp in (False, True):
        torch.manual_seed(0)
        model = torch_peer.build_model("cnn", (8, 8, 3), 10)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        peer = torch_peer.Peer(
            model, "fedavg", x, y, [np.arange(32), np.arange(32, 64)], clients_per_round=2,
            local_steps=2, batch_size=8, learning_rate=0.05, device="cpu", amp=amp,
        )  # fmt: skip
        if amp:
            assert peer.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
        seen = set()
        peer.model.conv2.register_forward_hook(lambda m, i, out, seen=seen: seen.add(out.dtype))
        peer.run_round()
        assert seen == {torch.bfloat16 if amp else torch.float32}
        assert all(v.dtype == torch.float32 for v in peer.global_weights.values())
        updates.append(torch.cat([(peer.global_weights[k] - start[k]).flatten() for k in start]))
    exact, amp = updates
    error = float((amp - exact).norm() / exact.norm())
    assert 0 < error < 0.1, error
