"""The runner (issue 4): the README's main job learns, runs resume bit for bit, workdirs are
guarded, outputs follow the DESIGN.md contract.

The main job is ``python -m experiments.main --config=configs/fedpac_soap.py``; here it runs
in-process for its first 10 rounds (same trajectory as the full run: the learning rate is
constant). The full default (30 rounds, seed 42) ends at test accuracy 0.969 (measured with this
commit on 2 CPU cores; rounds 10/20/30: 0.908/0.942/0.969).
"""

import importlib.util
import json
import pathlib

import ml_collections
import pytest

from fedorth import train
from fedorth.train import builders, loop

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
CONTRACT_KEYS = (
    "round",
    "train_loss",
    "test_loss",
    "test_accuracy",
    "comm_mb_up",
    "comm_mb_down",
    "wall_s",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_BUILD = builders.build  # the unpatched builder


def get_config(name: str, arg: str | None = None):
    """``configs/<name>.py[:arg]`` loaded by path, as ``config_flags`` does."""
    spec = importlib.util.spec_from_file_location(f"_test_runner_{name}", CONFIG_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def read_rows(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


class Stop(Exception):
    """Stands for the process being stopped between two rounds."""


def patch_round_fn(monkeypatch, *, stop_after: int | None = None) -> list[int]:
    """Wraps the built round function: records the round it starts from, raises ``Stop`` once
    ``stop_after`` rounds are done. Returns the list of recorded rounds."""
    calls: list[int] = []

    def patched_build(config):
        experiment = _BUILD(config)
        round_fn = experiment.round_fn

        def wrapped(server, data):
            if stop_after is not None and int(server.round) == stop_after:
                raise Stop
            calls.append(int(server.round))
            return round_fn(server, data)

        wrapped.place = round_fn.place  # the loop places the server state where rounds read it
        wrapped.strategy, wrapped.devices = round_fn.strategy, round_fn.devices
        experiment.round_fn = wrapped
        return experiment

    monkeypatch.setattr(loop.builders, "build", patched_build)
    return calls


def test_main_job_learns_digits(tmp_path):
    """FedPAC_SOAP's default reaches test accuracy >= 0.8 (chance: 0.1) within 10 rounds."""
    config = get_config("fedpac_soap")
    config.fed.rounds = 10
    last = train.run(config, tmp_path)
    rows = read_rows(tmp_path)
    assert [row["round"] for row in rows] == [5, 10]
    for row in rows:
        assert not [k for k in CONTRACT_KEYS if k not in row], row
    assert last == rows[-1]
    assert last["test_accuracy"] >= 0.8, last
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG_MAGIC
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["fed"]["algorithm"] == "fedpac_soap" and saved["fed"]["rounds"] == 10
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10"]


def _small(name: str, *, rounds: int = 7):
    """6 clients, 3 per round, K = 3. ``<config>_cnn``: a small CNN with 2 clients per round, so
    that ``auto`` shards them over 2 of the 8 fake CPU devices."""
    config = get_config(name.removesuffix("_cnn"))
    config.data.num_clients = 6
    config.fed.clients_per_round = 3
    config.fed.local_steps = 3
    config.fed.rounds = rounds
    config.eval_every = 1
    config.checkpoint_every = 2
    config.model.hidden_sizes = (32,)
    if name.endswith("_cnn"):
        config.fed.clients_per_round = 2
        config.model = ml_collections.ConfigDict(
            {"name": "cnn", "features": (8, 16), "dense_sizes": (16,)}
        )
    return config


def _without_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


# fedmuon_bc keeps per-client momentum and control variates; fedpac_soap keeps SOAP's aligned
# state and the global direction: everything the server state can hold is checkpointed.
# orbax restores with asyncio tensorstore reads; once (1 of 2 full-suite runs under xdist) a
# stray read task was cancelled when its event loop closed and surfaced as an unraisable
# exception at teardown, after every assertion had passed: third-party noise, ignored here only.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("name", ["fedmuon_bc", "fedpac_soap", "fedpac_soap_cnn"])
def test_stopped_run_resumes_to_the_same_metrics(name, tmp_path, monkeypatch):
    """Stop after round 5, run the same command again: it restarts from checkpoint 4, and
    metrics.jsonl equals an uninterrupted run's, bit for bit (wall_s aside). run_info.json
    records the strategy "auto" chose: sequential for the MLPs, sharded over 2 devices for the
    CNN (whose FedPAC_SOAP state and host eigh/QR then live on a mesh, checkpoint included)."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train.run(_small(name), straight)
    info = json.loads((straight / "run_info.json").read_text())
    sharded = name.endswith("_cnn")
    assert info["strategy"] == ("sharded" if sharded else "sequential"), info
    assert info["round_devices"] == (["cpu:0", "cpu:1"] if sharded else ["cpu:0"])

    calls = patch_round_fn(monkeypatch, stop_after=5)
    with pytest.raises(Stop):
        train.run(_small(name), stopped)
    assert calls == [0, 1, 2, 3, 4]
    assert [row["round"] for row in read_rows(stopped)] == [1, 2, 3, 4, 5]
    assert sorted(int(p.name) for p in (stopped / "checkpoints").iterdir()) == [2, 4]

    calls = patch_round_fn(monkeypatch)
    last = train.run(_small(name), stopped)
    assert calls == [4, 5, 6], "the second run must resume from the round-4 checkpoint"
    assert _without_wall(read_rows(stopped)) == _without_wall(read_rows(straight))
    assert last == read_rows(stopped)[-1]
    # wall_s continues from the kept rows instead of restarting at 0.
    walls = [row["wall_s"] for row in read_rows(stopped)]
    assert walls == sorted(walls)

    calls = patch_round_fn(monkeypatch)
    assert train.run(_small(name), stopped) == last  # a finished run only re-reads its outputs
    assert calls == []


def test_workdir_of_another_config_is_refused_unless_overwrite(tmp_path):
    first = _small("fedavg", rounds=2)
    train.run(first, tmp_path)
    other = _small("fedavg", rounds=2)
    other.optim.learning_rate = 0.01
    with pytest.raises(train.WorkdirConflictError, match="different config"):
        train.run(other, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["learning_rate"] == 0.1
    train.run(other, tmp_path, overwrite=True)
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["learning_rate"] == 0.01
    rows = read_rows(tmp_path)
    assert [row["round"] for row in rows] == [1, 2]  # the old run's rows were discarded
    assert all(row["learning_rate"] == pytest.approx(0.01) for row in rows)
