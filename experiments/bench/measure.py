"""Measurements the benchmarks share: synchronized wall time, a reference matmul, compilations,
memory.

`median_seconds` times a call synchronized with ``block_until_ready``; `bench_matmul` gives the
GFLOP/s of a float32 matmul, the yardstick that FLOP/s fractions are read against;
`compile_counter` sums JAX's ``/jax/core/compile/*`` monitoring events; `peak_memory` reads XLA's
memory analysis of one compiled executable, `device_memory` the device's own counters.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def median_seconds(fn: Callable[[], object], *, repeats: int, warmup: int) -> float:
    """Median wall time of `fn()` (synchronized with block_until_ready) after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_matmul(n: int = 2048, *, repeats, warmup) -> float:
    """GFLOP/s of an n×n float32 matmul at HIGHEST precision (2n³ FLOPs)."""
    a, b = jax.random.normal(jax.random.key(2), (2, n, n))
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
    return 2 * n**3 / median_seconds(lambda: mm(a, b), repeats=repeats, warmup=warmup) / 1e9


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
