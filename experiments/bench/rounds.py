"""`round` subcommand of experiments.bench: federated rounds of fedorth against its peers.

    python -m experiments.bench round [--workloads mlp,lenet5,cnn,vit_tiny,resnet18]
        [--algorithms fedavg,fedpac_muon,fedpac_soap,fedpac_sophia] [--clients 10,100]
        [--local-steps 5,50] [--batch-size 50] [--dtypes float32,bfloat16]
        [--strategies auto,vmap,chunked,sequential,sharded] [--conv-impls auto,lax,matmul,canonical]
        [--unrolls 1,True] [--lapack-threads 1,auto] [--peers torch,torch_amp,jax_loop]
        [--aligned theta|state]
        [--repeats 3] [--budget-s 500]
        [--preset targets] [--isolate] [--memory] [--micro] [--scaling] [--no-rounds]
        [--json out.json] [--quick]

docs/PERFORMANCE.md has the measured tables and the commands that produced them; the GPU
targets' table is one command (benchmarks/README.md):

    python -m experiments.bench round --preset targets --budget-s 500 --json targets.json

One *case* is (workload, algorithm, S clients per round, K local steps, batch B, model dtype);
within a case every implementation runs the same round on the same random data (N = 2S clients
of 64 examples, mini-batches of B drawn with replacement):

* ``fedorth``: one jitted ``make_round_fn`` call per round, one row per (strategy, conv_impl,
  unroll) asked for;
* ``jax_loop``: Python loops over the sampled clients and their local steps around one jitted
  local step (the "JAX per-step loop" baseline, experiments/bench/jax_loop.py: the engine's
  algorithm, state and keys; XLA's own convolution, which is fastest there);
* ``torch``: the PyTorch peer (benchmarks/torch_peer.py), clients in a Python loop, with
  ``torch.set_num_threads`` equal to the cores JAX uses; ``torch_amp``: the same peer in
  channels_last + bfloat16 autocast (what a performance-minded PyTorch user writes).

FedPAC rows run one alignment mode on every side, ``--aligned`` (fedorth's
``fed.options.aligned``, default ``theta``, the header's ``fedpac_aligned`` line and each row's
``aligned``): ``theta`` warm-starts the preconditioner ``Theta`` only, so each client's SOAP
round opens with the update-free call that rebuilds ``Q`` by ``eigh`` (one per factor, client
and round; fedorth's server then rebuilds no ``Q``, which no client would read, while the torch
peer's average of the whole optimizer state does: ``S`` against ``S + 1`` per factor and round);
``state`` warm-starts the whole state (no such call after round 1).

Every implementation is warmed up (fedorth: round 1 compiles; its compile time is what JAX's
``/jax/core/compile/*`` monitoring events report), then the implementations run one round each in
turn, ``--repeats`` times, each synchronized with ``block_until_ready``; the tables give medians,
and each ratio is the median of the per-repeat ratios (side by side: the machine is shared).

Budget and output: ``--budget-s`` gives each case (with ``--isolate``: each row) the time left
divided by the cases left; its repeats stop when one more would end past that share (at least
one runs), and nothing new starts once the budget is spent. The JSON file is rewritten
atomically after every case (``"complete": false`` until the end), so a run cut off keeps its
rows. ``--isolate`` (default with ``--preset``) runs each row in its own process, killed when the
budget is spent; the ratios of isolated rows are ratios of medians. ``--preset targets`` is
the GPU targets' table: resnet18_cifar100 and vit_tiny at S = 10, K = 50, B = 50 (FedMuon
(Liu et al.) Table 2), FedAvg in float32 and bfloat16 and FedPAC_Muon, the torch peer, and
torch/torch_amp throughput at batch 500; it ends with the targets and whether each was met.

Sections (experiments/bench/sections.py): ``--memory`` (persistent per-client state at
N = 1000 and peak memory per strategy), ``--micro`` (the XLA:CPU traps: client-axis mean, a
convolution's gradient inside a loop), ``--scaling`` (``sharded`` on 1 vs 2 host devices).

Columns: client-steps/s = S·K / round time; img/s = S·K·B / round time; LAPACK s: the seconds of
a round (median) spent in SOAP's ``eigh``/``qr`` and other dense decompositions, fedorth's host
calls (``fedorth.optim.linalg.host_seconds``) or the peer's ``torch.linalg`` ones (summed over
calls: two side by side, one per device, count twice); compile s; peak MB: the
row's own round (XLA's ``memory_analysis`` of the compiled round: arguments + outputs − aliased
(donated) + temporaries), with ``--isolate`` on a GPU the row's process's device peak
(``memory_stats``; torch rows: ``torch.cuda.max_memory_allocated``); persistent bytes per client
(``ServerState.clients``); FLOP/s achieved = S·K·(model FLOPs of one step: 3 × the forward
pass's matmul and convolution FLOPs counted on its jaxpr, custom-VJP convolutions included, +
Newton–Schulz FLOPs for Muon) / round time, as a fraction of a 2048² float32 matmul timed in
every repeat next to the rounds; ``recompiles`` counts new entries in the jitted round's cache
after round 1 (must be 0); ``donated`` says whether the round's input server state was consumed
(buffers donated).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp

from experiments.bench.budget import Budget, time_repeats
from experiments.bench.cases import Skip, make_row, make_runner, run_case, runner_specs
from experiments.bench.measure import bench_matmul, cpu_threads, device_memory
from experiments.bench.output import add_cross_ratios, format_table, project_commit, write_json
from experiments.bench.presets import PRESETS, format_targets, targets_summary
from experiments.bench.runners import torch_available
from experiments.bench.sections import memory_section, micro_section, scaling_section
from experiments.bench.workloads import (
    ALGORITHMS,
    ALIGNED,
    DTYPES,
    PEERS,
    WORKLOADS,
    Case,
    case_data,
)
from fedorth import fed
from fedorth.models.layers import CONV_IMPLS
from fedorth.optim import linalg


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _unroll(text: str) -> int | bool:
    return True if text in ("True", "true") else int(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench round")
    parser.add_argument("--workloads", default="mlp,lenet5,cnn,vit_tiny,resnet18")
    parser.add_argument("--algorithms", default="fedavg,fedpac_muon")
    parser.add_argument("--clients", default="10", help="S values, e.g. 10,100")
    parser.add_argument("--local-steps", default="10", help="K values, e.g. 5,50")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--dtypes", default="float32", help="model.dtype values: float32,bfloat16")
    parser.add_argument("--strategies", default="auto", help="auto,vmap,chunked,sequential,sharded")
    parser.add_argument("--conv-impls", default="auto", help="lax,matmul,canonical,auto")
    parser.add_argument("--unrolls", default="1", help="local-step scan unroll: 1,True or n")
    parser.add_argument(
        "--lapack-threads",
        default="",
        help="fedorth rows per FEDORTH_LAPACK_THREADS value, e.g. 1,auto: the OpenBLAS threads "
        "of a host LAPACK call (default: the environment's, else auto)",
    )
    parser.add_argument(
        "--peers", default="torch,jax_loop", help="torch,torch_amp,jax_loop or none"
    )
    parser.add_argument(
        "--aligned",
        choices=ALIGNED,
        default="theta",
        help="FedPAC's fed.options.aligned, run by fedorth and every peer alike: theta (Theta "
        "only, fedorth's default) or state (the whole optimizer state)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per implementation")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget: each case gets (time left) / (cases left) for its repeats; "
        "with --isolate a row's process is killed when the whole budget is spent",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a fixed list of cases instead of --workloads x --algorithms x ...: 'targets' is "
        "the GPU targets' table (isolated rows)",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each row in its own process: its own device peak memory, and a hard stop at "
        "the budget (default: on with --preset, else off)",
    )
    parser.add_argument("--memory", action="store_true", help="N=1000 persistent-state section")
    parser.add_argument("--memory-clients", type=int, default=1000)
    parser.add_argument("--scaling", action="store_true", help="sharded on 1 vs 2 host devices")
    parser.add_argument("--micro", action="store_true", help="client-mean and conv-loop traps")
    parser.add_argument("--no-rounds", action="store_true", help="only the asked-for sections")
    parser.add_argument(
        "--json", default=None, help="write all results to this file (rewritten after each case)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny settings (smoke test, ~1 min)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # an --isolate row
    args = parser.parse_args(argv)
    if args.quick:
        defaults = {action.dest: action.default for action in parser._actions}
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
        quick = dict(
            workloads="mlp_small", algorithms="fedavg", clients="2", local_steps="2", batch_size=8,
            repeats=2, memory_clients=20,
        )  # fmt: skip
        for key, value in quick.items():
            if key not in given and getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    for name in ("workloads", "algorithms", "strategies", "conv_impls", "peers", "dtypes"):
        setattr(args, name, _csv(getattr(args, name)))
    args.lapack_threads = _csv(args.lapack_threads) or [None]
    for value in args.lapack_threads:
        if value is not None and value != "auto" and not (value.isdigit() and int(value) >= 1):
            raise ValueError(f"--lapack-threads={value!r}; valid: a count >= 1 or auto.")
    args.peers = [p for p in args.peers if p != "none"]
    args.clients = [int(c) for c in _csv(args.clients)]
    args.local_steps = [int(k) for k in _csv(args.local_steps)]
    args.unrolls = [_unroll(u) for u in _csv(args.unrolls)]
    if args.isolate is None:
        args.isolate = args.preset is not None
    choices = {
        "workloads": WORKLOADS, "algorithms": ALGORITHMS, "strategies": fed.STRATEGIES,
        "conv_impls": CONV_IMPLS, "peers": PEERS, "dtypes": DTYPES,
    }  # fmt: skip
    for name, valid in choices.items():
        for value in getattr(args, name):
            if value not in valid:
                raise ValueError(f"--{name.replace('_', '-')}={value!r}; valid: {list(valid)}.")
    return args


def make_cases(args) -> list[Case]:
    if args.no_rounds:
        return []
    if args.preset is not None:
        return [dataclasses.replace(case, aligned=args.aligned) for case in PRESETS[args.preset]]
    return [
        Case(workload, algorithm, s, k, args.batch_size, dtype, aligned=args.aligned)
        for workload in args.workloads
        for algorithm in args.algorithms
        for s in args.clients
        for k in args.local_steps
        for dtype in args.dtypes
    ]


# ------------------------------------------------------------------------------- isolated rows


def run_child(args) -> int:
    """One row in this process (``--isolate``): the parent's spec file in, the row's file out.

    The row's ``device_peak_bytes`` is this process's device peak (GPU: ``memory_stats``), which
    holds only this row's data, server state and round.
    """
    with open(args.child) as f:
        spec = json.load(f)
    case = Case(**{**spec["case"], "impls": None})
    start = time.perf_counter()
    data, fed_data = case_data(case)
    out: dict[str, Any]
    try:
        runner = make_runner(tuple(spec["spec"]), case, data, fed_data)
    except Skip as why:
        out = {"skip": str(why)}
    else:
        warm = runner.warmup()
        (times,), _ = time_repeats([runner], spec["repeats"], start + spec["share_s"])
        row = make_row(case, runner, times, warm)
        stats = device_memory()
        if stats is not None and runner.kind != "torch" and runner.kind != "torch_amp":
            row["device_peak_bytes"] = stats["peak_bytes_in_use"]
        out = {"row": row}
    write_json(spec["out"], out)
    return 0


def run_isolated(case: Case, spec: tuple, args, share_s: float, budget: Budget, tmpdir: str):
    """Runs one row in a child process, killed when the whole budget is spent.

    Returns (row or None, note or None).
    """
    index = len(os.listdir(tmpdir))
    spec_path, out_path = f"{tmpdir}/spec{index}.json", f"{tmpdir}/row{index}.json"
    fields = dataclasses.asdict(case)
    del fields["impls"]
    write_json(
        spec_path,
        {"case": fields, "spec": list(spec), "repeats": args.repeats, "share_s": share_s,
         "out": out_path},
    )  # fmt: skip
    command = [sys.executable, "-m", "experiments.bench", "round", "--child", spec_path]
    env = dict(os.environ)
    # Each child allocates what it uses (not 75% of the GPU up front), so that its peak is its
    # own and a torch child is not starved by a JAX child's pool.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    left = budget.left()
    label = f"{case.label}/{spec[0]}"
    try:
        done = subprocess.run(command, env=env, timeout=None if math.isinf(left) else left)
    except subprocess.TimeoutExpired:
        return None, f"{label}: killed at the end of the --budget-s budget"
    if done.returncode != 0 or not os.path.exists(out_path):
        return None, f"{label}: the row's process failed (exit {done.returncode})"
    with open(out_path) as f:
        result = json.load(f)
    if "skip" in result:
        return None, f"{label}: {result['skip']}"
    return result["row"], None


# ------------------------------------------------------------------------------- the command


def main(argv: list[str]) -> int:
    """Entry point of ``python -m experiments.bench round``."""
    args = parse_args(argv)
    if args.child is not None:
        return run_child(args)
    if args.isolate:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX's backend
    cases = make_cases(args)
    units = sum(len(runner_specs(c, args)) for c in cases) if args.isolate else len(cases)
    budget = Budget(args.budget_s, units)
    device = jax.devices()[0]
    threads = cpu_threads()
    header = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": f"{device.platform}: {device.device_kind} x{jax.device_count()}",
        "device_count": jax.device_count(),
        "cpu_threads": threads,
        "jax": jax.__version__,
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "lapack_threads": os.environ.get(linalg.THREADS_ENV, "auto")
        + f" (FEDORTH_LAPACK_THREADS; auto = {linalg.host_threads(1)} on one device)",
        "fedpac_aligned": (
            f"{args.aligned} (fed.options.aligned; fedorth and every peer run it"
            + (
                ": Theta only, each SOAP round opens with the update-free eigh call; SOAP "
                "makes S eigh per factor and round on fedorth, whose server rebuilds no Q that "
                "no client reads, and S + 1 on the torch peer, which averages the whole "
                "optimizer state as the reference does)"
                if args.aligned == "theta"
                else ": the whole optimizer state)"
            )
        ),
        "command": "python -m experiments.bench round " + " ".join(argv),
        "commit": project_commit(),
        "budget_s": args.budget_s,
        "isolate": args.isolate,
    }
    if torch_available() is None:
        import torch

        header["torch"] = torch.__version__
        header["torch_threads"] = (
            f"torch.set_num_threads({threads}) (= CPU threads JAX uses), "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
        )
    for key, value in header.items():
        print(f"# {key}: {value}")
    size = 512 if args.quick else 2048
    matmul_gflops = bench_matmul(size, repeats=args.repeats, warmup=1)
    print(f"# float32 {size}² matmul (HIGHEST), same run: {matmul_gflops:.1f} GFLOP/s at start")

    operands = jax.random.normal(jax.random.key(2), (2, size, size))
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
    jax.block_until_ready(matmul(*operands))

    def matmul_fn() -> float:
        start = time.perf_counter()
        jax.block_until_ready(matmul(*operands))
        return 2 * size**3 / (time.perf_counter() - start) / 1e9

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    result: dict[str, Any] = {**header, "matmul_gflops": matmul_gflops, "rows": rows,
                              "notes": notes, "complete": False}  # fmt: skip

    def save() -> None:
        if args.json:
            write_json(args.json, result)

    printed = 0
    with tempfile.TemporaryDirectory(prefix="fedorth_bench_") as tmpdir:
        for case in cases:
            if budget.spent():
                notes.append(f"{case.label}: not run (budget spent)")
                continue
            if args.isolate:
                new = []
                for spec in runner_specs(case, args):
                    deadline = budget.next_case()
                    if budget.spent():
                        notes.append(f"{case.label}/{spec[0]}: not run (budget spent)")
                        continue
                    row, note = run_isolated(
                        case, spec, args, deadline - time.perf_counter(), budget, tmpdir
                    )
                    if row is not None:
                        row["matmul_gflops"] = matmul_gflops
                        if "gflops" in row:
                            row["fraction_of_matmul"] = row["gflops"] / matmul_gflops
                        new.append(row)
                    if note is not None:
                        notes.append(note)
            else:
                new, case_notes = run_case(case, args, matmul_fn, budget.next_case(), budget)
                notes.extend(case_notes)
            rows.extend(new)
            for note in notes[printed:]:
                print(f"# {note}")
            printed = len(notes)
            if new:
                print("\n".join(format_table(new).splitlines()[2:]), flush=True)
            save()  # a run cut off after this case keeps its rows
    add_cross_ratios(rows)
    for note in notes[printed:]:
        print(f"# {note}")
    print()
    print(format_table(rows))
    if args.preset == "targets":
        table, result["targets"] = format_targets(targets_summary(rows))
        print("\ntargets:\n" + table)
    save()
    if args.memory:
        clients = args.memory_clients
        result["memory"] = memory_section(
            num_clients=clients, clients_per_round=min(100, clients), quick=args.quick
        )
        print("\nmemory:", json.dumps(result["memory"], indent=1))
    if args.micro:
        result["micro"] = micro_section(repeats=max(3, args.repeats), quick=args.quick)
        print("\nmicro:", json.dumps(result["micro"], indent=1))
    if args.scaling:
        result["scaling"] = scaling_section(args)
        print("\nscaling:", json.dumps(result["scaling"], indent=1))
    result["complete"] = True
    if args.json:
        write_json(args.json, result)
        print(f"\nwrote {args.json}")
    return 0
