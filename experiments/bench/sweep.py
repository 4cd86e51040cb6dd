"""``python -m experiments.bench sweep``: a sweep of R replicas against R single runs.

    python -m experiments.bench sweep --section cpu [--rounds 60] [--json out.json]
    python -m experiments.bench sweep --section devices [--rounds 4]
    python -m experiments.bench sweep --section gpu [--replicas 8] [--dtypes float32,bfloat16]
        [--devices_per_replica 1]

``cpu``: a 4-seed sweep of the default digits config (``configs/fedavg.py``) in one process
(``python -m experiments.sweep --sweep.seed=42,43,44,45``) against four ``python -m
experiments.main`` runs of the same seeds one after another; both are timed as whole commands
(start-up, compilation, evaluation and files included), and each replica's final metrics are
checked equal to its run's. The ratio is the sweep's wall time over the four runs'.

``devices``: the sweep on several devices, on CPU: an 8-seed sweep of the default digits config
on 8 fake CPU devices of one process (``--sweep.devices_per_replica=1``) and on 2 localhost
processes x 4 fake devices (``--distributed``), each against the same sweep on one device, one
replica at a time (bit for bit its single runs): every replica's rows agree to float32 rounding,
and the compiled round (``run_info.json``'s ``replica_collectives``) has no collective across
replicas. The fake devices share the machine's cores, so the wall times say nothing of
throughput; the D-GPU command is in docs/PERFORMANCE.md.

``gpu``: R replicas of FedAvg on the papers' ResNet-18 (``configs/fedavg.py:cifar100_resnet18``:
CIFAR-100 shapes, S = 10, K = 50, batch 50) on random data, vmapped over replicas
(``fedorth.sweep``), against one run's round; replica-rounds/s of each and their ratio, per
compute dtype (``model.dtype``). Compilation and a first round are excluded from the timings.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from unittest import mock

from experiments.bench.workloads import WORKLOADS

SEEDS = (42, 43, 44, 45)


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def _last_row(folder: pathlib.Path) -> dict:
    row = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])
    row.pop("wall_s")
    return row


def cpu_section(rounds: int | None) -> dict:
    """Wall times of the 4-seed sweep and of the four single runs (whole commands)."""
    extra = [f"--config.fed.rounds={rounds}"] if rounds else []
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        seeds = ",".join(str(s) for s in SEEDS)
        sweep_s = _timed(
            [sys.executable, "-m", "experiments.sweep", "--config=fedavg"]
            + [f"--workdir={root / 'sweep'}", f"--sweep.seed={seeds}", *extra]
        )
        runs_s = []
        for seed in SEEDS:
            command = [sys.executable, "-m", "experiments.main", "--config=fedavg"]
            command += [f"--workdir={root / f'run_{seed}'}", f"--config.seed={seed}", *extra]
            runs_s.append(_timed(command))
        same = all(
            _last_row(root / "sweep" / f"seed={seed}") == _last_row(root / f"run_{seed}")
            for seed in SEEDS
        )
    return {
        "sweep_s": sweep_s,
        "runs_s": runs_s,
        "ratio": sweep_s / sum(runs_s),
        "identical_metrics": same,
    }


DEVICE_SEEDS = tuple(range(42, 50))


def _sweep_command(workdir: pathlib.Path, rounds: int, *extra: str) -> list[str]:
    seeds = ",".join(str(s) for s in DEVICE_SEEDS)
    return [
        sys.executable,
        "-m",
        "experiments.sweep",
        "--config=fedavg",
        f"--workdir={workdir}",
        f"--sweep.seed={seeds}",
        f"--config.fed.rounds={rounds}",
        *extra,
    ]


def _devices_env(devices: int) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return {**env, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}


def _agree(workdir: pathlib.Path, reference: pathlib.Path) -> bool:
    """Every replica's rows equal the reference's to float32 rounding."""
    import numpy as np

    for seed in DEVICE_SEEDS:
        ours, theirs = (
            [json.loads(line) for line in (root / f"seed={seed}" / "metrics.jsonl").open()]
            for root in (workdir, reference)
        )
        if len(ours) != len(theirs):
            return False
        for a, b in zip(ours, theirs, strict=True):
            a.pop("wall_s"), b.pop("wall_s")
            if a.keys() != b.keys():
                return False
            if not all(np.allclose(a[k], b[k], rtol=2e-5, atol=2e-6) for k in a):
                return False
    return True


def devices_section(rounds: int) -> dict:
    """The 8-seed sweep on one device, on 8 devices of one process and on 2 x 4 devices."""
    import socket

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        out = {}
        start = time.perf_counter()
        subprocess.run(
            _sweep_command(root / "one", rounds),
            check=True,
            capture_output=True,
            env=_devices_env(1),
        )
        out["one device"] = {"wall_s": time.perf_counter() - start}
        start = time.perf_counter()
        subprocess.run(
            _sweep_command(root / "eight", rounds, "--sweep.devices_per_replica=1"),
            check=True,
            capture_output=True,
            env=_devices_env(8),
        )
        out["8 devices, 1 process"] = {"wall_s": time.perf_counter() - start, "folder": "eight"}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start = time.perf_counter()
        processes = [
            subprocess.Popen(
                _sweep_command(
                    root / "two",
                    rounds,
                    "--distributed",
                    f"--coordinator_address=127.0.0.1:{port}",
                    "--num_processes=2",
                    f"--process_id={i}",
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=_devices_env(4),
            )
            for i in range(2)
        ]
        if any(p.wait() for p in processes):
            raise RuntimeError("the 2-process sweep failed; run its command to see why")
        out["2 processes x 4 devices"] = {"wall_s": time.perf_counter() - start, "folder": "two"}
        for row in out.values():
            folder = row.pop("folder", None)
            if folder is None:
                continue
            info = json.loads(
                (root / folder / f"seed={DEVICE_SEEDS[0]}" / "run_info.json").read_text()
            )
            row["placement"] = info["replica_placement"]
            row["collectives"] = info["replica_collectives"]
            row["equal_to_single_runs"] = _agree(root / folder, root / "one")
    return out


def _random_data(workload):
    """``build_data(config, seed)`` for the workload's random inputs (the same for every seed, as
    a dataset is), split into ``data.num_clients`` IID clients by each replica's seed."""

    def build_data(config, seed):
        import numpy as np

        from fedorth.data import make_federated
        from fedorth.data import partition as partition_lib

        rng = np.random.default_rng(0)
        clients = int(config.data.num_clients)
        total = clients * 500  # CIFAR-100's 50k training images over 100 clients
        x = rng.standard_normal((total, *workload.input_shape)).astype(np.float32)
        y = rng.integers(0, workload.num_classes, total).astype(np.int32)
        parts = partition_lib.partition("iid", y, clients, seed=seed)
        return make_federated(x, y, x[:500], y[:500], parts, "random", workload.num_classes)

    return build_data


# The workloads a GPU sweep measures: the papers' ResNet-18 (one run already fills a GPU) and the
# small models of experiments/bench/workloads.py, where one run leaves the GPU idle.
GPU_WORKLOADS = ("resnet18_cifar100", "mlp", "lenet5", "cnn")


def _workload_config(name: str, dtype: str):
    """configs/fedavg.py's CIFAR-100 ResNet-18 preset (S = 10, K = 50, B = 50), or for a small
    workload its model on random inputs at S = 10, K = 10, B = 50."""
    from configs import fedavg

    workload = WORKLOADS[name]
    config = fedavg.get_config("cifar100_resnet18")
    if name != "resnet18_cifar100":
        config.model = type(config.model)({"name": workload.model, **dict(workload.kwargs)})
        config.fed.local_steps = 10
    config.model.dtype = dtype
    config.data.augment = False  # random inputs: the crop/flip adds nothing to measure
    return workload, config


def _build_on(build_data, builders, config):
    with mock.patch.object(builders, "build_data", build_data):
        return builders.build(config)


def gpu_section(
    replicas: int,
    dtypes: list[str],
    timed_rounds: int,
    conv_impl: str = "matmul",
    on_row=None,
    workloads: tuple[str, ...] = ("resnet18_cifar100",),
    devices_per_replica: int | None = None,
) -> list[dict]:
    """Replica-rounds/s of R vmapped replicas and of one run, per workload and dtype.

    ResNet-18's one run keeps the GPU's native convolutions (``model.conv_impl="auto"``:
    ``lax``) and runs its clients one at a time (``sequential``, its fastest on an H100,
    fed.round's docstring); the vmapped replicas use ``conv_impl`` (default im2col + dot,
    ``"matmul"``): vmapped native convolutions with per-replica weights become grouped
    convolutions, which ran at 0.38x on an H100, while vmapped im2col ones become batched
    matmuls. A small workload's one run is timed with its clients vmapped and sequential, and the
    faster is the one run's figure (what ``fed.strategy=auto`` would pick). ``on_row(rows)`` is
    called after each row with the rows so far (a run cut off by a time limit keeps them).
    ``devices_per_replica``: the replicas placed on every device (``fedorth.sweep.placement``),
    against one run on one device: the D-GPU figure.
    """
    import jax

    from fedorth.sweep import Grid, ReplicaRound
    from fedorth.train import builders

    def timed(round_):
        states = round_.initial_states()
        states, _ = round_(states)  # compiles
        jax.block_until_ready(states)
        start = time.perf_counter()
        for _ in range(timed_rounds):
            states, _ = round_(states)
        jax.block_until_ready(states)
        return len(round_.replicas) * timed_rounds / (time.perf_counter() - start)

    out = []
    for name in workloads:
        for dtype in dtypes:
            workload, config = _workload_config(name, dtype)

            build = functools.partial(_build_on, _random_data(workload), builders)

            singles = {}
            for strategy in (
                ("sequential",) if name == "resnet18_cifar100" else ("vmap", "sequential")
            ):
                config.fed.strategy = strategy
                single = ReplicaRound.from_grid(
                    Grid(config, {"seed": [42]}), strategy="sequential", build=build
                )
                singles[strategy] = timed(single)
            if workload.conv:
                config.model.conv_impl = conv_impl
            config.fed.strategy = "vmap" if name != "resnet18_cifar100" else "sequential"
            grid = Grid(config, {"seed": list(range(42, 42 + replicas))})
            many = timed(
                ReplicaRound.from_grid(
                    grid, strategy="vmap", build=build, devices_per_replica=devices_per_replica
                )
            )
            best = max(singles, key=singles.get)
            out.append(
                {
                    "workload": name,
                    "dtype": dtype,
                    "clients_per_round": int(config.fed.clients_per_round),
                    "local_steps": int(config.fed.local_steps),
                    "batch_size": int(config.fed.batch_size),
                    "replicas": replicas,
                    "devices": len(jax.devices()) if devices_per_replica is not None else 1,
                    "one_run_strategy": best,
                    "replica_rounds_per_s": {
                        **{f"one run ({k})": v for k, v in singles.items()},
                        f"{replicas} replicas vmapped": many,
                    },
                    "ratio": many / singles[best],
                }
            )
            if on_row is not None:
                on_row(out)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``python -m experiments.bench sweep``."""
    parser = argparse.ArgumentParser(prog="python -m experiments.bench sweep")
    parser.add_argument("--section", choices=("cpu", "devices", "gpu", "auto"), default="auto")
    parser.add_argument("--rounds", type=int, default=None, help="cpu: fed.rounds (config's)")
    parser.add_argument("--replicas", type=int, default=8, help="gpu: replicas vmapped")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="gpu: model.dtype values")
    parser.add_argument("--timed_rounds", type=int, default=3, help="gpu: rounds timed")
    parser.add_argument("--conv_impl", default="matmul", help="gpu: the replicas' convolutions")
    parser.add_argument(
        "--workloads",
        default="resnet18_cifar100",
        help=f"gpu: comma-separated, of {','.join(GPU_WORKLOADS)}",
    )
    parser.add_argument(
        "--devices_per_replica",
        type=int,
        default=None,
        help="gpu: place the replicas on every device, groups of this many (D-GPU figure)",
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    section = args.section
    if section == "auto":
        import jax

        section = "cpu" if jax.default_backend() == "cpu" else "gpu"
    if section == "devices":
        result = devices_section(args.rounds or 4)
        print(
            "| sweep of 8 seeds | wall s | replicas equal their single runs | collectives "
            "(across replicas) |\n| --- | --- | --- | --- |"
        )
        for name, row in result.items():
            collectives = row.get("collectives")
            said = (
                f"{collectives['count']} ({len(collectives['across_replicas'])})"
                if collectives
                else "-"
            )
            print(
                f"| {name} | {row['wall_s']:.1f} | {row.get('equal_to_single_runs', 'reference')} "
                f"| {said} |"
            )
        print(
            "The fake CPU devices share this machine's cores: the wall times say nothing of "
            "throughput (docs/PERFORMANCE.md has the D-GPU command)."
        )
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    elif section == "cpu":
        result = cpu_section(args.rounds)
        runs = " + ".join(f"{s:.1f}" for s in result["runs_s"])
        print("| what | wall s |\n| --- | --- |")
        print(f"| sweep of seeds {SEEDS} (one process) | {result['sweep_s']:.1f} |")
        print(f"| four experiments.main runs | {runs} = {sum(result['runs_s']):.1f} |")
        print(
            f"ratio sweep / runs: {result['ratio']:.2f}x (target <= 0.7x); replicas' final "
            f"metrics equal the runs': {result['identical_metrics']}"
        )
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    else:
        workloads = tuple(args.workloads.split(","))
        unknown = sorted(set(workloads) - set(GPU_WORKLOADS))
        if unknown:
            print(f"--workloads: unknown {unknown}; known: {','.join(GPU_WORKLOADS)}")
            return 2
        print(
            "| workload | dtype | S x K, B | one run (replica-rounds/s, its faster strategy) "
            "| vmapped replicas | ratio |",
            flush=True,
        )
        print("| --- | --- | --- | --- | --- | --- |", flush=True)

        def on_row(rows):
            row = rows[-1]
            *_, many = row["replica_rounds_per_s"].values()
            one = row["replica_rounds_per_s"][f"one run ({row['one_run_strategy']})"]
            print(
                f"| {row['workload']} | {row['dtype']} | {row['clients_per_round']} x "
                f"{row['local_steps']}, {row['batch_size']} | {one:.3f} "
                f"({row['one_run_strategy']}) | {many:.3f} ({row['replicas']}) "
                f"| {row['ratio']:.2f}x |",
                flush=True,
            )
            if args.json:
                pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))

        gpu_section(
            args.replicas,
            args.dtypes.split(","),
            args.timed_rounds,
            args.conv_impl,
            on_row,
            workloads,
            args.devices_per_replica,
        )
    return 0
