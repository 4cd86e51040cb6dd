"""One case of the round benchmark: its runners (one per row), their timed rounds, its rows.

A case is run in one process (`run_case`: every runner built, warmed up, then timed round by
round in turn) or, with ``--isolate``, one row per process (experiments/bench/rounds.py's
``run_child``, which uses `make_runner` and `make_row` the same way).
"""

from __future__ import annotations

import statistics
from typing import Any

from experiments.bench.budget import Budget, time_repeats
from experiments.bench.jax_loop import JaxLoopRunner, unsupported
from experiments.bench.runners import FedorthRunner, TorchRunner, torch_available
from experiments.bench.workloads import Case, case_data


def runner_specs(case: Case, args) -> list[tuple]:
    """What runs `case`, one entry per row: ("fedorth", strategy, conv_impl, unroll,
    lapack_threads) or (peer,)."""
    impls = case.impls if case.impls is not None else ("fedorth", *args.peers)
    conv_impls = args.conv_impls if case.workload.conv else [None]
    specs: list[tuple] = []
    for impl in impls:
        if impl == "fedorth":
            specs += [
                ("fedorth", strategy, conv_impl, unroll, threads)
                for strategy in args.strategies
                for conv_impl in conv_impls
                for unroll in args.unrolls
                for threads in args.lapack_threads
            ]
        else:
            specs.append((impl,))
    return specs


def make_runner(spec: tuple, case: Case, data, fed_data):
    """Builds the runner of `spec`; raises `Skip` with the reason when it cannot run here."""
    kind = spec[0]
    if kind == "fedorth":
        _, strategy, conv_impl, unroll, threads = spec
        try:
            return FedorthRunner(
                case,
                data,
                fed_data,
                strategy=strategy,
                conv_impl=conv_impl,
                unroll=unroll,
                lapack_threads=threads,
            )
        except ValueError as err:
            if "dtype" in str(err):
                raise Skip(str(err)) from err
            raise
    if kind == "jax_loop":
        why = unsupported(case.fed_algorithm())
        if why is not None:
            raise Skip(f"{why} ({case.algorithm})")
        # XLA's own convolution: the loop's fastest (no loop body around it, nothing batched).
        return JaxLoopRunner(case, data, fed_data, conv_impl="lax" if case.workload.conv else None)
    why = torch_available()
    if why is not None:
        raise Skip(f"{kind} skipped: {why}")
    return TorchRunner(case, data, amp=kind == "torch_amp")


class Skip(Exception):
    """A row that cannot run here (torch missing, a model without a dtype argument, ...)."""


def make_row(case: Case, runner, times: list[float], warm: dict[str, Any]) -> dict[str, Any]:
    median = statistics.median(times)
    steps = case.clients_per_round * case.local_steps
    row = {
        "workload": case.workload_name,
        "algorithm": case.algorithm,
        "aligned": case.aligned_mode,
        "clients_per_round": case.clients_per_round,
        "local_steps": case.local_steps,
        "batch_size": case.batch_size,
        "dtype": getattr(runner, "dtype", case.dtype),
        "impl": runner.kind,
        **{key: "-" if value is None else str(value) for key, value in runner.settings.items()},
        "round_s": median,
        "round_s_all": times,
        "repeats_done": len(times),
        "client_steps_per_s": steps / median,
        "images_per_s": steps * case.batch_size / median,
        **warm,
        **runner.finish(),
    }
    if runner.kind == "fedorth":
        row["gflops"] = row["flops_per_round"] / median / 1e9
    return row


def run_case(case: Case, args, matmul_fn, deadline: float, budget: Budget):
    """Builds every implementation of `case`, warms them up, times them interleaved.

    `matmul_fn() -> GFLOP/s` times the reference matmul once; it runs in every repeat next to
    the rounds, so that FLOP/s fractions compare numbers measured under the same load. Repeats
    stop at `deadline` (the case's share of the budget); a runner is not built once the whole
    budget is spent. Returns (rows, notes).
    """
    data, fed_data = case_data(case)
    runners, warm, notes = [], [], []
    for spec in runner_specs(case, args):
        if budget.spent():
            notes.append(f"{spec[0]} not run: the --budget-s budget was spent")
            continue
        try:
            runner = make_runner(spec, case, data, fed_data)
        except Skip as why:
            notes.append(str(why))
            continue
        runners.append(runner)
        warm.append(runner.warmup())
    times, matmul = time_repeats(runners, args.repeats, deadline, before=matmul_fn)
    rows = [make_row(case, r, t, w) for r, t, w in zip(runners, times, warm, strict=True)]
    by_kind = {r.kind: i for i, r in enumerate(runners) if r.kind != "fedorth"}
    for i, row in enumerate(rows):
        if row["impl"] != "fedorth":
            continue
        row["matmul_gflops"] = statistics.median(matmul)
        row["fraction_of_matmul"] = row["gflops"] / row["matmul_gflops"]
        for kind, j in by_kind.items():
            ratios = [b / a for a, b in zip(times[i], times[j], strict=False)]
            row[f"speedup_vs_{kind}"] = statistics.median(ratios)
    return rows, [f"{case.label}: {note}" for note in notes]
