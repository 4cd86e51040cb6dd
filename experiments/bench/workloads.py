"""Shared pieces of the round benchmark: workloads, algorithms, cases and measurements.

Used by experiments/bench_round.py (the ``round`` subcommand of experiments.bench) and its
runners and sections; see that module for what is measured and how.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from typing import Any

import jax
import jax.extend.core as jax_core
import numpy as np

from fedorth import models
from fedorth.data.federated import sample_batch
from fedorth.optim.newton_schulz import newton_schulz_flops


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model on random inputs: ``models.get_model(model, num_classes=..., **kwargs)``."""

    model: str
    input_shape: tuple[int, int, int]
    num_classes: int
    kwargs: tuple[tuple[str, Any], ...] = ()
    conv: bool = False


WORKLOADS: dict[str, Workload] = {
    # Wide enough to be matmul-bound (FedAvg's 2NN, (200, 200), is overhead-bound at B = 50).
    "mlp": Workload("mlp", (32, 32, 3), 10, (("hidden_sizes", (1024, 1024)),)),
    "lenet5": Workload("lenet5", (28, 28, 1), 10, conv=True),
    "cnn": Workload("cnn", (32, 32, 3), 10, conv=True),
    "vit_tiny": Workload("vit_tiny", (32, 32, 3), 100),
    # Reduced width (16-32-64-128 channels) so that a CPU round takes seconds.
    "resnet18": Workload("resnet18", (32, 32, 3), 10, (("width", 0.25),), conv=True),
    # The papers' scale: FedMuon (Liu et al.) Table 2 trains the full-width ResNet-18 and ViT-Tiny
    # (vit_tiny above, 100 classes) on CIFAR-100 (100 clients, 10% participation, batch 50,
    # K = 50); `--preset targets` runs them at S = 10, K = 50, B = 50.
    "resnet18_cifar100": Workload("resnet18", (32, 32, 3), 100, (("width", 1.0),), conv=True),
    # The smoke-test workload of --quick.
    "mlp_small": Workload("mlp", (8, 8, 1), 10, (("hidden_sizes", (32,)),)),
}

# fedorth algorithm -> local optimizer config (hyperparameters as in the presets' defaults).
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {"name": "sgd", "learning_rate": 0.05},
    "fedpac_muon": {"name": "muon", "learning_rate": 0.02},
    "fedpac_soap": {"name": "soap", "learning_rate": 0.003},
    "fedpac_sophia": {"name": "sophia", "learning_rate": 0.05},
}
FEDPAC_BETA = 0.5  # fedorth.fed.algorithms.fedpac default; the torch peer uses the same
EXAMPLES_PER_CLIENT = 64
PEERS = ("torch", "torch_amp", "jax_loop")
DTYPES = ("float32", "bfloat16")

# libgomp's default active spin-waiting makes torch collapse when the cores are shared (measured
# on the 2-core machine: 4 instead of 37 CNN steps/s with 2 threads); passive waiting gives torch
# its best numbers. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_COMPILES = {"count": 0, "seconds": 0.0}


def _on_event(name: str, seconds: float, **kwargs) -> None:
    if name.startswith("/jax/core/compile/"):
        _COMPILES["seconds"] += seconds
        if name.endswith("backend_compile_duration"):
            _COMPILES["count"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_counter() -> tuple[int, float]:
    """(XLA compilations so far, seconds spent tracing, lowering and compiling so far)."""
    return _COMPILES["count"], _COMPILES["seconds"]


def cpu_threads() -> int:
    """The cores this process may run on (what XLA:CPU's thread pool and torch should use)."""
    return len(os.sched_getaffinity(0))


def cost_flops(compiled) -> float:
    """``flops`` of XLA's cost analysis of a compiled executable (loop bodies count once)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0]
    return float(cost.get("flops", 0.0))


def step_flops(loss_fn, params, model_state, batch, key) -> float:
    """FLOPs of one forward + backward pass, from XLA's cost analysis of the jitted gradient."""
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    return cost_flops(grad_fn.lower(params, model_state, batch, key).compile())


def _conv_macs(eqn) -> int:
    """Multiply-adds of one ``conv_general_dilated``: every output element sums (rhs input
    features) × (kernel taps) products, padded borders included (as im2col's dot computes them)."""
    rhs = eqn.invars[1].aval
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
    taps = math.prod(rhs.shape[d] for d in spec[2:])
    return math.prod(eqn.outvars[0].aval.shape) * rhs.shape[spec[1]] * taps


def _dot_macs(eqn) -> int:
    lhs = eqn.invars[0].aval
    (contract, _), _ = eqn.params["dimension_numbers"]
    return math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in contract)


def _sub_jaxprs(value):
    if isinstance(value, jax_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax_core.Jaxpr):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _sub_jaxprs(item)


def jaxpr_flops(jaxpr) -> int:
    """2 × the multiply-adds of every ``dot_general`` and ``conv_general_dilated`` in `jaxpr`.

    Sub-jaxprs are entered: calls (jit; custom_jvp/custom_vjp calls: their primal computation),
    ``scan`` bodies times their length, ``cond`` the costliest branch, ``while`` bodies once
    (trip count unknown).
    Elementwise work is not counted (the matmul/convolution convention of model FLOPs).
    """
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += 2 * _dot_macs(eqn)
        elif name == "conv_general_dilated":
            total += 2 * _conv_macs(eqn)
        elif name == "cond":
            total += max(jaxpr_flops(b.jaxpr) for b in eqn.params["branches"])
        else:
            inner = sum(jaxpr_flops(j) for v in eqn.params.values() for j in _sub_jaxprs(v))
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


def model_step_flops(loss_fn, params, model_state, batch, key) -> int:
    """Model FLOPs of one local step: 3 × the forward pass's (`jaxpr_flops` of the loss).

    The convention of model-FLOP utilization: the backward pass costs twice the forward (the
    gradients w.r.t. a layer's inputs and its weights, one product each), whatever runs it.
    Counted on the loss's jaxpr, so every convolution counts the same whether XLA runs it as a
    convolution (which XLA:GPU's cost analysis does not count: cuDNN calls), as im2col + dot, or
    as the canonical convolution's custom VJP (its primal computation is entered). The first
    layer's input gradient, which no step computes, is included (< 1% on the bench models).
    `step_flops` (XLA's own count of the gradient) is kept for dense checks.
    """
    return 3 * jaxpr_flops(jax.make_jaxpr(loss_fn)(params, model_state, batch, key).jaxpr)


def muon_flops(params, ns_steps: int = 5) -> int:
    """Newton–Schulz FLOPs of one Muon update: every leaf of rank >= 2 as (prod(lead), last)."""
    total = 0
    for leaf in jax.tree.leaves(params):
        if leaf.ndim >= 2:
            total += newton_schulz_flops((math.prod(leaf.shape[:-1]), leaf.shape[-1]), ns_steps)
    return total


def peak_memory(compiled) -> dict[str, int]:
    """The compiled round's own peak: XLA's memory analysis of that executable.

    arguments + outputs − aliased (donated) + temporaries: what the round needs on the device,
    whatever ran before it in the process, on every platform (XLA:CPU and XLA:GPU both report it).
    `device_memory()` gives the process's counters where the device keeps them; with
    ``--isolate`` each row runs in its own process, and its row records that process's peak too.
    """
    mem = compiled.memory_analysis()
    out: dict[str, Any] = {
        name: int(getattr(mem, f"{name}_size_in_bytes"))
        for name in ("argument", "output", "alias", "temp")
    }
    out["peak_bytes"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["source"] = "memory_analysis"
    return out


def device_memory() -> dict[str, int] | None:
    """The first device's ``memory_stats`` (GPU/TPU: bytes and peak bytes in use), else None."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return {key: int(stats[key]) for key in ("bytes_in_use", "peak_bytes_in_use") if key in stats}


def make_data(workload: Workload, num_clients: int, *, seed: int = 0):
    """Random inputs ``[M, H, W, C]`` (float32), labels ``[M]``, an even partition."""
    rng = np.random.default_rng(seed)
    total = num_clients * EXAMPLES_PER_CLIENT
    x = rng.standard_normal((total, *workload.input_shape)).astype(np.float32)
    y = rng.integers(0, workload.num_classes, total).astype(np.int32)
    partition = np.split(rng.permutation(total), num_clients)
    return x, y, partition


def build_model(workload: Workload, conv_impl: str | None, dtype: str = "float32") -> models.Model:
    """The workload's model; `dtype` is the computation dtype (``model.dtype``), passed to the
    model factory's ``dtype`` argument when it is not float32."""
    kwargs = dict(workload.kwargs)
    if workload.conv and conv_impl is not None:
        kwargs["conv_impl"] = conv_impl
    if dtype != "float32":
        factory = models.MODELS[workload.model]
        if "dtype" not in inspect.signature(factory).parameters:
            raise ValueError(f"model {workload.model!r} has no dtype argument (model.dtype).")
        kwargs["dtype"] = dtype
    return models.get_model(workload.model, num_classes=workload.num_classes, **kwargs)


@dataclasses.dataclass
class Case:
    """What every implementation of one row group runs."""

    workload_name: str
    algorithm: str
    clients_per_round: int
    local_steps: int
    batch_size: int
    dtype: str = "float32"
    # What runs this case: "fedorth" (one row per strategy × conv_impl × unroll asked for) and
    # peers ("torch", "torch_amp", "jax_loop"); None: fedorth and the --peers.
    impls: tuple[str, ...] | None = None

    @property
    def workload(self) -> Workload:
        return WORKLOADS[self.workload_name]

    @property
    def label(self) -> str:
        """``workload/algorithm/S=..,K=..,B=../dtype`` (notes and messages)."""
        return (
            f"{self.workload_name}/{self.algorithm}/S={self.clients_per_round},"
            f"K={self.local_steps},B={self.batch_size}/{self.dtype}"
        )

    @property
    def num_clients(self) -> int:
        return 2 * self.clients_per_round

    @property
    def optim(self) -> dict[str, Any]:
        return ALGORITHMS[self.algorithm]

    def batch_fn(self, data, client, key):
        return sample_batch(data, client, key, self.batch_size)
