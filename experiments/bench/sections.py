"""Optional sections of the round benchmark: memory at N clients, XLA:CPU traps, scaling.

``--memory``: persistent per-client state and peak memory per strategy; ``--micro``: the client
mean, convolution-in-a-loop and host ``eigh`` measurements behind the engine's choices;
``--scaling``: the ``sharded`` strategy on 1 and 2 host devices (subprocesses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.measure import median_seconds, peak_memory
from experiments.bench.workloads import WORKLOADS, build_model, make_data
from fedorth import fed
from fedorth.data.federated import make_federated, sample_batch
from fedorth.fed.metrics import tree_bytes
from fedorth.models.layers import (
    canonical_kernel_grad,
    conv_general_dilated_canonical,
    conv_general_dilated_matmul,
    kernel_grad_chunk,
)
from fedorth.optim import federated as fed_optim


def memory_section(*, num_clients: int, clients_per_round: int, quick: bool) -> dict[str, Any]:
    """Persistent per-client state at N clients, and peak memory of a round per strategy.

    FedMuon of FedMuon-LMO (``fedmuon_bc``) keeps ``M_i`` and ``C_i`` for every client; the model is
    LeNet-5 (small; ``mlp_small`` with ``quick``). Peak memory is XLA's memory analysis of the
    compiled round (no run needed except for one vmap round, which proves the N-client state fits
    and runs).
    """
    workload_name = "mlp_small" if quick else "lenet5"
    workload = WORKLOADS[workload_name]
    model = build_model(workload, "auto")
    algorithm = fed.get_algorithm("fedmuon_bc", {"name": "lmo", "learning_rate": 0.01})
    x, y, partition = make_data(workload, num_clients)
    fed_data = make_federated(x, y, x[:8], y[:8], partition, name="bench", num_classes=10)
    params, model_state = model.init(jax.random.key(0), x[:2])
    out: dict[str, Any] = {
        "algorithm": "fedmuon_bc",
        "workload": workload_name,
        "num_clients": num_clients,
        "clients_per_round": clients_per_round,
        "num_params": sum(leaf.size for leaf in jax.tree.leaves(params)),
    }
    batch_size = 8 if quick else 32
    strategies = [
        ("vmap", None),
        ("chunked", max(1, clients_per_round // 10)),
        ("sequential", None),
    ]
    for strategy, chunk in strategies:
        server = fed.init_server(
            algorithm, params, model_state, num_clients=num_clients, key=jax.random.key(1)
        )
        out["persistent_bytes_per_client"] = tree_bytes(server.clients) // num_clients
        out["persistent_bytes_total"] = tree_bytes(server.clients)
        config = fed.RoundConfig(
            num_clients=num_clients,
            clients_per_round=clients_per_round,
            local_steps=2,
            learning_rate=0.01,
            strategy=strategy,
            chunk_size=chunk,
        )
        round_fn = fed.make_round_fn(
            algorithm,
            model.loss_fn,
            lambda d, c, k: sample_batch(d, c, k, batch_size),
            config,
            params=params,
        )
        start = time.perf_counter()
        compiled = round_fn.lower(server, fed_data).compile()
        label = strategy if chunk is None else f"chunked({chunk})"
        entry = {"compile_s": time.perf_counter() - start, **peak_memory(compiled)}
        if strategy == "vmap":
            start = time.perf_counter()
            server, metrics = round_fn(server, fed_data)
            jax.block_until_ready(server)
            entry["round_s"] = time.perf_counter() - start
            entry["train_loss_finite"] = bool(np.isfinite(float(metrics["train_loss"])))
        out[label] = entry
    return out


def _median_ms(fn, *args, repeats: int) -> float:
    """Median ms of the jitted `fn(*args)` after one warm-up call (`measure.median_seconds`)."""
    fn = jax.jit(fn)
    return 1e3 * median_seconds(lambda: fn(*args), repeats=repeats, warmup=1)


def micro_section(*, repeats: int, quick: bool) -> dict[str, Any]:
    """The XLA:CPU traps behind the engine's choices, each against its replacement.

    * client mean ``[S, P] -> [P]``: ``jnp.mean(x, axis=0)`` vs ``mean_over_clients``;
    * one SGD step of a 5×5 convolution (the CNN's second layer: 50×16×16×32 → 64) alone and
      inside a 3-iteration ``fori_loop``, per implementation (ms per step);
    * the canonical convolution's kernel gradient in one call and in batch chunks
      (``kernel_grad_chunks``);
    * two host ``eigh`` in turn and side by side (``host_eigh_pairs``).
    """
    clients, size = (4, 100_000) if quick else (10, 4_000_000)
    x = jax.random.normal(jax.random.key(0), (clients, size))
    out: dict[str, Any] = {
        "client_mean_shape": [clients, size],
        "client_mean_ms": {
            "jnp.mean(axis=0)": _median_ms(lambda x: jnp.mean(x, axis=0), x, repeats=repeats),
            "mean_over_clients": _median_ms(fed_optim.mean_over_clients, x, repeats=repeats),
        },
    }
    batch, side, c_in, c_out = (4, 8, 4, 8) if quick else (50, 16, 32, 64)
    images = jax.random.normal(jax.random.key(1), (batch, side, side, c_in))
    kernel = jax.random.normal(jax.random.key(2), (5, 5, c_in, c_out))
    conv_ms = {}
    for impl in ("lax", "matmul", "canonical"):
        conv = {
            "lax": jax.lax.conv_general_dilated,
            "matmul": conv_general_dilated_matmul,
            "canonical": conv_general_dilated_canonical,
        }[impl]

        def step(w, x, conv=conv):
            grad = jax.grad(
                lambda w: jnp.sum(
                    conv(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) ** 2
                )
            )(w)
            return w - 1e-6 * grad

        def loop(w, x, step=step):
            return jax.lax.fori_loop(0, 3, lambda i, w: step(w, x * (1.0 + i)), w)

        conv_ms[impl] = {
            "alone": _median_ms(step, kernel, images, repeats=repeats),
            "in_loop_per_step": _median_ms(loop, kernel, images, repeats=max(1, repeats // 2)) / 3,
        }
    out["conv_step_shape"] = [batch, side, side, c_in, c_out]
    out["conv_step_ms"] = conv_ms
    out["kernel_grad_chunks"] = kernel_grad_chunks(
        KERNEL_GRAD_SHAPES_QUICK if quick else KERNEL_GRAD_SHAPES, repeats
    )
    out["host_eigh_pairs"] = host_eigh_pairs((64, 128) if quick else HOST_EIGH_SIZES, repeats)
    return out


# (batch, side, in, out, kernel, stride): the cnn's second layer, ResNet-18's first stage at
# width 0.25 and 1, its second and last stages at width 1.
KERNEL_GRAD_SHAPES = (
    (50, 16, 32, 64, 5, 1),
    (50, 32, 16, 16, 3, 1),
    (50, 32, 64, 64, 3, 1),
    (50, 16, 128, 128, 3, 1),
    (50, 4, 512, 512, 3, 1),
)
KERNEL_GRAD_SHAPES_QUICK = ((5, 8, 4, 8, 3, 1),)


def kernel_grad_chunks(shapes, repeats: int, keep_values: bool = False) -> list[dict[str, Any]]:
    """The canonical convolution's kernel gradient (`fedorth.models.layers.canonical_kernel_grad`)
    in one convolution over the batch against the backward pass's batch chunks
    (`kernel_grad_chunk`), inside a 3-iteration `fori_loop` as in the local steps; ms per call,
    the median of `repeats`. `keep_values`: each row also holds both gradients (for tests)."""
    rows = []
    for batch, side, c_in, c_out, k, s in shapes:
        x = jax.random.normal(jax.random.key(3), (batch, side, side, c_in))
        out_side = -(-side // s)
        dy = jax.random.normal(jax.random.key(4), (batch, out_side, out_side, c_out))
        w = jnp.zeros((k, k, c_in, c_out))
        pads = tuple(
            tuple(p) for p in jax.lax.padtype_to_pads((side, side), (k, k), (s, s), "SAME")
        )
        chunk = kernel_grad_chunk(batch, dy[0].size * dy.dtype.itemsize, w.size * w.dtype.itemsize)
        row: dict[str, Any] = {"shape": [batch, side, side, c_in, c_out, k, s], "chunk": chunk}
        for name, n in (("one_call", batch), ("chunks", chunk)):

            def grad(x, dy, n=n):
                return canonical_kernel_grad(x, dy, w, (s, s), pads, chunk=n)

            def loop(x, dy, grad=grad):
                body = lambda i, total: total + grad(x * (1.0 + i), dy)  # noqa: E731
                return jax.lax.fori_loop(0, 3, body, jnp.zeros_like(w))

            row[f"{name}_ms"] = _median_ms(loop, x, dy, repeats=max(1, repeats)) / 3
            if keep_values:
                row[name] = np.asarray(jax.jit(grad)(x, dy))
        row["one_call_over_chunks"] = row["one_call_ms"] / row["chunks_ms"]
        rows.append(row)
    return rows


HOST_EIGH_SIZES = (512, 1024, 2048, 3072, 4096)


def _spd(n: int, seed: int) -> np.ndarray:
    """A float32 SOAP-like factor: a Gram matrix of n/8 directions plus a spread diagonal."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((n, max(1, n // 8))).astype(np.float32)
    m = g @ g.T / g.shape[1] + np.diag(rng.random(n, dtype=np.float32))
    return (m + m.T) / 2  # exactly symmetric


def host_eigh_pairs(sizes, repeats: int, keep_values: bool = False) -> list[dict[str, Any]]:
    """Two host ``eigh`` (SciPy float32 ``ssyevd``, as ``fedorth.optim.linalg``) of n x n:
    one after the other with every core's OpenBLAS thread each (a ``sequential`` round's calls)
    against side by side, one thread each (a ``sharded`` round's, one per device), per n; the
    faster of ``repeats`` tries each. ``fed.strategy="auto"`` keeps rounds whose local state
    factorizes matrices from ``fed.execution.SEQUENTIAL_HOST_MATRIX`` on one device by these.
    ``keep_values``: each row also holds the eigenvalues both ways computed (for tests)."""
    import scipy.linalg
    from threadpoolctl import threadpool_limits

    cores = len(os.sched_getaffinity(0))

    def eigh(m, out, i):
        out[i] = scipy.linalg.eigh(m, driver="evd", check_finite=False)[0]

    rows = []
    for n in sizes:
        pair = [_spd(n, 0), _spd(n, 1)]
        in_turn, side_by_side = [], []
        values = [None, None]
        for _ in range(max(1, repeats)):
            with threadpool_limits(cores, user_api="blas"):
                start = time.perf_counter()
                for i, m in enumerate(pair):
                    eigh(m, values, i)
                in_turn.append(time.perf_counter() - start)
            together = [None, None]
            with threadpool_limits(1, user_api="blas"):
                threads = [
                    threading.Thread(target=eigh, args=(m, together, i)) for i, m in enumerate(pair)
                ]
                start = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                side_by_side.append(time.perf_counter() - start)
        rows.append(
            {
                "n": n,
                "threads_in_turn": cores,
                "in_turn_s": min(in_turn),
                "side_by_side_s": min(side_by_side),
                "side_by_side_over_in_turn": min(side_by_side) / min(in_turn),
                **({"matrices": pair, "eigenvalues": (values, together)} if keep_values else {}),
            }
        )
    return rows


def cpu_devices_env(devices: int, environ=None) -> dict[str, str]:
    """A copy of the environment under which a child JAX process has ``devices`` CPU devices.

    ``JAX_NUM_CPU_DEVICES`` wins over ``XLA_FLAGS``' ``--xla_force_host_platform_device_count``
    (jax 0.10), and ``python -m experiments.*`` sets the former: set it, drop the latter.
    """
    env = dict(os.environ if environ is None else environ)
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(
        f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
    )
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def scaling_section(args) -> dict[str, Any]:
    """`sharded` with 1 and 2 host devices, each in a subprocess (device count set before import).

    `JAX_NUM_CPU_DEVICES` overrides `XLA_FLAGS`' forced count, and this process has it set
    (`experiments/__init__.py`), so the children get it explicitly and the forced count is
    dropped; each child's JSON header must report the asked-for count (a child that inherited the
    parent's count would compare 2 devices with 2).
    """
    out = {}
    for devices in (1, 2):
        env = cpu_devices_env(devices)
        path = f"/tmp/fedorth_bench_scaling_{os.getpid()}_{devices}.json"
        clients = max(2, args.clients[0] - args.clients[0] % 2)
        command = [
            sys.executable, "-m", "experiments.bench", "round",
            "--workloads", args.workloads[0], "--algorithms", "fedavg",
            "--clients", str(clients), "--local-steps", str(args.local_steps[0]),
            "--batch-size", str(args.batch_size), "--strategies", "sharded",
            "--conv-impls", args.conv_impls[-1], "--unrolls", str(args.unrolls[-1]),
            "--peers", "none", "--repeats", str(args.repeats), "--json", path,
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        with open(path) as f:
            child = json.load(f)
        os.remove(path)
        if child["device_count"] != devices:
            raise RuntimeError(f"scaling: asked for {devices} devices, got {child['device']}")
        row = child["rows"][0]
        out[f"{devices}_devices"] = {
            key: row[key] for key in ("client_steps_per_s", "round_s", "compile_s")
        }
    out["speedup_2_over_1"] = (
        out["2_devices"]["client_steps_per_s"] / out["1_devices"]["client_steps_per_s"]
    )
    out["workload"], out["algorithm"] = args.workloads[0], "fedavg"
    return out
