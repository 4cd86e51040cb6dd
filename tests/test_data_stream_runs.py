"""Streamed runs (``data.stream``, ``fedorth.train.feed``) under the conditions a run meets:
killed with SIGKILL and run again by the same command (while the next round's clients are
prefetched, or read in the main thread), on a mesh of devices (``fed.strategy='sharded'``),
with the clients' states off the device (``fed.client_state=host|disk``). Each ends with the
bits of the run it stands for."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import scaffold
from fedorth.train import builders, feed
from fedorth.train.checkpoint import _DIGEST_KEY
from tests.test_data_natural import write_fedjax_sqlite
from tests.test_data_stream import write_emnist
from tests.test_reliability import compilation_cache_env, rows_of, steps_in, without_wall

REPO = pathlib.Path(__file__).resolve().parent.parent

# -------------------------------------------------------------- killed and run again, by the CLI

ROUNDS, EVERY = 6, 2
# SCAFFOLD, the clients' control variates on disk (fed.client_state=disk). The kill lands in
# the prefetch thread's read of round 4's clients (index), while round 3 computes (and the
# store gathers and writes rows): rows 0..3 were written, checkpoint 2 saved.
KILLED_READ = 4

CLI_ARGS = (
    "--config=configs/scaffold.py",
    "--config.fed.client_state=disk",
    "--config.data.name=emnist",
    "--config.data.partition=natural",
    "--config.data.num_clients=12",
    "--config.data.stream=true",
    "--config.fed.clients_per_round=3",
    f"--config.fed.rounds={ROUNDS}",
    "--config.fed.local_steps=2",
    "--config.fed.batch_size=4",
    "--config.model.hidden_sizes=(16,)",
    "--config.eval_every=1",
    f"--config.checkpoint_every={EVERY}",
)

# The killed process: the same command, with a SIGKILL sent to itself while it reads the
# clients of round KILLED_READ, after the first of them was read (the file mid-read); it exits
# 3 if that read came from another thread than the prefetch thread.
KILLER = """
import os, runpy, signal, sys, threading
from fedorth.data import stream
from fedorth.train import feed

killed_read = int(sys.argv[1])
thread_name = f"fedorth-prefetch-round-{killed_read}"
target = {"round": None}
real_read, real_convert = feed.RoundFeed._read, stream.ClientStream._convert


def read(self, round_index):
    if round_index == killed_read:
        if threading.current_thread().name != thread_name:
            os._exit(3)
        target["round"] = round_index
    return real_read(self, round_index)


def convert(self, client_id):
    result = real_convert(self, client_id)
    if target["round"] is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    return result


feed.RoundFeed._read, stream.ClientStream._convert = read, convert
sys.argv = ["experiments.main", *sys.argv[2:]]
runpy.run_module("experiments.main", run_name="__main__", alter_sys=True)
"""

ENV = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def _command(data_dir: pathlib.Path, workdir: pathlib.Path, *args: str) -> list[str]:
    return [
        "-m",
        "experiments.main",
        *CLI_ARGS,
        f"--config.data.data_dir={data_dir}",
        f"--workdir={workdir}",
        *args,
    ]


def _run(argv: list[str], env: dict[str, str] = ENV) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def _final_digest(workdir: pathlib.Path) -> str:
    """The last checkpoint's SHA-256 over every leaf of the server state (saved with it, and
    checked against its files by every restore)."""
    step = workdir / "checkpoints" / str(ROUNDS) / "_CHECKPOINT_METADATA"
    return json.loads(step.read_text())["custom_metadata"][_DIGEST_KEY]


@pytest.fixture(scope="module")
def killed_streamed_run(tmp_path_factory, cli_compilation_cache):
    """An uninterrupted streamed run with the states on disk; the same command killed with
    SIGKILL while its prefetch thread reads round 5's clients, then run again by it.

    The three share the test process's compilation cache (tests/conftest.py's
    ``cli_compilation_cache``): the uninterrupted run, which runs to its end, writes its
    programs there, and the killed run, the same command, only reads them (a process killed
    while it writes an entry would leave it half written)."""
    tmp = tmp_path_factory.mktemp("streamed_runs")
    data_dir = tmp / "data"
    data_dir.mkdir()
    write_emnist(data_dir, write_fedjax_sqlite, ".sqlite")
    env = compilation_cache_env(cli_compilation_cache, ENV)
    reference = _run(_command(data_dir, tmp / "reference"), env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    workdir = tmp / "killed"
    command = _command(data_dir, workdir)
    killed = _run(["-c", KILLER, str(KILLED_READ), *command[2:]], env)
    steps, rows = steps_in(workdir), [row["round"] for row in rows_of(workdir)]
    resumed = _run(command, env)
    return tmp / "reference", (killed, steps, rows), resumed, workdir


@pytest.mark.slow  # three runs of 6 rounds in fresh processes
def test_streamed_run_killed_during_a_prefetch_ends_as_an_uninterrupted_run(killed_streamed_run):
    """The kill lands while the prefetch thread reads round 5's clients (round 4 computing);
    the same command resumes from checkpoint 2 (the store returns to it), reads rounds 3..
    again, and ends with the uninterrupted run's metrics, server state and clients' states, bit
    for bit. (``tests/test_client_store.py``: the disk store gives the device's bytes.)"""
    reference, (killed, steps, rows), resumed, workdir = killed_streamed_run
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert steps == [EVERY] and rows == [0, 1, 2, 3], (steps, rows)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from round {EVERY} in " in resumed.stderr
    assert without_wall(rows_of(workdir)) == without_wall(rows_of(reference))
    assert [row["round"] for row in rows_of(workdir)] == list(range(ROUNDS + 1))
    # Every round samples other clients: a round fed another round's clients would show.
    key = builders.run_key(scaffold.get_config())  # its seed: the command sets none
    samples = {tuple(feed.round_clients(key, r, 12, 3)) for r in range(ROUNDS)}
    assert len(samples) == ROUNDS
    # The last checkpoint's digest: its parameters and every other leaf, bit for bit; the
    # store's files: every client's control variate.
    assert _final_digest(workdir) == _final_digest(reference)
    leaves = sorted(p.name for p in (reference / "client_state").glob("leaf_*.bin"))
    assert leaves and leaves == sorted(p.name for p in (workdir / "client_state").glob("leaf_*"))
    for name in leaves:
        want = (reference / "client_state" / name).read_bytes()
        assert (workdir / "client_state" / name).read_bytes() == want, name


# ------------------------------------------------- a mesh of devices, the states off the device

SHARDED_ROUNDS = 3


def _scaffold_config(data_dir: pathlib.Path, **overrides):
    """SCAFFOLD (a control variate per client) on the 10 EMNIST writers, 4 per round: the
    ``sharded`` strategy splits them over 4 of the 8 CPU devices."""
    from configs import scaffold

    config = scaffold.get_config()
    config.data.update(name="emnist", partition="natural", num_clients=10, data_dir=str(data_dir))
    config.fed.update(
        clients_per_round=4, rounds=SHARDED_ROUNDS, local_steps=2, batch_size=4, strategy="sharded"
    )
    config.model.hidden_sizes = (16,)
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        config[section][key] = value
    return config


def _run_rounds(config, workdir: pathlib.Path):
    """``SHARDED_ROUNDS`` rounds as ``fedorth.train.loop`` runs them: the server state (every
    client's row read back from a store), and each round's metrics."""
    experiment = builders.with_client_store(builders.build(config), workdir)
    server = builders.init_server(experiment)
    feed = builders.round_feed(experiment)
    store = experiment.client_store
    if store is not None:
        store.start()
    history = []
    try:
        for r in range(SHARDED_ROUNDS):
            server, metrics = experiment.round_fn(server, feed(r))
            history.append(jax.device_get(metrics))
        if store is not None:
            experiment.round_fn.wait()
            ids = np.arange(experiment.round_config.num_clients)
            server = server.replace(clients=store.treedef.unflatten(store.read(ids)))
        return jax.device_get(server.replace(key=None)), history
    finally:
        feed.close()
        if store is not None:
            experiment.round_fn.close()


def _assert_same_bits(expected, actual, what: str) -> None:
    assert jax.tree.structure(expected) == jax.tree.structure(actual), what
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, jax.tree_util.keystr(path))
        assert a.tobytes() == b.tobytes(), f"{what}: {jax.tree_util.keystr(path)} differs"


@pytest.fixture(scope="module")
def emnist_dir(tmp_path_factory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("emnist")
    write_emnist(directory, write_fedjax_sqlite, ".sqlite")
    return directory


@pytest.fixture(scope="module")
def loaded_whole(emnist_dir, tmp_path_factory):
    """The rounds on the clients loaded whole, their states on the device."""
    config = _scaffold_config(emnist_dir, **{"data.stream": "false", "fed.client_state": "device"})
    return _run_rounds(config, tmp_path_factory.mktemp("whole"))


@pytest.mark.cpu_devices
def test_streamed_sharded_rounds_equal_the_rounds_on_the_data_loaded_whole(
    loaded_whole, emnist_dir, tmp_path
):
    """Three SCAFFOLD rounds split over 4 devices: the streamed rounds (each placed on the mesh
    by the prefetch thread) give the server state, every client's control variate and the
    metrics of the rounds on the clients loaded whole, bit for bit."""
    config = _scaffold_config(emnist_dir, **{"data.stream": "true", "fed.client_state": "device"})
    _assert_same_bits(loaded_whole, _run_rounds(config, tmp_path), "streamed, sharded")


@pytest.mark.cpu_devices
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_streamed_rounds_with_the_states_off_the_device_equal_the_device_store(
    kind, loaded_whole, emnist_dir, tmp_path
):
    """Streamed SCAFFOLD rounds, sharded over 4 devices, with the clients' control variates in
    host memory or on disk: the bits of the device store on the data loaded whole."""
    config = _scaffold_config(emnist_dir, **{"data.stream": "true", "fed.client_state": kind})
    _assert_same_bits(loaded_whole, _run_rounds(config, tmp_path), f"streamed, {kind}")
