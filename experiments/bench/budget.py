"""``--budget-s``: the round benchmark's wall-clock allowance and its interleaved repeats."""

from __future__ import annotations

import math
import time


class Budget:
    """``--budget-s``: the run's wall-clock allowance, shared among the cases still to run.

    Each case gets ``next_case()`` = now + (what is left) / (cases left) when it starts (with
    ``--isolate`` each row is a "case" here); its timed repeats
    stop when one more would end past that share (`time_repeats`), and a case (or, with
    ``--isolate``, a row's process) is not started once the whole budget is spent. `clock` is
    injectable for tests.
    """

    def __init__(self, total_s: float | None, cases: int, clock=time.perf_counter):
        self.total_s, self.cases_left, self.clock = total_s, cases, clock
        self.start = clock()

    def left(self) -> float:
        return math.inf if self.total_s is None else self.total_s - (self.clock() - self.start)

    def spent(self) -> bool:
        return self.left() <= 0

    def next_case(self) -> float:
        """The share of the next case (absolute deadline on `clock`); counts the case."""
        share = self.left() / max(1, self.cases_left)
        self.cases_left -= 1
        return self.clock() + share


def time_repeats(runners, repeats: int, deadline: float, clock=time.perf_counter, before=None):
    """Runs every runner once per repeat (interleaved), at least once, and stops early when
    one more repeat, costing what the last one did, would end past `deadline`.

    `before()` (the reference matmul) runs at the start of every repeat. Returns the per-runner
    lists of seconds and the per-repeat results of `before`.
    """
    times: list[list[float]] = [[] for _ in runners]
    extra, last = [], 0.0
    for r in range(repeats if runners else 0):
        start = clock()
        if r > 0 and start + last > deadline:
            break
        if before is not None:
            extra.append(before())
        for i, runner in enumerate(runners):
            times[i].append(runner.run())
        last = clock() - start
    return times, extra
