"""Natural datasets streamed per round (``fedorth.data.stream``, ``fedorth.train.feed``): the
streamed round equals the round on the clients loaded whole, bit for bit (a CLI run on TFF's
EMNIST; the batches of every reader's datasets in-process), with and without prefetch; the
reader reads the sampled clients only; a failed read in the prefetch thread is one line."""

from __future__ import annotations

import json
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedorth import data as data_lib
from fedorth.data import natural
from fedorth.data import stream as stream_lib
from fedorth.fed import aggregation
from fedorth.train import feed as feed_lib
from tests.test_data_natural import (
    documented,
    emnist_clients,
    needs_h5py,
    needs_pyarrow,
    stack_clients,
    write_fedjax_sqlite,
    write_tff_h5,
)
from tests.test_data_natural import main as natural_main


def emnist_sizes(count: int, seed: int = 0) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    return {f"f{i:05d}": int(rng.integers(1, 9)) for i in range(count)}


def write_emnist(directory: pathlib.Path, writer, suffix: str, count: int = 12) -> None:
    rng = np.random.default_rng(1)
    sizes = emnist_sizes(count)
    names = {".h5": ("fed_emnist_train.h5", "fed_emnist_test.h5")}.get(
        suffix, ("federated_emnist_train.sqlite", "federated_emnist_test.sqlite")
    )
    writer(directory / names[0], emnist_clients(rng, sizes))
    writer(directory / names[1], emnist_clients(rng, {c: 2 for c in list(sizes)[:4]}))


def whole_and_streamed(name: str, directory, num_clients: int, **kwargs):
    (whole, none), (base, stream) = (
        data_lib.load_streamed(
            name,
            num_clients=num_clients,
            seed=0,
            stream=mode,
            data_dir=directory,
            dataset_kwargs=kwargs,
        )
        for mode in (False, True)
    )
    assert none is None and stream is not None
    return whole, base, stream


def assert_same_batches(whole, base, stream, clients_per_round: int, rounds: int = 3) -> None:
    """Every sampled client's batches (with and without replacement) from the streamed round
    equal those from the data loaded whole, and so do the test split and the counts."""
    np.testing.assert_array_equal(whole.client_size, base.client_size)
    assert whole.max_client_size == base.max_client_size == stream.max_size
    np.testing.assert_array_equal(whole.x_test, base.x_test)
    if whole.test_client is not None:
        np.testing.assert_array_equal(whole.test_client, base.test_client)
    np.testing.assert_array_equal(whole.x_train[:2], base.x_train)
    key = jax.random.key(3)
    samplers = [
        jax.jit(sample, static_argnums=3)
        for sample in (data_lib.sample_batch, data_lib.sample_batch_without_replacement)
    ]
    for r in range(rounds):
        ids = feed_lib.round_clients(key, r, whole.num_clients, clients_per_round)
        round_data = stream.round_data(base, ids)
        # fed.aggregation='examples' weighs the sampled clients by their global counts.
        ctx = types.SimpleNamespace(client_ids=jnp.asarray(ids), clients_per_round=len(ids))
        for client in ids:
            np.testing.assert_array_equal(
                aggregation.client_weight(ctx, round_data, jnp.int32(client)),
                aggregation.client_weight(ctx, whole, jnp.int32(client)),
            )
        for client in ids:
            batch_key = jax.random.fold_in(key, int(client))
            for sample in samplers:
                want = sample(whole, client, batch_key, 5)
                got = sample(round_data, client, batch_key, 5)
                for k in ("x", "y"):
                    np.testing.assert_array_equal(got[k], want[k])
    stream.close()


@needs_h5py
def test_streamed_emnist_batches_equal_loaded_whole_hdf5(tmp_path):
    write_emnist(tmp_path, write_tff_h5, ".h5")
    assert_same_batches(*whole_and_streamed("emnist", tmp_path, 10), 3)


def test_streamed_shakespeare_and_stackoverflow_sqlite_equal_loaded_whole(tmp_path):
    rng = np.random.default_rng(2)
    roles = {
        f"role{i}": {"snippets": np.array([bytes(rng.integers(32, 120, n)) for n in lens], object)}
        for i, lens in enumerate([[5, 200], [90], [3, 4, 170], [1]])
    }
    for split in ("train", "test"):
        write_fedjax_sqlite(tmp_path / f"shakespeare_{split}.sqlite", roles)
        write_fedjax_sqlite(tmp_path / f"stackoverflow_{split}.sqlite", stack_clients())
    # Shakespeare's windows are not one per snippet: the index converts each client once.
    assert_same_batches(*whole_and_streamed("shakespeare", tmp_path, 4), 2)
    # max_test: the same test examples drawn, without pooling every test client.
    so = whole_and_streamed("stackoverflow", tmp_path, 2, vocab_size=6, max_test=2)
    assert so[1].x_test.shape[0] == 2
    assert_same_batches(*so, 1)


def write_parquet(path, rows, row_group_size=None):
    """Numeric inputs, one row per example, in ``row_group_size`` row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({key: [row[key] for row in rows] for key in rows[0]})
    pq.write_table(table, path, row_group_size=row_group_size)


@needs_pyarrow
def test_streamed_parquet_reads_row_groups_and_equals_loaded_whole(tmp_path):
    rng = np.random.default_rng(4)
    rows = [
        {"writer_id": f"w{int(w)}", "image": rng.random(4).tolist(), "character": int(c)}
        for w, c in zip(rng.integers(0, 6, 40), rng.integers(0, 5, 40), strict=True)
    ]
    write_parquet(tmp_path / "train.parquet", rows, row_group_size=7)
    write_parquet(tmp_path / "test.parquet", rows[:5])
    kwargs = {"client_column": "writer_id", "label_column": "character", "num_classes": 5}
    assert_same_batches(*whole_and_streamed("parquet", tmp_path, 5, **kwargs), 3)


def test_prefetch_gives_the_rounds_read_in_the_main_thread(tmp_path):
    write_emnist(tmp_path, write_fedjax_sqlite, ".sqlite", count=30)
    base, stream = data_lib.load_streamed(
        "emnist", num_clients=30, seed=0, stream=True, data_dir=tmp_path
    )
    key = jax.random.key(5)
    with_thread = feed_lib.RoundFeed(base, stream, key, 30, 4, prefetch=True, rounds=4)
    rounds = [with_thread(r) for r in range(4)]
    assert with_thread._pending is None  # nothing read past the last round
    assert stream.reads == 4 * 4
    in_main = feed_lib.RoundFeed(base, stream, key, 30, 4, prefetch=False)
    for r in (0, 3, 1):  # in any order, as a resumed run asks
        for got, want in zip(jax.tree.leaves(in_main(r)), jax.tree.leaves(rounds[r]), strict=True):
            np.testing.assert_array_equal(got, want)
    in_main.close()


FAILED_READ = "a read that fails in the prefetch thread"


def test_a_failed_read_in_the_prefetch_thread_is_one_line(tmp_path):
    write_emnist(tmp_path, write_fedjax_sqlite, ".sqlite")
    base, stream = data_lib.load_streamed(
        "emnist", num_clients=10, seed=0, stream=True, data_dir=tmp_path
    )

    class ClosedAfterRoundOne:
        """The file, closed after round 0's three reads: round 1's fail in the thread."""

        def __init__(self, file):
            self.file, self.path, self.count = file, file.path, 0

        def read(self, client_id):
            self.count += 1
            if self.count == 4:
                self.file.close()
            return self.file.read(client_id)

        def close(self):
            self.file.close()

    stream.file = ClosedAfterRoundOne(stream.file)
    feed = feed_lib.RoundFeed(base, stream, jax.random.key(0), 10, 3, prefetch=True)
    feed(0)
    with pytest.raises(feed_lib.StreamReadError) as info:
        feed(1)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("reading the clients of round 2 from ")
    assert "ProgrammingError" in message and "--config.data.prefetch=False" in message
    documented(FAILED_READ, message, tmp_path)


def test_the_reader_reads_the_sampled_clients_only(tmp_path):
    """20,000 clients: the index comes from the file's counts, each round reads its S clients,
    and nothing else is read (two clients for the model's first examples)."""
    rng = np.random.default_rng(0)
    count = 20_000
    clients = {
        f"u{i:06d}": {"label": np.full(n, i % 62, np.int32), "pixels": np.zeros((n, 1, 1))}
        for i, n in enumerate(rng.integers(1, 4, count))
    }
    write_fedjax_sqlite(tmp_path / "federated_emnist_train.sqlite", clients)
    write_fedjax_sqlite(tmp_path / "federated_emnist_test.sqlite", dict(list(clients.items())[:3]))
    reads = []
    real = natural.SQLiteClientFile.read
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(natural.SQLiteClientFile, "read", lambda f, c: reads.append(c) or real(f, c))
        base, stream = data_lib.load_streamed(
            "emnist", num_clients=count, seed=0, stream=True, data_dir=tmp_path
        )
        train_reads = len(reads) - 3  # the test file's three clients
        assert train_reads <= 2, train_reads
        feed = feed_lib.RoundFeed(base, stream, jax.random.key(0), count, 8, prefetch=False)
        for r in range(3):
            round_data = feed(r)
            assert round_data.x_train.shape == (8 * stream.max_size, 1, 1, 1)
    assert stream.reads == 3 * 8 and len(reads) == 3 + train_reads + 3 * 8
    assert base.x_train.shape[0] == 2 and base.client_size.shape == (count,)
    feed.close()


SWEEP_STREAMED = "a sweep of a streamed dataset (`data.stream=true`, `emnist`)"


def test_a_sweep_refuses_a_streamed_dataset_in_one_line(tmp_path):
    from fedorth.train import builders
    from tests.test_reliability import tiny_config

    write_emnist(tmp_path, write_fedjax_sqlite, ".sqlite")
    config = tiny_config(
        **{
            "data.name": "emnist",
            "data.data_dir": str(tmp_path),
            "data.partition": "natural",
            "data.num_clients": 10,
            "data.stream": "true",
        }
    )
    experiment = builders.build(config)
    with pytest.raises(builders.ConfigError) as info:
        builders.refuse_stream(experiment)
    documented(SWEEP_STREAMED, "error: " + str(info.value), tmp_path)
    config.data.stream = "false"
    assert builders.refuse_stream(builders.build(config)).stream is None


STREAM_VALUE = "`data.stream='yes'`"
STREAM_UNNATURAL = "`data.stream='true'` on `data.name='digits'`"


def test_bad_stream_values_are_one_line():
    from tests.test_data_natural import config_error

    message = config_error(**{"data.stream": "yes"})
    documented(STREAM_VALUE, "error: " + message, pathlib.Path("/nonexistent"))
    message = config_error(**{"data.stream": "true"})
    documented(STREAM_UNNATURAL, "error: " + message, pathlib.Path("/nonexistent"))
    assert stream_lib.stream_mode("AUTO") == "auto" and stream_lib.stream_mode("False") is False


# ------------------------------------------------------------------------ a run, by the CLI


def run(directory: pathlib.Path, stream: str) -> list[dict]:
    """A CLI run of FedAvg on 10 writers, 3 per round, 3 rounds (``test_data_natural.main``)."""
    directory.mkdir()
    write_emnist(directory, write_tff_h5, ".h5")
    out = natural_main(
        directory,
        "--config.data.num_clients=10",
        "--config.fed.clients_per_round=3",
        "--config.fed.rounds=3",
        f"--config.data.stream={stream}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (directory / "run" / "metrics.jsonl").open()]
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


@pytest.mark.slow  # two runs of 3 rounds in fresh processes
@needs_h5py
def test_cli_streamed_run_equals_the_run_loaded_whole(tmp_path):
    streamed = run(tmp_path / "streamed", "true")
    whole = run(tmp_path / "whole", "false")
    assert [row["round"] for row in streamed] == [0, 1, 2, 3]
    assert streamed == whole  # every metric of every round, bit for bit
