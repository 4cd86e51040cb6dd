"""How a sweep's replicas run (``--replica_strategy``), and what ``"auto"`` chooses.

Like the clients' ``fed.strategy``, the replica strategy changes how a round runs, never its
results beyond float32 rounding:

* ``"sequential"``: one compiled round, called once per replica;
* ``"vmap"``: the round vmapped over chunks of replicas.

``"auto"`` follows the clients' rule (``fedorth.fed.autotune``). On CPU it is
``"sequential"``: XLA:CPU already runs one replica's products on every core, and vmapped
convolutions become grouped convolutions, which it runs slowly (docs/PERFORMANCE.md). On an
accelerator no rule picks the faster one for every model (one run of a small model leaves a GPU
idle, while vmapped convolutions with per-replica weights become grouped convolutions), so
``"auto"`` measures: :func:`measure_replica_strategies` compiles each candidate's round for the
first unit of replicas (one replica, or one chunk) and times one execution of it on a copy of
the states; a sweep round's time is that unit's time times the sweep's units (R replicas one by
one, or R / chunk chunks); the faster runs every round, the first included. With one replica
there is nothing to choose: ``"vmap"``, as on any accelerator.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fedorth.fed import autotune, execution
from fedorth.sweep.grid import SweepError

REPLICA_STRATEGIES = ("auto", "sequential", "vmap")

_logger = logging.getLogger(__name__)


def check_replica_strategy(strategy: str) -> str:
    if strategy not in REPLICA_STRATEGIES:
        raise SweepError(f"--replica_strategy={strategy!r}; valid: {REPLICA_STRATEGIES}.")
    return strategy


def resolve_replica_strategy(strategy: str) -> str:
    """The replica strategy ``"auto"`` stands for without measuring: ``"sequential"`` on CPU,
    else ``"vmap"`` (the clients' one-device rule, ``fedorth.fed.execution``)."""
    if check_replica_strategy(strategy) != "auto":
        return strategy
    return "sequential" if execution._backend() == "cpu" else "vmap"


def measures(strategy: str, replicas: int) -> bool:
    """Whether ``"auto"`` is decided by :func:`measure_replica_strategies`: on an accelerator,
    for more than one replica."""
    return (
        check_replica_strategy(strategy) == "auto"
        and replicas > 1
        and (execution._backend() != "cpu")
    )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A replica strategy's compiled round and its first unit.

    Attributes:
      step: the jitted round of one unit, ``step(states, data, values)``; it donates ``states``.
      arguments: the first unit's ``(states, data, values)``.
      units: the units a sweep round runs (replicas, or chunks of them).
    """

    step: Callable
    arguments: tuple
    units: int


def measure_replica_strategies(
    candidates: dict[str, Candidate], *, timer: Callable[[], float] = time.perf_counter
) -> dict[str, Any]:
    """Compiles each candidate and times one unit; the sweep round's time is it times the units.

    Each candidate runs on a copy of its first unit's states, so the sweep's rounds are exactly
    those of the chosen strategy. A candidate whose compilation or execution fails in XLA (e.g.
    a vmapped chunk out of memory) is skipped and its error recorded.

    Args:
      candidates: by strategy name, in order of preference on ties.
      timer: seconds as a float (``time.perf_counter``; tests pass a fake).

    Returns:
      ``{"strategy": the fastest, "rule": "measured", "backend", "candidates": {name:
      {"compile_s", "unit_s", "units", "round_s"} or {"error"}}}``.
    """

    def compile_and_run(candidate: Candidate) -> tuple[Callable, Callable]:
        states, data, values = candidate.arguments
        return (
            lambda: candidate.step.lower(states, data, values).compile(),
            lambda compiled: compiled(jax.tree.map(jnp.copy, states), data, values),
        )

    timings, errors = autotune.time_compile_and_run(
        {name: compile_and_run(candidate) for name, candidate in candidates.items()}, timer
    )
    for name, timing in timings.items():
        if "run_s" in timing:
            unit_s = timing.pop("run_s")
            units = candidates[name].units
            timing.update(unit_s=unit_s, units=units, round_s=unit_s * units)
    timed = [name for name in candidates if "round_s" in timings[name]]
    if not timed:
        raise errors[next(iter(candidates))]
    # min keeps the first of equal times: the preferred candidate on ties.
    chosen = min(timed, key=lambda name: timings[name]["round_s"])
    selection = {
        "strategy": chosen,
        "rule": "measured",
        "backend": execution._backend(),
        "candidates": timings,
    }
    _logger.info(describe_selection(selection))
    return selection


def out_of_memory_message(strategy: str, chunk_size: int, placement=None) -> str:
    """What to change when a sweep round of ``strategy`` runs out of device memory
    (``placement``: the replicas' places on several devices, ``fedorth.sweep.placement``)."""
    if placement is not None:
        k = placement.devices_per_replica
        where = f"each group of {k} devices" if k > 1 else "each device"
        fix = (
            f"lower --replica_chunk_size (the per-device chunk: {placement.chunk} replicas at "
            f"once on {where}; 1 runs one at a time)"
            if placement.chunk > 1
            else "raise --sweep.devices_per_replica (a replica's clients over more devices), "
            "or shrink one run (fed.strategy='chunked' with fed.chunk_size)"
        )
        return f"A sweep round ran out of device memory: {fix}."
    if strategy == "vmap" and chunk_size > 1:
        fix = (
            f"lower --replica_chunk_size (it runs {chunk_size} replicas at once; 1 runs one at "
            "a time), or pass --replica_strategy=sequential"
        )
    else:
        fix = "shrink one run first (fed.strategy='sequential' or 'chunked' with fed.chunk_size)"
    return f"A sweep round ran out of device memory: {fix}."


def describe_selection(selection: dict[str, Any]) -> str:
    """One line for the log: each candidate's sweep-round time and compile time, the choice."""
    parts = []
    for name, timing in selection["candidates"].items():
        if "round_s" in timing:
            parts.append(
                f"{name} {1e3 * timing['round_s']:.1f} ms per round ({timing['units']} x "
                f"{1e3 * timing['unit_s']:.1f} ms; compile {timing['compile_s']:.1f} s)"
            )
        else:
            parts.append(f"{name} failed ({timing['error']})")
    return (
        f"--replica_strategy=auto on {selection['backend']}: "
        + ", ".join(parts)
        + f" -> {selection['strategy']}"
    )
