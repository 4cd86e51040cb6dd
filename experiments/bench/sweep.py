"""``python -m experiments.bench sweep``: a sweep of R replicas against R single runs.

    python -m experiments.bench sweep --section cpu [--rounds 60] [--json out.json]
    python -m experiments.bench sweep --section gpu [--replicas 8] [--dtypes float32,bfloat16]

``cpu``: a 4-seed sweep of the default digits config (``configs/fedavg.py``) in one process
(``python -m experiments.sweep --sweep.seed=42,43,44,45``) against four ``python -m
experiments.main`` runs of the same seeds one after another; both are timed as whole commands
(start-up, compilation, evaluation and files included), and each replica's final metrics are
checked equal to its run's. The ratio is the sweep's wall time over the four runs'.

``gpu``: R replicas of FedAvg on the papers' ResNet-18 (``configs/fedavg.py:cifar100_resnet18``:
CIFAR-100 shapes, S = 10, K = 50, batch 50) on random data, vmapped over replicas
(``fedorth.sweep``), against one run's round; replica-rounds/s of each and their ratio, per
compute dtype (``model.dtype``). Compilation and a first round are excluded from the timings.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from unittest import mock

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


def _random_cifar100(config, seed):
    """Random inputs of CIFAR-100's shapes (the same for every seed, as the dataset is), split
    into clients by each replica's seed."""
    import numpy as np

    from fedorth.data import make_federated
    from fedorth.data import partition as partition_lib

    rng = np.random.default_rng(0)
    clients = int(config.data.num_clients)
    total = clients * 500  # CIFAR-100's 50k training images over 100 clients
    x = rng.standard_normal((total, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 100, total).astype(np.int32)
    parts = partition_lib.partition("iid", y, clients, seed=seed)
    return make_federated(x, y, x[:500], y[:500], parts, "cifar100", 100)


def gpu_section(
    replicas: int,
    dtypes: list[str],
    timed_rounds: int,
    conv_impl: str = "matmul",
    on_row=None,
) -> list[dict]:
    """Replica-rounds/s of R vmapped replicas and of one run, per dtype.

    One run keeps the GPU's native convolutions (``model.conv_impl="auto"``: ``lax``, one client
    at a time); the vmapped replicas use ``conv_impl`` (default im2col + dot, ``"matmul"``):
    vmapped native convolutions with per-replica weights become grouped convolutions, which ran
    at 0.38x on an H100 (fedorth.fed.round), while vmapped im2col ones become batched matmuls.
    ``on_row(rows)`` is called after each dtype with the rows so far (a run cut off by a time
    limit keeps them).
    """
    import jax

    from configs import fedavg
    from fedorth.sweep import Grid, ReplicaRound
    from fedorth.train import builders

    def build(config):
        with mock.patch.object(builders, "build_data", _random_cifar100):
            return builders.build(config)

    out = []
    for dtype in dtypes:
        config = fedavg.get_config("cifar100_resnet18")
        config.model.dtype = dtype
        config.data.augment = False  # random inputs: the crop/flip adds nothing to measure
        config.fed.strategy = "sequential"  # one run's fastest on an H100 (fed.round docstring)
        single = ReplicaRound.from_grid(
            Grid(config, {"seed": [42]}), strategy="sequential", build=build
        )
        config.model.conv_impl = conv_impl
        grid = Grid(config, {"seed": list(range(42, 42 + replicas))})
        many = ReplicaRound.from_grid(grid, strategy="vmap", build=build)
        rates = {}
        for name, round_ in (("one run", single), (f"{replicas} replicas vmapped", many)):
            states = round_.initial_states()
            states, _ = round_(states)  # compiles
            jax.block_until_ready(states)
            start = time.perf_counter()
            for _ in range(timed_rounds):
                states, _ = round_(states)
            jax.block_until_ready(states)
            seconds = time.perf_counter() - start
            rates[name] = len(round_.replicas) * timed_rounds / seconds
        one, vmapped = rates.values()
        out.append({"dtype": dtype, "replica_rounds_per_s": rates, "ratio": vmapped / one})
        if on_row is not None:
            on_row(out)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``python -m experiments.bench sweep``."""
    parser = argparse.ArgumentParser(prog="python -m experiments.bench sweep")
    parser.add_argument("--section", choices=("cpu", "gpu", "auto"), default="auto")
    parser.add_argument("--rounds", type=int, default=None, help="cpu: fed.rounds (config's)")
    parser.add_argument("--replicas", type=int, default=8, help="gpu: replicas vmapped")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="gpu: model.dtype values")
    parser.add_argument("--timed_rounds", type=int, default=3, help="gpu: rounds timed")
    parser.add_argument("--conv_impl", default="matmul", help="gpu: the replicas' convolutions")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    section = args.section
    if section == "auto":
        import jax

        section = "cpu" if jax.default_backend() == "cpu" else "gpu"
    if section == "cpu":
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
        print("| dtype | one run (replica-rounds/s) | vmapped replicas | ratio |", flush=True)
        print("| --- | --- | --- | --- |", flush=True)

        def on_row(rows):
            one, many = rows[-1]["replica_rounds_per_s"].values()
            print(
                f"| {rows[-1]['dtype']} | {one:.3f} | {many:.3f} | {rows[-1]['ratio']:.2f}x |",
                flush=True,
            )
            if args.json:
                pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))

        gpu_section(
            args.replicas, args.dtypes.split(","), args.timed_rounds, args.conv_impl, on_row
        )
    return 0
