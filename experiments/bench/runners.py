"""Two of the implementations the round benchmark times: fedorth's round and the PyTorch peer
(the third, the JAX per-step loop, is experiments/bench/jax_loop.py).

Each runner builds its round for a `Case`, and has ``warmup() -> dict`` (the first round, with
compile time and what else it measures), ``run() -> seconds`` (one synchronized round) and
``finish() -> dict``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.flops import model_step_flops, muon_flops
from experiments.bench.measure import compile_counter, cpu_threads, peak_memory
from experiments.bench.workloads import FEDPAC_BETA, Case, build_model
from fedorth import fed
from fedorth.fed.execution import client_conv_trace_mode
from fedorth.fed.metrics import tree_bytes
from fedorth.models.layers import resolve_conv_impl
from fedorth.optim import linalg

# The PyTorch peer's module in this checkout (benchmarks/ is not a package).
TORCH_PEER = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "torch_peer.py"


def lapack_seconds(per_round: list[float]) -> dict[str, Any]:
    """``lapack_s``: the median seconds per timed round spent in SOAP's ``eigh``/``qr`` (and any
    other dense decomposition): fedorth's host LAPACK calls (``linalg.host_seconds``), the
    peer's ``torch.linalg`` calls; absent when a round makes none."""
    if not per_round or not any(per_round):
        return {}
    return {"lapack_s": statistics.median(per_round), "lapack_s_all": list(per_round)}


class FedorthRunner:
    """One jitted round per call (``fed.make_round_fn``)."""

    kind = "fedorth"

    def __init__(
        self, case: Case, data, fed_data, *, strategy, conv_impl, unroll, lapack_threads=None
    ):
        self.case, self.fed_data = case, fed_data
        self.conv_impl = conv_impl
        self.lapack_s: list[float] = []  # host LAPACK seconds of each timed round
        # FEDORTH_LAPACK_THREADS while the round is lowered (None: the environment's); the
        # host calls keep the count they were lowered with (fedorth.optim.linalg).
        self.lapack_threads = lapack_threads
        s = case.clients_per_round
        self.model = build_model(case.workload, self.conv_impl, case.dtype)
        self.algorithm = case.fed_algorithm()
        config = fed.RoundConfig(
            num_clients=case.num_clients,
            clients_per_round=s,
            local_steps=case.local_steps,
            learning_rate=case.optim["learning_rate"],
            strategy=strategy,
            # Only for "chunked": "auto" on an accelerator also times "chunked" when it is set.
            chunk_size=max(1, s // 2) if strategy == "chunked" else None,
            unroll=unroll,
        )
        x = data[0]
        self.params, model_state = self.model.init(jax.random.key(0), x[:2])
        self.round_fn = fed.make_round_fn(
            self.algorithm, self.model.loss_fn, case.batch_fn, config, params=self.params
        )
        self.asked = {"strategy": strategy, "conv_impl": conv_impl, "unroll": unroll}
        self.settings = self._settings()
        # A sharded round reads its server state and data replicated on its mesh: placed once.
        self.fed_data = self.round_fn.place(fed_data)
        self.server = self.round_fn.place(
            fed.init_server(
                self.algorithm,
                self.params,
                model_state,
                num_clients=case.num_clients,
                key=jax.random.key(1),
            )
        )
        self.example_batch = {
            "x": fed_data.x_train[: case.batch_size],
            "y": fed_data.y_train[: case.batch_size],
        }
        self.model_state = model_state

    def _settings(self) -> dict[str, Any]:
        """The asked-for strategy and convolution, with what they resolved to ("auto→vmap")."""
        strategy, conv_impl = self.asked["strategy"], self.asked["conv_impl"]
        resolved = self.round_fn.strategy  # "auto" resolved for this model (on an accelerator:
        # "auto" until the first round has timed the candidates)
        # The convolution the round's gradients use (in the mode the engine traces clients in).
        if conv_impl is not None:
            used = resolve_conv_impl(conv_impl, client_conv_trace_mode(self.round_fn.config))
            if used != conv_impl:
                conv_impl = f"{conv_impl}→{used}"
        if resolved != strategy:
            strategy = f"{strategy}→{resolved}"
        threads = self.lapack_threads or os.environ.get(linalg.THREADS_ENV, "auto")
        return {
            "strategy": strategy,
            "conv_impl": conv_impl,
            "unroll": self.asked["unroll"],
            "lapack_threads": threads,
        }

    @contextlib.contextmanager
    def _lowering_env(self):
        """``FEDORTH_LAPACK_THREADS`` set to the row's count while its round is lowered."""
        before = os.environ.get(linalg.THREADS_ENV)
        if self.lapack_threads is not None:
            os.environ[linalg.THREADS_ENV] = self.lapack_threads
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(linalg.THREADS_ENV, None)
            else:
                os.environ[linalg.THREADS_ENV] = before

    def warmup(self) -> dict[str, Any]:
        count0, seconds0 = compile_counter()
        before = jax.tree.leaves(self.server.params)
        start = time.perf_counter()
        with self._lowering_env():
            self.server, _ = self.round_fn(self.server, self.fed_data)
            jax.block_until_ready(self.server)
        first = time.perf_counter() - start
        count1, seconds1 = compile_counter()
        self.settings = self._settings()  # after a measured "auto" has chosen
        selection = getattr(self.round_fn, "selection", None)
        compiled = self.round_fn.lower(self.server, self.fed_data).compile()  # cached
        flops = model_step_flops(
            self.model.loss_fn, self.params, self.model_state, self.example_batch, jax.random.key(2)
        )
        if self.case.optim["name"] == "muon":
            flops += muon_flops(self.params)
        s, k = self.case.clients_per_round, self.case.local_steps
        clients = self.server.clients
        self._cache_size = self.round_fn._cache_size()
        return {
            "first_round_s": first,
            "compile_s": seconds1 - seconds0,
            "compilations": count1 - count0,
            "memory": peak_memory(compiled),
            "donated": all(leaf.is_deleted() for leaf in before),
            "server_state_bytes": tree_bytes(self.server.replace(key=jnp.zeros([], jnp.uint32))),
            "persistent_bytes_per_client": (
                tree_bytes(clients) // self.case.num_clients if clients is not None else 0
            ),
            "flops_per_round": flops * s * k,
            "num_params": sum(leaf.size for leaf in jax.tree.leaves(self.params)),
            # "auto" on an accelerator: each candidate's compile and round times (its first
            # round, above, includes them).
            **({"strategy_selection": selection} if selection is not None else {}),
        }

    def run(self) -> float:
        host = linalg.host_seconds()
        start = time.perf_counter()
        self.server, _ = self.round_fn(self.server, self.fed_data)
        jax.block_until_ready(self.server)
        elapsed = time.perf_counter() - start
        self.lapack_s.append(linalg.host_seconds() - host)
        return elapsed

    def finish(self) -> dict[str, Any]:
        # Entries added to the jitted round's cache after round 1: 0 means no recompilation.
        return {
            "recompiles": self.round_fn._cache_size() - self._cache_size,
            **lapack_seconds(self.lapack_s),
        }


class TorchRunner:
    """The PyTorch peer (benchmarks/torch_peer.py); ``amp``: the ``torch_amp`` peer
    (channels_last + bfloat16 autocast, what a performance-minded PyTorch user writes)."""

    def __init__(self, case: Case, data, *, amp: bool = False):
        import torch

        self.kind = "torch_amp" if amp else "torch"
        peer_lib = self.peer_lib = load_torch_peer()
        self.lapack_s: list[float] = []
        torch.set_num_threads(cpu_threads())
        self.device = torch_device()
        where = "" if self.device == "cpu" else f" ({self.device})"
        self.settings = {"strategy": "python loop" + where, "conv_impl": "torch", "unroll": "-"}
        self.dtype = "bfloat16 autocast" if amp else "float32"
        x, y, partition = data
        workload = case.workload
        torch.manual_seed(0)
        model = peer_lib.build_model(
            workload.model, workload.input_shape, workload.num_classes, **dict(workload.kwargs)
        )
        self.num_params = sum(p.numel() for p in model.parameters())
        self.peer = peer_lib.Peer(
            model,
            case.algorithm,
            torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))),
            torch.from_numpy(y.astype(np.int64)),
            partition,
            clients_per_round=case.clients_per_round,
            local_steps=case.local_steps,
            batch_size=case.batch_size,
            learning_rate=case.optim["learning_rate"],
            beta=FEDPAC_BETA,
            aligned=case.aligned,
            device=self.device,
            amp=amp,
        )
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def run(self) -> float:
        import torch

        # torch_amp also lets cuDNN pick its convolution algorithms (cudnn.benchmark), as a
        # performance-minded user does; set per round, since both peers may share a process.
        torch.backends.cudnn.benchmark = self.kind == "torch_amp"
        self.peer.synchronize()
        linalg_s = self.peer_lib.LINALG_SECONDS[0]
        start = time.perf_counter()
        self.peer.run_round()
        self.peer.synchronize()
        elapsed = time.perf_counter() - start
        self.lapack_s.append(self.peer_lib.LINALG_SECONDS[0] - linalg_s)
        return elapsed

    def warmup(self) -> dict[str, Any]:
        first = self.run()
        self.lapack_s.clear()  # the timed rounds' only
        return {"first_round_s": first, "num_params": self.num_params}

    def finish(self) -> dict[str, Any]:
        out = lapack_seconds(self.lapack_s)
        if self.device != "cuda":
            return out
        import torch

        # The peer's own peak (reset when it was built): torch's caching allocator counts it.
        peak = int(torch.cuda.max_memory_allocated())
        return {**out, "memory": {"source": "torch.cuda.max_memory_allocated", "peak_bytes": peak}}


def torch_device() -> str:
    """``"cuda"`` when JAX runs on a GPU and torch sees one (the peer then shares it), else CPU."""
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def load_torch_peer():
    """benchmarks/torch_peer.py of this checkout, imported by path (it is not a package)."""
    if "benchmarks.torch_peer" in sys.modules:
        return sys.modules["benchmarks.torch_peer"]
    spec = importlib.util.spec_from_file_location("benchmarks.torch_peer", TORCH_PEER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def torch_available() -> str | None:
    """None if torch imports, else the reason."""
    try:
        import torch  # noqa: F401
    except ImportError as err:
        return f"torch not installed ({err}); pip install torch (the 'bench' extra)"
    return None
