"""``python -m experiments.bench client_state``: SCAFFOLD rounds with the clients' states on the
device, in host memory and on disk (``fed.client_state``), at several population sizes ``N``.

    python -m experiments.bench client_state --clients 1000,10000,100000,342477 \\
        --stores device,host,disk --workload lenet5 --json client_state.json

Each (N, store) runs in its own process, so its resident memory is its own: SCAFFOLD (SGD, option
II control variates, one ``c_i`` per client) on LeNet-5, ``S`` clients per round, ``K`` local
steps. The data are those of 100 clients, client ``i`` reading client ``i mod 100``'s examples: the
population's size changes the states, not the data. A row gives the median round time over
``--rounds`` rounds after one warm-up round (for ``host`` and ``disk``, the reads and writes of the
sampled rows included: the last write is waited for), the ratio to ``device`` at the same ``N``,
the compiled round's device memory (XLA's memory analysis: arguments + outputs - aliased +
temporaries), and the process's resident memory (``VmRSS``) after the rounds and its growth during
them (``+MB``: from the compiled round to the end; the states of ``device`` on a CPU backend and
those of ``host`` are allocated before, and count in the first column only). A store whose states
do not fit (within half of the free device or host memory, or in the free disk) is reported as
such, not run.

The rows, measured one after another, meet whatever load the machine has at the time; on a machine
shared with other jobs that load moves the ratios more than the stores do. So each ``N`` also runs
its stores in one process with their rounds taken in turn (``in turn``: :func:`run_interleaved`),
where every store meets the same load; that ratio is the one to read against the 1.3x target.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

from experiments.bench.measure import peak_memory
from experiments.bench.output import write_json
from experiments.bench.workloads import WORKLOADS, build_model, make_data
from fedorth import fed
from fedorth.data.federated import make_federated, sample_batch
from fedorth.fed import client_store, stored_round

DATA_CLIENTS = 100


def _rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _fits(kind: str, total: int, directory: pathlib.Path) -> bool:
    free = {
        "device": client_store.device_free_bytes() or client_store.host_available_bytes(),
        "host": client_store.host_available_bytes(),
        "disk": client_store.disk_free_bytes(directory),
    }[kind]
    # The disk store needs the space itself (fed.client_state=disk checks no more); the others
    # leave half of their memory to the rest of the process, as fed.client_state=auto does.
    return total <= (free if kind == "disk" else client_store.FRACTION * free)


def _setup(args, num_clients: int, kind: str, directory: pathlib.Path):
    """``(round_fn, server, data, store, row)`` of one (N, store), or ``(..., row)`` with
    ``row["skipped"]`` where its states do not fit."""
    workload = WORKLOADS[args.workload]
    model = build_model(workload, "auto")
    x, y, partition = make_data(workload, DATA_CLIENTS)
    data = make_federated(x, y, x[:8], y[:8], partition, name="bench", num_classes=10)
    params, model_state = model.init(jax.random.key(0), x[:2])
    algorithm = fed.get_algorithm("scaffold", {"name": "sgd", "learning_rate": 0.01})
    s, batch = args.clients_per_round, args.batch_size

    def batch_fn(d, client, key):
        return sample_batch(d, client % DATA_CLIENTS, key, batch)

    template = fed.init_server(
        algorithm, params, model_state, num_clients=1, key=jax.random.key(1), stacked=False
    ).clients
    per_client = client_store.bytes_per_client(template)
    row: dict[str, Any] = {
        "N": num_clients,
        "store": kind,
        "bytes_per_client": per_client,
        "states_bytes": per_client * num_clients,
    }
    if not _fits(kind, per_client * num_clients, directory):
        return None, None, None, None, {**row, "skipped": "does not fit"}
    config = fed.RoundConfig(
        num_clients=num_clients,
        clients_per_round=s,
        local_steps=args.local_steps,
        learning_rate=0.01,
        client_rows=kind != "device",
    )
    inner = fed.make_round_fn(algorithm, model.loss_fn, batch_fn, config, params=params)
    server = fed.init_server(
        algorithm,
        params,
        model_state,
        num_clients=num_clients,
        key=jax.random.key(1),
        stacked=kind == "device",
    )
    round_fn, store = inner, None
    if kind != "device":
        store = stored_round.make_store(kind, server.clients, num_clients, directory)
        store.start()
        round_fn = stored_round.StoredRoundFn(inner, store, num_clients, s)
        server = server.replace(clients=None)
    row["device_peak_bytes"] = peak_memory(round_fn.lower(server, data).compile())["peak_bytes"]
    return round_fn, server, data, store, row


def _timed_round(round_fn, server, data):
    start = time.perf_counter()
    server, metrics = round_fn(server, data)
    jax.block_until_ready(server)
    return server, metrics, time.perf_counter() - start


def run_case(args, num_clients: int, kind: str, directory: pathlib.Path) -> dict[str, Any]:
    """One (N, store) row, in this process."""
    round_fn, server, data, store, row = _setup(args, num_clients, kind, directory)
    if "skipped" in row:
        return row
    row["rss_start_bytes"] = _rss_bytes()
    times = []
    for r in range(args.rounds + 1):
        start = time.perf_counter()
        server, metrics = round_fn(server, data)
        jax.block_until_ready(server)
        if store is not None and r == args.rounds:
            round_fn.wait()
        if r:  # the first round compiles
            times.append(time.perf_counter() - start)
    row["round_s"] = float(np.median(times))
    row["train_loss"] = float(metrics["train_loss"])
    row["rss_bytes"] = _rss_bytes()
    if store is not None:
        round_fn.close()
    return row


def run_interleaved(
    args, num_clients: int, kinds: list[str], directory: pathlib.Path
) -> dict[str, float]:
    """The stores of one ``N`` in one process, their rounds taken in turn (``device``, ``host``,
    ``disk``, ``device``, ...): each store's median round time meets the same load as the
    others', which a machine shared with other jobs does not give rows measured one after
    another. The rounds of ``host`` and ``disk`` include their store's reads and writes (each
    round waits for the previous round's write before it returns its own)."""
    cases = {}
    for kind in kinds:
        round_fn, server, data, store, row = _setup(args, num_clients, kind, directory / kind)
        if "skipped" not in row:
            server, _, _ = _timed_round(round_fn, server, data)  # compiles
            cases[kind] = [round_fn, server, data, store, []]
    for _ in range(args.rounds):
        for case in cases.values():
            case[1], _, elapsed = _timed_round(*case[:3])
            case[4].append(elapsed)
    for case in cases.values():
        if case[3] is not None:
            case[0].close()
    return {kind: float(np.median(case[4])) for kind, case in cases.items()}


def _add_interleaved(rows: list[dict], n: int, done: subprocess.CompletedProcess) -> None:
    """The medians of the stores' rounds taken in turn (:func:`run_interleaved`) into the rows
    of ``N = n``."""
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{n}: the rounds taken in turn failed: {last}", flush=True)
        return
    medians = json.loads(done.stdout.strip().splitlines()[-1])
    for r in rows:
        if r["N"] == n and r["store"] in medians:
            r["round_s_in_turn"] = medians[r["store"]]
    print(f"{n}: rounds in turn, median s: {medians}", flush=True)


def _ratios(rows: list[dict]) -> None:
    for measured in ("round_s", "round_s_in_turn"):
        device = {r["N"]: r[measured] for r in rows if r["store"] == "device" and measured in r}
        for r in rows:
            if measured in r and r["N"] in device:
                r["vs_device" + measured.removeprefix("round_s")] = r[measured] / device[r["N"]]


def _table(rows: list[dict]) -> str:
    head = (
        "N        store   B/client  states MB  round s  vs device  in turn s  vs device  "
        "device MB  RSS MB  +MB"
    )
    lines = [head]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['N']:<8} {r['store']:<7} {r['bytes_per_client']:>8}  {r['skipped']}")
            continue
        ratio = f"{r['vs_device']:.2f}x" if "vs_device" in r else "-"
        in_turn = f"{r['round_s_in_turn']:.3f}" if "round_s_in_turn" in r else "-"
        turn_ratio = f"{r['vs_device_in_turn']:.2f}x" if "vs_device_in_turn" in r else "-"
        lines.append(
            f"{r['N']:<8} {r['store']:<7} {r['bytes_per_client']:>8} "
            f"{r['states_bytes'] / 1e6:>10.1f} {r['round_s']:>8.3f} {ratio:>10} "
            f"{in_turn:>10} {turn_ratio:>10} "
            f"{r['device_peak_bytes'] / 1e6:>10.1f} {r['rss_bytes'] / 1e6:>7.0f} "
            f"{(r['rss_bytes'] - r['rss_start_bytes']) / 1e6:>4.0f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench client_state")
    parser.add_argument("--clients", default="1000,10000", help="N values")
    parser.add_argument("--stores", default="device,host,disk")
    parser.add_argument("--workload", default="lenet5", choices=sorted(WORKLOADS))
    parser.add_argument("--clients-per-round", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up")
    parser.add_argument("--dir", default=None, help="the disk store's folder (default: a temp)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "N,store"
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.child:
        n, kind = args.child.split(",")
        if kind == "interleaved":
            kinds = args.stores.split(",")
            print(json.dumps(run_interleaved(args, int(n), kinds, pathlib.Path(args.dir))))
        else:
            print(json.dumps(run_case(args, int(n), kind, pathlib.Path(args.dir))))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for n in [int(v) for v in args.clients.split(",")]:
            for kind in [*args.stores.split(","), "interleaved"]:
                directory = pathlib.Path(args.dir or scratch) / f"{n}_{kind}"
                command = [
                    sys.executable,
                    "-m",
                    "experiments.bench",
                    "client_state",
                    *argv,
                    f"--child={n},{kind}",
                    f"--dir={directory}",
                ]
                done = subprocess.run(command, capture_output=True, text=True)
                if kind == "interleaved":
                    _add_interleaved(rows, n, done)
                    continue
                if done.returncode:
                    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    rows.append(
                        {"N": n, "store": kind, "bytes_per_client": 0, "skipped": f"failed: {last}"}
                    )
                else:
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(_table(rows[-1:]).splitlines()[-1], flush=True)
    _ratios(rows)
    print()
    print(_table(rows))
    if args.json:
        write_json(args.json, {"client_state": rows, "backend": jax.default_backend()})
        print(f"\nwrote {args.json}")
    return 0
