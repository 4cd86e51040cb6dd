"""``fed.strategy="auto"`` on one accelerator: the fastest round, measured on the first round.

On one accelerator no rule picks the faster strategy for every model, and for a convolutional
model the choice is a pair (strategy, convolution). On an H100 (S = 10 x K = 10 FedAvg,
client-steps/s, ``python -m experiments.bench round --workloads resnet18_full,cnn --strategies
vmap,sequential --conv-impls matmul,lax --peers none``):

=============  ============  =========  ===============  ===============
workload       vmap+matmul   vmap+lax   sequential+lax   sequential+matmul
=============  ============  =========  ===============  ===============
resnet18_full  333.6         122.5      333.1            269.5
cnn            4840.9        3110.3     3605.9           3074.8
=============  ============  =========  ===============  ===============

Vmapped clients turn XLA's convolutions into grouped ones, which im2col + dot (``"matmul"``)
avoids; one client at a time, XLA's convolution is the faster. So a convolutional model whose
``conv_impl`` is ``"auto"`` is timed as the two pairs that can win (:func:`candidates`: vmap with
im2col, sequential with XLA's convolution; chunked with im2col too when ``chunk_size`` is set),
other models as strategies alone (a vmapped ViT-Tiny round ran at 1.9x a sequential one).
``make_round_fn`` builds one round per candidate and :class:`MeasuredRoundFn` compiles and times
each on the first round's inputs (:func:`measure_strategies`), then runs the fastest; the
choice, the pairs and their times go to ``run_info.json`` (``strategy_selection``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fedorth.fed import execution
from fedorth.fed.compiled import RoundFn
from fedorth.fed.config import RoundConfig
from fedorth.fed.memory import RoundOutOfMemoryError, is_out_of_memory, out_of_memory_message
from fedorth.fed.state import ServerState

PyTree = Any

_logger = logging.getLogger(__name__)


def measures(config: RoundConfig, convolutional: bool) -> bool:
    """Whether ``config``'s strategy is measured: ``"auto"`` on one accelerator (an accelerator
    whose devices would not shard the clients, :func:`fedorth.fed.execution.resolve_strategy`)."""
    return (
        config.strategy == "auto"
        and execution._backend() != "cpu"
        and execution.resolve_strategy("auto", config.clients_per_round, convolutional) != "sharded"
    )


def _copy_tree(tree: PyTree) -> PyTree:
    return jax.tree.map(jnp.copy, tree)


def candidate_strategies(config: RoundConfig) -> tuple[str, ...]:
    """The strategies ``"auto"`` times on one accelerator, the fallback first (ties go to it)."""
    chunk = config.chunk_size or 0
    chunked = ("chunked",) if 1 < chunk < config.clients_per_round else ()
    return ("vmap", *chunked, "sequential")


# The convolution each strategy is timed with when the model's conv_impl is "auto" (the pairs
# that won in the module docstring's table: the two others never did).
CONV_IMPL_OF = {"vmap": "matmul", "chunked": "matmul", "sequential": "lax"}


def conv_impl_choice(loss_fn: Callable) -> bool:
    """Whether ``loss_fn`` is a bound ``Model.loss_fn`` of a convolutional model whose
    ``conv_impl`` is ``"auto"``: then the measurement also chooses the convolution."""
    model = getattr(loss_fn, "__self__", None)
    module = getattr(model, "module", None)
    return bool(getattr(model, "convolutional", False)) and getattr(module, "conv_impl", "") == (
        "auto"
    )


def candidates(config: RoundConfig, choose_conv_impl: bool) -> dict[str, tuple[str, str | None]]:
    """``{label: (strategy, conv_impl)}`` that ``"auto"`` times, the fallback first: strategies
    alone (``conv_impl`` None: the model's), or the (strategy, convolution) pairs."""
    if not choose_conv_impl:
        return {name: (name, None) for name in candidate_strategies(config)}
    return {
        f"{name}+{CONV_IMPL_OF[name]}": (name, CONV_IMPL_OF[name])
        for name in candidate_strategies(config)
    }


def time_compile_and_run(
    calls: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]],
    timer: Callable[[], float],
) -> tuple[dict[str, dict[str, Any]], dict[str, BaseException]]:
    """Times each candidate's compilation and one execution, in the order given.

    ``calls[name] = (compile, run)``: ``compile()`` returns the compiled program, ``run(compiled)``
    executes it once (waited for). A candidate whose compilation or execution fails in XLA (e.g.
    out of memory) is skipped: its timing is ``{"error": type and first line}`` and the error is
    returned in ``errors``. Shared by the clients' measured strategy (``measure_strategies``) and
    the replicas' (``fedorth.sweep.strategy``).

    Returns:
      ``({name: {"compile_s", "run_s"} or {"error"}}, {name: error})``.
    """
    timings: dict[str, dict[str, Any]] = {}
    errors: dict[str, BaseException] = {}
    for name, (compile_fn, run) in calls.items():
        try:
            start = timer()
            compiled = compile_fn()
            compiled_at = timer()
            jax.block_until_ready(run(compiled))
            end = timer()
        except jax.errors.JaxRuntimeError as error:
            errors[name] = error
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            timings[name] = {"error": f"{type(error).__name__}: {first_line[:200]}"}
            continue
        timings[name] = {"compile_s": compiled_at - start, "run_s": end - compiled_at}
    return timings, errors


def measure_strategies(
    candidates: dict[str, RoundFn],
    server: ServerState,
    data: PyTree,
    *,
    timer: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Compiles each candidate round for ``(server, data)`` and times one execution of it.

    Each candidate runs on its own copy of ``server`` (rounds donate the server state), so
    ``server`` stays the caller's, and the rounds the run then makes are exactly those of the
    chosen strategy. A candidate whose compilation or execution fails in XLA (e.g. out of
    memory) is skipped and its error recorded.

    Args:
      candidates: fixed-strategy rounds by strategy name, in order of preference on ties.
      server: the first round's server state.
      data: the round's data.
      timer: seconds as a float (``time.perf_counter``; tests pass a fake).

    Returns:
      ``{"strategy": the fastest, "rule": "measured", "candidates": {name: {"compile_s",
      "round_s"} or {"error"}}}``.

    Raises:
      RoundOutOfMemoryError: every candidate ran out of device memory.
    """

    def compile_and_run(round_fn: RoundFn) -> tuple[Callable, Callable]:
        return (
            lambda: round_fn.lower(server, data).compile(),
            lambda compiled: compiled(*round_fn._arguments(_copy_tree(server), data)),
        )

    timings, errors = time_compile_and_run(
        {name: compile_and_run(round_fn) for name, round_fn in candidates.items()}, timer
    )
    for timing in timings.values():
        if "run_s" in timing:
            timing["round_s"] = timing.pop("run_s")
    timed = [name for name in candidates if "round_s" in timings[name]]
    if not timed:
        out_of_memory = [name for name in candidates if is_out_of_memory(errors[name])]
        if out_of_memory:
            # The last candidate holds the fewest clients at once (sequential).
            name = out_of_memory[-1]
            raise RoundOutOfMemoryError(
                out_of_memory_message(
                    errors[name], candidates[name].config, candidates[name].devices[0]
                )
            ) from None
        raise errors[next(iter(candidates))]
    # min keeps the first of equal times: the fallback on ties.
    chosen = min(timed, key=lambda name: timings[name]["round_s"])
    return {"strategy": chosen, "rule": "measured", "candidates": timings}


def describe_selection(selection: dict[str, Any]) -> str:
    """One line for the log: each candidate's round time and compile time, and the choice."""
    parts = []
    for name, timing in selection["candidates"].items():
        if "round_s" in timing:
            parts.append(
                f"{name} {1e3 * timing['round_s']:.1f} ms (compile {timing['compile_s']:.1f} s)"
            )
        else:
            parts.append(f"{name} failed ({timing['error']})")
    return (
        "fed.strategy='auto': one round of each candidate on "
        f"{selection.get('backend', execution._backend())}: "
        + ", ".join(parts)
        + f" -> {selection.get('candidate', selection['strategy'])}"
    )


class MeasuredRoundFn:
    """``fed.strategy="auto"`` on one accelerator: the faster candidate, timed on the first round.

    Which strategy is faster on an accelerator depends on the model: on an H100 (S = 10 x
    K = 10 FedAvg, client-steps/s) vmap ran 123 against sequential's 326 on the full-width
    ResNet-18 (per-client weights turn a vmapped convolution into a grouped one), and 678
    against 360 on ViT-Tiny. So the first call (or :meth:`select`) compiles each candidate
    (:func:`candidate_strategies`) for the real server state and data and times one round of
    each on a copy of the server state (:func:`measure_strategies`); every round, the first
    included, is then the chosen strategy's round on the real state: the run's results are
    those of a run with that strategy fixed.

    Attributes:
      strategy, config, devices: the chosen round's (``"auto"`` and the given config before the
        choice).
      selection: None before the choice; then ``{"strategy", "rule": "measured", "backend",
        "candidates": {label: {"compile_s", "round_s"} or {"error"}}}``, with ``"candidate"``
        (the chosen label) and ``"conv_impl"`` when (strategy, convolution) pairs were timed.
    """

    def __init__(
        self,
        candidates: dict[str, RoundFn],
        config: RoundConfig,
        *,
        timer: Callable[[], float] = time.perf_counter,
    ):
        self._candidates = dict(candidates)
        self._auto_config = config
        self._timer = timer
        self._chosen: RoundFn | None = None
        self.selection: dict[str, Any] | None = None
        self.devices = next(iter(candidates.values())).devices

    @property
    def strategy(self) -> str:
        return "auto" if self._chosen is None else self._chosen.strategy

    @property
    def config(self) -> RoundConfig:
        return self._auto_config if self._chosen is None else self._chosen.config

    def place(self, tree: PyTree) -> PyTree:
        """``tree`` unchanged: the candidates run on one device."""
        return tree

    def select(self, server: ServerState, data: PyTree) -> dict[str, Any]:
        """Measures the candidates once (``server`` is not consumed) and returns the choice."""
        if self.selection is None:
            selection = measure_strategies(self._candidates, server, data, timer=self._timer)
            label = selection["strategy"]
            self._chosen = self._candidates[label]
            self._candidates = {label: self._chosen}
            self.selection = {**selection, "backend": execution._backend()}
            if self._chosen.conv_impl is not None:
                self.selection.update(
                    candidate=label,
                    strategy=self._chosen.strategy,
                    conv_impl=self._chosen.conv_impl,
                )
            _logger.info(describe_selection(self.selection))
        return self.selection

    def __call__(self, server: ServerState, data: PyTree):
        self.select(server, data)
        return self._chosen(server, data)

    def lower(self, server: ServerState, data: PyTree):
        self.select(server, data)
        return self._chosen.lower(server, data)

    def __getattr__(self, name: str):
        chosen = self.__dict__.get("_chosen")
        if chosen is None or name.startswith("__"):
            raise AttributeError(
                f"{type(self).__name__}.{name}: no strategy chosen yet (call select first)"
            )
        return getattr(chosen, name)
