"""`round` subcommand of experiments.bench: federated rounds of fedorth against its peers.

    python -m experiments.bench round [--workloads mlp,lenet5,cnn,vit_tiny,resnet18]
        [--algorithms fedavg,fedpac_muon,fedpac_soap,fedpac_sophia] [--clients 10,100]
        [--local-steps 5,50] [--batch-size 50] [--strategies auto,vmap,chunked,sequential,sharded]
        [--conv-impls auto,lax,matmul,canonical] [--unrolls 1,True] [--peers torch,jax_loop]
        [--repeats 3] [--memory] [--micro] [--scaling] [--no-rounds] [--json out.json] [--quick]

docs/PERFORMANCE.md has the measured tables and the commands that produced them.

One *case* is (workload, algorithm, S clients per round, K local steps); within a case every
implementation runs the same round on the same random data (N = 2S clients of 64 examples,
mini-batches of B drawn with replacement):

* ``fedorth``: one jitted ``make_round_fn`` call per round, one row per (strategy, conv_impl,
  unroll) asked for;
* ``jax_loop``: Python loops over the sampled clients and their local steps around one jitted
  local step (the "JAX per-step loop" baseline; same math, same keys; XLA's own convolution,
  which is fastest there);
* ``torch``: the PyTorch peer (benchmarks/torch_peer.py), clients in a Python loop, with
  ``torch.set_num_threads`` equal to the cores JAX uses.

Every implementation is warmed up (fedorth: round 1 compiles; its compile time is what JAX's
``/jax/core/compile/*`` monitoring events report), then the implementations run one round each in
turn, ``--repeats`` times, each synchronized with ``block_until_ready``; the tables give medians,
and each ratio is the median of the per-repeat ratios (side by side: the machine is shared).

Sections (experiments/bench_round_sections.py): ``--memory`` (persistent per-client state at
N = 1000 and peak memory per strategy), ``--micro`` (the XLA:CPU traps: client-axis mean, a
convolution's gradient inside a loop), ``--scaling`` (``sharded`` on 1 vs 2 host devices).

Columns: client-steps/s = S·K / round time; compile s; peak MB (the device's ``memory_stats``
where it has them, else XLA's ``memory_analysis`` of the compiled round: arguments + outputs −
aliased (donated) + temporaries); persistent bytes per client (``ServerState.clients``); FLOP/s
achieved = S·K·(model FLOPs of one step, from XLA's ``cost_analysis`` of the jitted
``value_and_grad``, + Newton–Schulz FLOPs for Muon) / round time, as a fraction of a 2048² float32
matmul timed in every repeat next to the rounds; ``recompiles`` counts new entries in the jitted
round's cache after round 1 (must be 0); ``donated`` says whether the round's input server state
was consumed (buffers donated).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

from experiments.bench_round_common import (  # noqa: F401 (re-exported for tests and users)
    ALGORITHMS,
    PEERS,
    WORKLOADS,
    Case,
    Workload,
    build_model,
    cpu_threads,
    make_data,
    muon_flops,
    step_flops,
)
from experiments.bench_round_runners import (
    FedorthRunner,
    JaxLoopRunner,
    TorchRunner,
    load_torch_peer,  # noqa: F401
    torch_available,
)
from experiments.bench_round_sections import memory_section, micro_section, scaling_section
from fedorth import fed
from fedorth.data.federated import make_federated
from fedorth.models.layers import CONV_IMPLS

# ------------------------------------------------------------------------------- a case


def run_case(case: Case, args, matmul_fn) -> list[dict[str, Any]]:
    """Builds every implementation of `case`, warms them up, times them interleaved.

    `matmul_fn() -> GFLOP/s` times the reference matmul once; it runs in every repeat next to
    the rounds, so that FLOP/s fractions compare numbers measured under the same load.
    """
    data = make_data(case.workload, case.num_clients)
    x, y, partition = data
    fed_data = make_federated(
        x,
        y,
        x[: case.batch_size],
        y[: case.batch_size],
        partition,
        name="bench",
        num_classes=case.workload.num_classes,
    )
    conv_impls = args.conv_impls if case.workload.conv else [None]
    runners = []
    for strategy in args.strategies:
        for conv_impl in conv_impls:
            for unroll in args.unrolls:
                runners.append(
                    FedorthRunner(
                        case, data, fed_data, strategy=strategy, conv_impl=conv_impl, unroll=unroll
                    )
                )
    notes = []
    if "jax_loop" in args.peers:
        if JaxLoopRunner.supports(runners[0].algorithm):
            # XLA's own convolution: the loop's fastest (no loop body around it, nothing batched).
            loop_conv = "lax" if case.workload.conv else None
            runners.append(JaxLoopRunner(case, data, fed_data, conv_impl=loop_conv))
        else:
            notes.append(f"jax_loop skipped: it does not implement {case.algorithm}")
    if "torch" in args.peers:
        why = torch_available()
        if why is None:
            runners.append(TorchRunner(case, data))
        else:
            notes.append(f"torch skipped: {why}")
    warm = [runner.warmup() for runner in runners]
    times: list[list[float]] = [[] for _ in runners]
    matmul = []
    for _ in range(args.repeats):
        matmul.append(matmul_fn())
        for i, runner in enumerate(runners):
            times[i].append(runner.run())
    matmul_gflops = statistics.median(matmul)
    rows = []
    steps = case.clients_per_round * case.local_steps
    by_kind = {r.kind: i for i, r in enumerate(runners) if r.kind != "fedorth"}
    for i, runner in enumerate(runners):
        median = statistics.median(times[i])
        row = {
            "workload": case.workload_name,
            "algorithm": case.algorithm,
            "clients_per_round": case.clients_per_round,
            "local_steps": case.local_steps,
            "batch_size": case.batch_size,
            "impl": runner.kind,
            **{key: "-" if value is None else str(value) for key, value in runner.settings.items()},
            "round_s": median,
            "round_s_all": times[i],
            "client_steps_per_s": steps / median,
            **warm[i],
            **runner.finish(),
        }
        if runner.kind == "fedorth":
            gflops = row["flops_per_round"] / median / 1e9
            row["gflops"] = gflops
            row["matmul_gflops"] = matmul_gflops
            row["fraction_of_matmul"] = gflops / matmul_gflops
            for kind, j in by_kind.items():
                ratios = [b / a for a, b in zip(times[i], times[j], strict=True)]
                row[f"speedup_vs_{kind}"] = statistics.median(ratios)
        rows.append(row)
    for note in notes:
        print(f"# {case.workload_name}/{case.algorithm}: {note}")
    return rows


# ------------------------------------------------------------------------------- output


def format_table(rows: list[dict[str, Any]]) -> str:
    columns = [
        ("workload", "{}"), ("algorithm", "{}"), ("S", "{}"), ("K", "{}"), ("impl", "{}"),
        ("strategy", "{}"), ("conv", "{}"), ("unroll", "{}"), ("steps/s", "{:.2f}"),
        ("round ms", "{:.0f}"), ("compile s", "{:.1f}"), ("peak MB", "{:.1f}"),
        ("GFLOP/s", "{:.1f}"), ("%matmul", "{:.0%}"), ("×torch", "{:.2f}"), ("×jax_loop", "{:.2f}"),
    ]  # fmt: skip
    keys = {
        "S": "clients_per_round", "K": "local_steps", "conv": "conv_impl",
        "steps/s": "client_steps_per_s", "compile s": "compile_s", "GFLOP/s": "gflops",
        "%matmul": "fraction_of_matmul", "×torch": "speedup_vs_torch",
        "×jax_loop": "speedup_vs_jax_loop",
    }  # fmt: skip
    lines = ["| " + " | ".join(name for name, _ in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        cells = []
        for name, fmt in columns:
            if name == "round ms":
                value = 1e3 * row["round_s"]
            elif name == "peak MB":
                value = row["memory"]["peak_bytes"] / 2**20 if "memory" in row else None
            else:
                value = row.get(keys.get(name, name))
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    parser.add_argument("--strategies", default="auto", help="auto,vmap,chunked,sequential,sharded")
    parser.add_argument("--conv-impls", default="auto", help="lax,matmul,canonical,auto")
    parser.add_argument("--unrolls", default="1", help="local-step scan unroll: 1,True or n")
    parser.add_argument("--peers", default="torch,jax_loop", help="torch,jax_loop or none")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per implementation")
    parser.add_argument("--memory", action="store_true", help="N=1000 persistent-state section")
    parser.add_argument("--memory-clients", type=int, default=1000)
    parser.add_argument("--scaling", action="store_true", help="sharded on 1 vs 2 host devices")
    parser.add_argument("--micro", action="store_true", help="client-mean and conv-loop traps")
    parser.add_argument("--no-rounds", action="store_true", help="only the asked-for sections")
    parser.add_argument("--json", default=None, help="write all results to this file")
    parser.add_argument("--quick", action="store_true", help="tiny settings (smoke test, ~1 min)")
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
    for name in ("workloads", "algorithms", "strategies", "conv_impls", "peers"):
        setattr(args, name, _csv(getattr(args, name)))
    args.peers = [p for p in args.peers if p != "none"]
    args.clients = [int(c) for c in _csv(args.clients)]
    args.local_steps = [int(k) for k in _csv(args.local_steps)]
    args.unrolls = [_unroll(u) for u in _csv(args.unrolls)]
    choices = {
        "workloads": WORKLOADS, "algorithms": ALGORITHMS, "strategies": fed.STRATEGIES,
        "conv_impls": CONV_IMPLS, "peers": PEERS,
    }  # fmt: skip
    for name, valid in choices.items():
        for value in getattr(args, name):
            if value not in valid:
                raise ValueError(f"--{name.replace('_', '-')}={value!r}; valid: {list(valid)}.")
    return args


def run_round(argv: list[str]) -> int:
    """Entry point of ``python -m experiments.bench round``."""
    from experiments.bench import bench_matmul

    args = parse_args(argv)
    device = jax.devices()[0]
    threads = cpu_threads()
    header = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": f"{device.platform}: {device.device_kind} x{jax.device_count()}",
        "device_count": jax.device_count(),
        "cpu_threads": threads,
        "jax": jax.__version__,
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "command": "python -m experiments.bench round " + " ".join(argv),
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

    rows = []
    for workload in [] if args.no_rounds else args.workloads:
        for algorithm in args.algorithms:
            for s in args.clients:
                for k in args.local_steps:
                    case = Case(workload, algorithm, s, k, args.batch_size)
                    new = run_case(case, args, matmul_fn)
                    rows.extend(new)
                    print("\n".join(format_table(new).splitlines()[2:]), flush=True)
    print()
    print(format_table(rows))
    result: dict[str, Any] = {**header, "matmul_gflops": matmul_gflops, "rows": rows}
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return 0
