"""The rounds of a run: one loop for a single run and for a sweep's replicas.

:func:`run_rounds` runs rounds ``done + 1 .. stop`` of a :class:`Rounds` and owns what every run
does around a round: which rounds are evaluated and saved, a stop request checked before the
round's writes and again after them (the round is then saved, and the run stops naming the
round it resumes from), a second signal that stops at once (:func:`stopping_at_once`, also
around the restore before the rounds), an out-of-memory error of the round (raised by its call,
or where its results are first read) turned into :class:`fedorth.fed.RoundOutOfMemoryError`
with the paragraph :meth:`Rounds.out_of_memory` gives, and drawings in the background waited
for. Each evaluated row is built by :func:`evaluated_row`.

What differs is the :class:`Rounds` given: a single run (:mod:`fedorth.train.loop`) has one
state and raises :class:`fedorth.train.loop.DivergenceError` at a non-finite loss, parameter or
row; a sweep (:mod:`fedorth.sweep.runner`) has one state per replica, marks a replica that
diverges and goes on with the others.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import jax
import ml_collections
import numpy as np

from fedorth import fed
from fedorth.train import builders, privacy


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM during a run; the message names the round reached and the round
    a rerun resumes from (the newest checkpoint). ``signum``: the signal, or ``None`` for a
    ``KeyboardInterrupt`` raised otherwise. ``at_once``: a second signal stopped it without
    saving the round (with several processes, the others did not stop with it)."""

    def __init__(self, message: str, signum: int | None = None, *, at_once: bool = False):
        super().__init__(message)
        self.signum = signum
        self.at_once = at_once


class Rounds:
    """A run's rounds, as :func:`run_rounds` drives them; subclasses give each step.

    Attributes:
      rounds: ``fed.rounds``, the run's last round.
      eval_every: evaluate every this many rounds (0: only the last).
      checkpoint_every: save every this many rounds (0: only the last, or at a stop).
      progress: the progress line (:class:`fedorth.train.logging_utils.Progress`).
      saves: whether the rounds are checkpointed (a sweep's replicas computed again from round
        0 up to the saved round are not).
    """

    rounds: int
    eval_every: int
    checkpoint_every: int
    progress: Any
    saves: bool = True

    def initial(self) -> None:
        """Evaluates the initial model (round 0), writes its rows and shows them."""
        raise NotImplementedError

    def round(self, done: int) -> Any:
        """Runs round ``done + 1``; its metrics (still on the devices)."""
        raise NotImplementedError

    def check(self, round_index: int, metrics: Any, *, full_state: bool) -> None:
        """The round's loss and parameters (``full_state``: the whole state, which is about to be
        saved) are finite, before anything of the round is written."""
        raise NotImplementedError

    def evaluate(self, round_index: int, metrics: Any) -> None:
        """Evaluates the round, writes its rows (each from :func:`evaluated_row`) and shows them
        on the progress line."""
        raise NotImplementedError

    def save(self, round_index: int) -> None:
        """Saves the checkpoint of round ``round_index``."""
        raise NotImplementedError

    def stopped(self, signum: int, round_index: int) -> KeyboardInterrupt:
        """The stop a signal asked for, round ``round_index`` saved."""
        raise NotImplementedError

    def stopped_at_once(self, signum: int | None, done: int) -> KeyboardInterrupt:
        """The stop of a second signal after round ``done``, from the newest checkpoint."""
        raise NotImplementedError

    def out_of_memory(self, error: BaseException) -> str:
        """What a round that ran out of memory says (XLA's ``error``): the round's paragraph
        (``fed.memory.out_of_memory_message``)."""
        raise NotImplementedError

    def wait(self) -> None:
        """Waits for what is drawn in the background (no drawing outlives a failed run)."""


def evaluated_row(
    config: ml_collections.ConfigDict,
    round_index: int,
    metrics: dict[str, Any],
    evaluation: dict[str, Any],
    communication: dict[str, float],
    wall_s: float,
    params: Any,
) -> dict[str, Any]:
    """The ``metrics.jsonl`` row of an evaluated round: the round's training metrics, the test
    evaluation, the communication, the privacy spent (``dp.*``), the wall clock and, with
    ``log_condition_number``, the mean and largest condition number of the weight matrices
    (``params`` on the host)."""
    row: dict[str, Any] = {"round": round_index}
    row.update({key: float(value) for key, value in metrics.items()})
    row.update({key: float(value) for key, value in evaluation.items()})
    row.update(communication)
    row.update(privacy.epsilon_row(config, round_index))
    row["wall_s"] = wall_s
    if config.get("log_condition_number", False):
        kappa = list(builders.condition_numbers(params).values())
        row["condition_number_mean"] = float(np.mean(kappa))
        row["condition_number_max"] = float(np.max(kappa))
    return row


def non_finite(row: dict[str, Any]) -> str | None:
    """The first key of ``row`` whose value is a NaN or Inf, or None."""
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            return key
    return None


@contextlib.contextmanager
def stopping_at_once(signals, stop_fn):
    """A second signal (a ``KeyboardInterrupt`` that is not a :class:`RunInterrupted` already)
    becomes the stop ``stop_fn(signal)`` gives (the run resumes from its newest checkpoint):
    around the restore before the rounds as around the rounds."""
    try:
        yield
    except RunInterrupted:
        raise
    except KeyboardInterrupt as error:
        raise stop_fn(signals.received) from error


def run_rounds(rounds: Rounds, signals, done: int, stop: int | None = None) -> int:
    """Runs rounds ``done + 1 .. stop`` (default ``rounds.rounds``) of ``rounds``; the round
    reached.

    ``signals`` (:class:`fedorth.train.loop._Signals`): a stop request seen before the round's
    writes or during them saves the round (unless it is the last: the run then finishes) and
    raises ``rounds.stopped``; a second signal raises ``rounds.stopped_at_once``.

    Raises:
      fedorth.fed.RoundOutOfMemoryError: the round ran out of memory (XLA's error surfaces
        where the round's results are first read, after its call returned).
    """
    stop = rounds.rounds if stop is None else stop
    reached = [done]

    def at_once(signum: int | None) -> KeyboardInterrupt:
        rounds.wait()
        return rounds.stopped_at_once(signum, reached[0])

    try:
        with stopping_at_once(signals, at_once):
            if done == 0 and rounds.eval_every > 0:
                rounds.initial()
            while done < stop:
                metrics = rounds.round(done)
                round_index = done = reached[0] = done + 1
                is_last = round_index == rounds.rounds
                is_eval = is_last or (
                    rounds.eval_every > 0 and round_index % rounds.eval_every == 0
                )
                every = rounds.checkpoint_every
                due = rounds.saves and (is_last or bool(every and round_index % every == 0))
                stopping = signals.stop_requested()
                # Before anything of this round is written or saved.
                rounds.check(round_index, metrics, full_state=due or stopping)
                if is_eval:
                    rounds.evaluate(round_index, metrics)
                else:
                    rounds.progress.update(round_index)
                if not stopping and signals.stop_requested():  # came during this round's writes
                    stopping = True
                    rounds.check(round_index, metrics, full_state=rounds.saves)
                if rounds.saves and (due or stopping):
                    rounds.save(round_index)
                if stopping and not is_last:
                    rounds.wait()
                    raise rounds.stopped(signals.received, round_index)
    except jax.errors.JaxRuntimeError as error:
        if not fed.memory.is_out_of_memory(error):
            raise
        raise fed.RoundOutOfMemoryError(rounds.out_of_memory(error)) from None
    finally:
        rounds.wait()
    return done
