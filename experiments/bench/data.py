"""``python -m experiments.bench data``: StackOverflow streamed per round, never loaded whole.

    python -m experiments.bench data [--clients 342477] [--clients_per_round 50] [--rounds 40]

Writes (once, cached in the system's temporary folder) a StackOverflow-shaped fixture in
FedJAX's SQLite layout: ``--clients`` users (StackOverflow's 342,477 by default), each with a
few short sentences (1 to 64, a geometric draw of mean 4; StackOverflow's own clients hold
397 on average, which makes a 30 GB file), and TFF's ``stackoverflow.word_count``. Then streams
it as a run does (``fedorth.data.load_streamed``, ``fedorth.train.feed.RoundFeed``): the index
of every client's id and count, then ``--rounds`` rounds of ``--clients_per_round`` sampled
users read, converted to TFF's word ids and put on the default device. Reports the index's
time, the clients/s and examples/s streamed (per second of wall clock and of the process's
CPU time), and the process's resident memory (RSS): at
start, after the index, and its peak, beside the bound ``O(S × max examples per client) +
O(N)``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import sqlite3
import tempfile
import time
import zlib

import jax
import msgpack
import numpy as np

from fedorth import data as data_lib
from fedorth.train import feed as feed_lib

STACKOVERFLOW_CLIENTS = 342_477
WORDS = [f"w{i}" for i in range(2000)]


def _rss_bytes() -> int:
    """The process's resident memory now (Linux ``/proc/self/statm``)."""
    pages = int(pathlib.Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _blob(sentences: list[bytes]) -> bytes:
    """FedJAX's client blob: zlib(msgpack({feature: array})), bytes arrays as extension 4."""
    flat = msgpack.packb(((len(sentences),), sentences), use_bin_type=True)
    return zlib.compress(msgpack.packb({"tokens": msgpack.ExtType(4, flat)}))


def write_fixture(directory: pathlib.Path, num_clients: int, seed: int = 0) -> float:
    """The fixture's files in ``directory`` (train, test, word counts); returns seconds taken."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "stackoverflow.word_count").write_text(
        "".join(f"{word} {len(WORDS) - i}\n" for i, word in enumerate(WORDS))
    )
    for split, count in (("train", num_clients), ("test", min(num_clients, 100))):
        path = directory / f"stackoverflow_{split}.sqlite"
        partial = path.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        connection = sqlite3.connect(partial)
        connection.execute(
            "CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY, data BLOB NOT "
            "NULL, num_examples INTEGER NOT NULL);"
        )
        sizes = np.minimum(rng.geometric(0.25, count), 64)
        lengths = rng.integers(3, 25, int(sizes.sum()))
        words = rng.integers(0, len(WORDS) + 200, int(lengths.sum()))  # some out of vocabulary
        rows, w, s = [], 0, 0
        for i, size in enumerate(sizes.tolist()):
            sentences = []
            for length in lengths[s : s + size].tolist():
                ids = words[w : w + length]
                sentences.append(" ".join(f"w{j}" for j in ids.tolist()).encode())
                w += length
            s += size
            rows.append((f"{i:08d}".encode(), _blob(sentences), size))
            if len(rows) == 10_000:
                connection.executemany("INSERT INTO federated_data VALUES (?, ?, ?)", rows)
                rows = []
        connection.executemany("INSERT INTO federated_data VALUES (?, ?, ?)", rows)
        connection.commit()
        connection.close()
        partial.rename(path)
    return time.perf_counter() - start


def fixture(num_clients: int, cache: pathlib.Path | None) -> tuple[pathlib.Path, float | None]:
    """The fixture's folder, written unless already cached there; seconds to write it (None:
    it was cached)."""
    root = cache or pathlib.Path(tempfile.gettempdir())
    directory = root / f"fedorth-bench-stackoverflow-{num_clients}"
    if (directory / "stackoverflow_test.sqlite").is_file():
        return directory, None
    return directory, write_fixture(directory, num_clients)


def stream_section(
    num_clients: int, clients_per_round: int, rounds: int, cache: pathlib.Path | None
) -> dict:
    """Streams ``rounds`` rounds of the fixture; rates and resident memory."""
    directory, write_s = fixture(num_clients, cache)
    rss_start = _rss_bytes()
    start = time.perf_counter()
    base, stream = data_lib.load_streamed(
        "stackoverflow",
        num_clients=num_clients,
        seed=0,
        stream=True,
        data_dir=directory,
    )
    index_s = time.perf_counter() - start
    rss_index = _rss_bytes()
    key = jax.random.key(0)
    feed_lib.round_clients(key, 0, num_clients, clients_per_round)  # compiled outside the timing
    examples, sample_s, read_s, read_cpu_s = 0, 0.0, 0.0, 0.0
    for r in range(1, rounds + 1):
        start = time.perf_counter()
        ids = feed_lib.round_clients(key, r, num_clients, clients_per_round)
        sample_s += time.perf_counter() - start
        start, cpu_start = time.perf_counter(), time.process_time()
        round_data = stream.round_data(base, ids)
        jax.block_until_ready(round_data.x_train)
        read_s += time.perf_counter() - start
        read_cpu_s += time.process_time() - cpu_start
        examples += int(np.asarray(round_data.client_size).sum())
    round_bytes = round_data.x_train.nbytes + round_data.y_train.nbytes
    stream.close()
    return {
        "num_clients": num_clients,
        "clients_per_round": clients_per_round,
        "rounds": rounds,
        "backend": jax.default_backend(),
        "fixture": str(directory),
        "fixture_write_s": write_s,
        "fixture_bytes": (directory / "stackoverflow_train.sqlite").stat().st_size,
        "num_examples": stream.num_examples,
        "max_examples_per_client": stream.max_size,
        "index_s": index_s,
        # The round's sampler (jax.random.choice without replacement: a permutation of the N
        # ids, O(N)), which the feed runs to know a round's clients ahead.
        "sample_s": sample_s / rounds,
        "clients_per_s": clients_per_round * rounds / read_s,
        "examples_per_s": examples / read_s,
        "round_s": read_s / rounds,
        # Per second of the process's CPU time: the rate of a core of its own, where the
        # machine's cores are shared (wall-clock rates then fall with the others' load).
        "clients_per_cpu_s": clients_per_round * rounds / read_cpu_s,
        "examples_per_cpu_s": examples / read_cpu_s,
        "round_bytes": round_bytes,
        "loaded_whole_bytes": stream.nbytes,
        "rss_start_bytes": rss_start,
        "rss_after_index_bytes": rss_index,
        "rss_peak_bytes": _peak_rss_bytes(),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``python -m experiments.bench data``."""
    parser = argparse.ArgumentParser(prog="python -m experiments.bench data")
    parser.add_argument("--clients", type=int, default=STACKOVERFLOW_CLIENTS, help="N")
    parser.add_argument("--clients_per_round", type=int, default=50, help="S")
    parser.add_argument("--rounds", type=int, default=40, help="rounds streamed and timed")
    parser.add_argument("--cache", default=None, help="folder of the fixture (default: tmp)")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cache = pathlib.Path(args.cache) if args.cache else None
    result = stream_section(args.clients, args.clients_per_round, args.rounds, cache)
    mb = 2**20
    written = result["fixture_write_s"]
    print(
        f"StackOverflow-shaped fixture: {result['num_clients']:,} clients, "
        f"{result['num_examples']:,} examples (at most {result['max_examples_per_client']} a "
        f"client), {result['fixture_bytes'] / mb:.0f} MB in {result['fixture']}"
        + (f" (written in {written:.0f} s)" if written is not None else " (cached)")
    )
    print("| what | value |\n| --- | --- |")
    print(f"| backend | {result['backend']} |")
    print(f"| index of every client (ids, counts) | {result['index_s']:.1f} s |")
    print(f"| sampling a round's clients (O(N)) | {result['sample_s']:.3f} s |")
    print(f"| clients streamed | {result['clients_per_s']:.0f} /s |")
    print(f"| examples streamed | {result['examples_per_s']:.0f} /s |")
    print(f"| clients streamed per CPU second | {result['clients_per_cpu_s']:.0f} |")
    print(f"| examples streamed per CPU second | {result['examples_per_cpu_s']:.0f} |")
    print(f"| one round's read (S = {result['clients_per_round']}) | {result['round_s']:.3f} s |")
    print(f"| one round's arrays | {result['round_bytes'] / mb:.2f} MB |")
    print(f"| every client loaded whole | {result['loaded_whole_bytes'] / mb:.0f} MB |")
    print(f"| RSS at start | {result['rss_start_bytes'] / mb:.0f} MB |")
    print(f"| RSS after the index | {result['rss_after_index_bytes'] / mb:.0f} MB |")
    print(f"| peak RSS | {result['rss_peak_bytes'] / mb:.0f} MB |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
