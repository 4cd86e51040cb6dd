"""``fed.client_state``: the clients' persistent states on the device, in host memory or on disk
(``fedorth.fed.client_store``).

Every store gives the device's bytes (SCAFFOLD with per-client momentum, FedDyn, and a
persistent Adam state put together as a user would); a disk store's write cut short is undone on
resume; a run killed (SIGKILL) and run again ends with the metrics of an uninterrupted run; each
store that cannot be made says so in one line, documented in docs/ERRORS.md (``python
tests/test_client_store.py`` rewrites its section).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reliability_helpers import compilation_cache_env

from fedorth import fed
from fedorth.fed import client_store, disk_store, start, stored_round
from fedorth.train.checkpoint import Checkpointer

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "ERRORS.md"
N, S, K, R = 7, 3, 2, 5


def _algorithms():
    return {
        "scaffold": fed.get_algorithm(
            "scaffold",
            {"name": "sgd", "momentum": 0.9},
            client_state="persistent",
            server_rule="partial",
        ),
        "feddyn": fed.get_algorithm("feddyn", {"name": "sgd"}),
        # A user's composition: FedAvg whose clients keep their own Adam state (int32 count).
        "persistent_adam": dataclasses.replace(
            fed.get_algorithm("fedavg", {"name": "adamw"}), start=start.Persistent()
        ),
    }


SETTINGS = dict(num_clients=N, clients_per_round=S, local_steps=K, learning_rate=0.05)


def _data():
    return jax.tree.map(jnp.asarray, fp.quadratic_clients(N, seed=3))


@functools.cache
def _device_run(name: str):
    """``R`` rounds of algorithm ``name`` with its clients' states on the device."""
    server, round_fn, _ = fp.start_rounds(_algorithms()[name], **SETTINGS)
    data, history = _data(), []
    for _ in range(R):
        server, metrics = round_fn(server, data)
        history.append(jax.device_get(metrics))
    return server, history


@functools.cache
def _rows_round(name: str):
    """The compiled round of ``name`` that reads and returns the sampled rows (one per
    algorithm: the stores and the tests share it)."""
    config = fed.RoundConfig(**SETTINGS, client_rows=True)
    return fed.make_round_fn(_algorithms()[name], fp.loss_fn, fp.batch_fn, config)


def _stored(name: str, kind: str, directory: pathlib.Path):
    """A store of ``kind``, its round, and the server state of round 0 (clients in the store)."""
    server = fed.init_server(
        _algorithms()[name],
        fp.zero_params(),
        {},
        num_clients=N,
        key=jax.random.key(0),
        stacked=False,
    )
    store = stored_round.make_store(kind, server.clients, N, directory)
    round_fn = stored_round.StoredRoundFn(_rows_round(name), store, N, S)
    return round_fn, server.replace(clients=None)


def _all_rows(store):
    return store.treedef.unflatten(store.read(np.arange(N)))


def _assert_same_bytes(expected, actual, what: str) -> None:
    assert jax.tree.structure(expected) == jax.tree.structure(actual), what
    for path, a, b in zip(
        [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(expected)],
        jax.tree.leaves(expected),
        jax.tree.leaves(actual),
        strict=True,
    ):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, path)
        assert a.tobytes() == b.tobytes(), f"{what}: leaf {path} differs"


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "persistent_adam"])
def test_host_and_disk_stores_give_the_devices_bytes(name, tmp_path):
    """Five rounds of 3 of 7 clients (consecutive rounds share clients: their rows come from the
    device while the store writes them): the server state, the metrics and every client's
    state equal the device store's, bit for bit."""
    reference, history = _device_run(name)
    for kind in ("host", "disk"):
        round_fn, server = _stored(name, kind, tmp_path / kind)
        round_fn.store.start()
        got = []
        for _ in range(R):
            server, metrics = round_fn(server, _data())
            got.append(jax.device_get(metrics))
        round_fn.wait()
        _assert_same_bytes(reference.clients, _all_rows(round_fn.store), f"{kind} clients")
        round_fn.close()
        _assert_same_bytes(
            reference.replace(clients=None, key=None),
            server.replace(key=None),
            f"{kind} server",
        )
        _assert_same_bytes(history, got, f"{kind} metrics")


def test_disk_store_returns_to_the_checkpoint_after_a_write_cut_short(tmp_path, monkeypatch):
    """Rounds 1-2 written, a checkpoint at 1, round 3's write stopped after its first leaf (a
    kill during the write): starting the store at step 1 gives the rows it had after round 1;
    with round 2's undo file gone it refuses in one line."""
    round_fn, server = _stored("scaffold", "disk", tmp_path)
    store = round_fn.store
    store.start()
    server, _ = round_fn(server, _data())
    round_fn.wait()
    store.saved([1])
    after_one = jax.tree.map(np.copy, _all_rows(store))
    server, _ = round_fn(server, _data())
    round_fn.wait()

    class Killed(Exception):
        pass

    def cut(array_store, ids, rows, round_index):
        array_store.arrays[0][ids] = rows[0]
        raise Killed

    monkeypatch.setattr(client_store.ArrayStore, "write", cut)
    with pytest.raises(Killed):
        round_fn(server, _data())
        round_fn.wait()
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "undo").iterdir()) == ["2.npz", "3.npz"]

    again, _ = _stored("scaffold", "disk", tmp_path)
    again.store.start(None, 1)
    _assert_same_bytes(after_one, _all_rows(again.store), "rewound to round 1")
    assert not list((tmp_path / "undo").iterdir())

    # Written up to round 3 again, with round 2's record lost: the store cannot return to 1.
    json_path = tmp_path / "store.json"
    json_path.write_text(json.dumps({**json.loads(json_path.read_text()), "last_round": 3}))
    with pytest.raises(client_store.ClientStoreError) as error:
        _stored("scaffold", "disk", tmp_path)[0].store.start(None, 1)
    assert "\n" not in str(error.value) and "rounds 2..3" in str(error.value)


def test_host_store_is_saved_and_restored_with_the_checkpoint(tmp_path):
    """A host store's arrays go into the orbax step: a run restored from step 2 (the process
    that held the arrays is gone after round 3) ends with the uninterrupted run's bytes."""
    reference, _ = _device_run("scaffold")
    round_fn, server = _stored("scaffold", "host", tmp_path)
    checkpointer = Checkpointer(tmp_path / "w", every=2, states=round_fn)
    assert checkpointer.restore_latest(server) is None  # starts the store at round 0
    for _ in range(3):  # round 3 is lost with the process
        server, _ = round_fn(server, _data())
        checkpointer.save(server)
    round_fn.close()
    checkpointer.close()

    round_fn, like = _stored("scaffold", "host", tmp_path)
    checkpointer = Checkpointer(tmp_path / "w", every=2, states=round_fn)
    server = checkpointer.restore_latest(like)
    assert int(server.round) == 2
    for _ in range(R - 2):
        server, _ = round_fn(server, _data())
    round_fn.close()
    checkpointer.close()
    _assert_same_bytes(reference.clients, _all_rows(round_fn.store), "restored host clients")
    _assert_same_bytes(reference.params, server.params, "restored host params")


def test_auto_takes_the_first_place_that_holds_the_states():
    """``auto``: device, else host, else disk, within half of each; one line with the estimate;
    a population that fits nowhere gets one line naming N, the bytes per client, the remedy."""
    here = pathlib.Path("/runs/client_state")
    gib = 2**30
    choose = lambda **free: client_store.choose(1000, 10**6, directory=here, **free)  # noqa: E731
    kind, line = choose(device_free=4 * gib, host_free=64 * gib, disk_free=500 * gib)
    assert kind == "device"
    assert line == (
        "fed.client_state=auto: device (1000 clients x 1.0 MB = 1.0 GB; free: device 4.3 GB, "
        "host 68.7 GB, disk 536.9 GB (/runs/client_state))."
    )
    assert choose(device_free=gib, host_free=64 * gib, disk_free=500 * gib)[0] == "host"
    assert choose(device_free=None, host_free=gib, disk_free=500 * gib)[0] == "disk"
    with pytest.raises(client_store.ClientStoreError) as error:
        client_store.choose(
            342477, 2 * 10**7, directory=here, device_free=gib, host_free=gib, disk_free=gib
        )
    assert "\n" not in str(error.value)
    assert "data.num_clients=342477 clients x 20.0 MB per client = 6.8 TB" in str(error.value)


def _disk_error(directory: pathlib.Path, num_clients: int = N) -> str:
    template = fed.init_server(
        _algorithms()["scaffold"],
        fp.zero_params(),
        {},
        num_clients=1,
        key=jax.random.key(0),
        stacked=False,
    ).clients
    with pytest.raises(client_store.ClientStoreError) as error:
        disk_store.DiskStore(template, num_clients, directory)
    return str(error.value)


def _errors(tmp: pathlib.Path) -> dict[str, str]:
    """The one-line messages of a store that cannot be made, by the case docs/ERRORS.md names."""
    (tmp / "a_file").write_text("")
    return {
        "`fed.client_state=disk` with `fed.client_state_dir` under a file": _disk_error(
            tmp / "a_file" / "store"
        ),
        "`fed.client_state=disk` for 10^15 SCAFFOLD clients (a disk too small)": _disk_error(
            tmp / "store", 10**15
        ),
        "`fed.client_state=auto` for 342,477 clients x 20 MB, 1 GiB free everywhere": str(
            pytest.raises(
                client_store.ClientStoreError,
                client_store.choose,
                342477,
                2 * 10**7,
                device_free=2**30,
                host_free=2**30,
                disk_free=2**30,
                directory=tmp / "store",
            ).value
        ),
    }


def _doc_row(description: str, message: str, tmp: pathlib.Path) -> str:
    text = message.replace(str(tmp), "$TMP").replace("|", "\\|")
    text = re.sub(r"has [\d.]+ [kMGT]?B free", "has $FREE free", text)  # this machine's disk
    return f"| {description} | error: {text} |"


def test_a_store_that_cannot_be_made_is_one_documented_line(tmp_path):
    for description, message in _errors(tmp_path).items():
        assert "\n" not in message and "fed.client_state" in message, message
        row = _doc_row(description, message, tmp_path)
        assert row in DOC.read_text(), (
            f"docs/ERRORS.md lacks (run python tests/test_client_store.py):\n{row}"
        )


# --------------------------------------------------------------------------------- the CLI

CLI_ARGS = (
    "--config=configs/scaffold.py",
    "--config.model.hidden_sizes=(16,)",
    "--config.data.num_clients=8",
    "--config.fed.clients_per_round=3",
    "--config.fed.local_steps=2",
    "--config.fed.rounds=12",
    "--config.checkpoint_every=4",
    "--config.eval_every=0",
)


def _rows(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        row.pop("wall_s", None)
        rows.append(row)
    return rows


def _command(workdir: pathlib.Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "experiments.main", *CLI_ARGS, f"--workdir={workdir}", *args]


ENV = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def killed_disk_run(tmp_path_factory, cli_compilation_cache):
    """An uninterrupted run (``auto``: the device), and a disk-store run killed with SIGKILL
    as its round 6 is written into the store (checkpoint 4; the undo file of round 6 is the
    first thing that write makes), then run again.

    The uninterrupted run and the run again, which run to their end, share the test process's
    compilation cache (tests/conftest.py's ``cli_compilation_cache``); the killed run, whose
    disk-store round no finished run compiled before it, compiles its own (a process killed
    while it writes a cache entry would leave it half written)."""
    tmp = tmp_path_factory.mktemp("client_state")
    cached = compilation_cache_env(cli_compilation_cache, ENV)
    reference = subprocess.run(
        _command(tmp / "reference"),
        cwd=REPO,
        env=cached,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr
    workdir = tmp / "disk"
    args = ("--config.fed.client_state=disk",)
    with open(tmp / "killed.log", "w") as log:
        proc = subprocess.Popen(_command(workdir, *args), cwd=REPO, env=ENV, stderr=log)
        deadline = time.monotonic() + 300
        while not (workdir / "client_state" / "undo" / "6.npz").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended early"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    killed_rounds = max(int(p.name) for p in (workdir / "checkpoints").iterdir())
    resumed = subprocess.run(
        _command(workdir, *args), cwd=REPO, env=cached, capture_output=True, text=True, timeout=300
    )
    return reference, proc, killed_rounds, resumed, workdir, tmp


def test_disk_run_killed_and_run_again_ends_as_an_uninterrupted_run(killed_disk_run):
    reference, killed, killed_rounds, resumed, workdir, tmp = killed_disk_run
    assert killed.returncode == -signal.SIGKILL
    assert killed_rounds < 12, "the run finished before the kill"
    assert resumed.returncode == 0, resumed.stderr
    assert "Resumed from round" in resumed.stderr
    assert _rows(workdir) == _rows(tmp / "reference")
    # The store's files hold the clients' states of the last round; its records end there.
    assert (workdir / "client_state" / "leaf_0.bin").stat().st_size > 0
    assert json.loads((workdir / "client_state" / "store.json").read_text())["last_round"] == 12


def test_auto_prints_its_choice_and_estimate_in_one_line(killed_disk_run):
    reference = killed_disk_run[0]
    lines = [line for line in reference.stderr.splitlines() if "fed.client_state=auto" in line]
    assert len(lines) == 1 and lines[0].startswith("fed.client_state=auto: device (8 clients x ")


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import rewrite_doc_section

    with tempfile.TemporaryDirectory() as directory:
        tmp = pathlib.Path(directory)
        rows = [_doc_row(d, m, tmp) for d, m in _errors(tmp).items()]
    body = (
        "\nWhere the clients' persistent states live (`fed.client_state`, "
        "`fedorth.fed.client_store`;\ndocs/guides/dataset.md), generated by `python "
        "tests/test_client_store.py`. Each ends the run\nwith exit code 1 before its first "
        "round.\n\n"
        "| bad input | message |\n| --- | --- |\n" + "\n".join(rows) + "\n"
    )
    rewrite_doc_section(DOC, "## Client-state stores", body)


def test_bench_rows_time_each_store_and_keep_device_memory_flat(tmp_path):
    """``python -m experiments.bench client_state``'s row (one process each; here in-process, a
    tiny MLP): the states' size from the algorithm, the round's device memory independent of
    ``N`` for ``host`` and ``disk`` (the round holds the sampled rows), a finite loss."""
    from experiments.bench import client_state as bench

    args = bench.parse_args(
        ["--workload=mlp_small", "--clients-per-round=2", "--local-steps=1", "--rounds=1"]
    )
    rows = {
        (n, kind): bench.run_case(args, n, kind, tmp_path / f"{n}_{kind}")
        for n, kind in ((8, "device"), (8, "disk"), (64, "disk"))
    }
    for row in rows.values():
        assert row["bytes_per_client"] > 0 and np.isfinite(row["train_loss"]) and row["round_s"] > 0
    assert rows[8, "disk"]["device_peak_bytes"] == rows[64, "disk"]["device_peak_bytes"]
    # The device round holds all 8 states, the disk store's the 2 sampled ones.
    held = rows[8, "device"]["device_peak_bytes"] - rows[8, "disk"]["device_peak_bytes"]
    assert held >= 6 * rows[8, "device"]["bytes_per_client"]


def test_bench_times_the_stores_in_turn_and_reads_their_ratio_from_those_rounds(tmp_path):
    """The stores of one ``N`` run in one process with their rounds taken in turn, so each meets
    the same load; the table's ``in turn`` ratio divides by the device's median of those rounds
    (not by the device row measured at another time)."""
    from experiments.bench import client_state as bench

    args = bench.parse_args(
        ["--workload=mlp_small", "--clients-per-round=2", "--local-steps=1", "--rounds=2"]
    )
    medians = bench.run_interleaved(args, 8, ["device", "disk"], tmp_path)
    assert sorted(medians) == ["device", "disk"] and all(t > 0 for t in medians.values())
    rows = [
        {"N": 8, "store": "device", "round_s": 1.0},
        {"N": 8, "store": "disk", "round_s": 4.0},
    ]
    done = subprocess.CompletedProcess([], 0, stdout=json.dumps({"device": 2.0, "disk": 2.5}))
    bench._add_interleaved(rows, 8, done)
    bench._ratios(rows)
    assert rows[1]["vs_device"] == 4.0 and rows[1]["vs_device_in_turn"] == 1.25


def test_a_sweep_refuses_a_store_off_the_device():
    """A sweep's rounds vmap its replicas' whole server states: host or disk is refused in one
    line before anything is built."""
    from configs import base
    from fedorth.sweep.grid import SweepError
    from fedorth.sweep.replicas import ReplicaRound

    config = base.get_base_config()
    config.fed.client_state = "disk"
    with pytest.raises(SweepError) as error:
        ReplicaRound([config], [{}], [], ["a"])
    assert "\n" not in str(error.value) and "fed.client_state='disk'" in str(error.value)
