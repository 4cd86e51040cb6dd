"""What the reliability tests share: the tiny config and its command line, a run's files, the
fixtures of the command-line runs, and the cases of docs/ERRORS.md with their messages.

The tests are in the files of the modules they test (tests/test_validate.py,
tests/test_builders.py, tests/test_checkpoint.py, tests/test_logging_utils.py, tests/test_loop.py,
tests/test_workdir.py, ...). tests/test_reliability.py re-exports these names, for the files that
import them from there, and ``python tests/test_reliability.py`` rewrites docs/ERRORS.md from the
cases here (:func:`write_doc`). Module-scoped fixtures are imported into each file that uses them.

Compilation, not training, is most of these tests' time, and they run few distinct programs (the
tiny FedAvg config above all) many times. In a test file that imports :func:`cache_every_program`
(autouse) every program goes to the suite's persistent compilation cache, so each ``train.run``
of a config already run, in that file or another, gets its round and evaluation from it. The
command-line runs share a cache folder of their own, one per test process (:func:`cli_env`),
filled by the reference run :func:`tiny_reference`, which also runs once per test process
(tests/conftest.py's ``cli_compilation_cache`` and ``tiny_reference_run``; JAX's cache keys
depend on the folder's path, so a copy of the folder would not serve). Other files' commands that
run to their end use it too (tests/test_trackers.py, tests/test_sweep.py,
tests/test_sweep_shard.py, tests/test_data_stream_runs.py, tests/test_client_store.py): each
program has its own key, so they only add entries. JAX writes a cache entry non-atomically, so a
process killed while writing one would leave a partial entry that later processes warn about. A
process here that is killed (SIGKILL, a second Ctrl-C) runs the reference run's programs, which
ran to its end, and a few the reference does not run (it saves every round, the killed runs do
not), which it compiles and writes in its first rounds, before it is stopped; elsewhere a killed
command gets the folder only after the same command ran to its end there (it then only reads);
tests/test_signals.py's Ctrl-C during the first compilation runs without the cache. Every run
killed or stopped here is of the tiny config: a FedPAC_SOAP round calls host LAPACK, which the
persistent cache does not keep, so each process would compile it again.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import pytest

from configs import base, fedpac_soap
from fedorth import data as data_lib
from fedorth import fed, models, train
from fedorth.fed import local
from fedorth.train import builders, loop, validate
from fedorth.train.checkpoint import Checkpointer

REPO = pathlib.Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "ERRORS.md"
_UNPATCHED_BUILD = builders.build


# ---------------------------------------------------------------------------------------------
# Configs: tiny, so that every run here compiles and trains in seconds on 2 CPU cores.


def tiny_config(**overrides):
    """FedAvg + SGD, MLP(16) on the embedded digits: 4 clients, 2 per round, 3 local steps."""
    config = base.get_base_config()
    config.data.num_clients = 4
    config.fed.clients_per_round = 2
    config.fed.local_steps = 3
    config.fed.rounds = 4
    config.model.hidden_sizes = (16,)
    config.eval_every = 1
    config.checkpoint_every = 1
    return apply(config, overrides)


def apply(config, overrides: dict):
    for dotted, value in overrides.items():
        *sections, key = dotted.split(".")
        node = config
        for section in sections:
            node = node[section]
        node[key] = value
    return config


# configs/fedpac_soap.py (SOAP local steps with QR/eigh basis refreshes, averaged optimizer
# state) with small overrides (one dense layer: the model is not what is tested).
SOAP_OVERRIDES = {
    "data.num_clients": 4,
    "fed.clients_per_round": 2,
    "fed.local_steps": 3,
    "fed.rounds": 8,
    "checkpoint_every": 1,
    "eval_every": 1,
    "model.hidden_sizes": (),
    "optim.precondition_frequency": 2,
}


def soap_config():
    return apply(fedpac_soap.get_config(), SOAP_OVERRIDES)


# ---------------------------------------------------------------------------------------------
# A run's files.


def rows_of(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def without_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


def restore_latest(workdir: pathlib.Path, like):
    """``Checkpointer.restore_latest``, closing the checkpointer's orbax manager afterwards (an
    unclosed manager's async machinery was reported as "Event loop is closed", unraisable, at
    the setup of a later test on the same worker)."""
    checkpointer = Checkpointer(workdir, every=1)
    try:
        return checkpointer.restore_latest(like)
    finally:
        checkpointer.close()


def steps_in(workdir: pathlib.Path) -> list[int]:
    folder = workdir / "checkpoints"
    return (
        sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    )


def rounds_in(workdir: pathlib.Path) -> list[int]:
    try:
        return [row["round"] for row in rows_of(workdir)]
    except (OSError, ValueError):
        return []


def events_of(workdir: pathlib.Path) -> list[tuple[str, int, float]]:
    from fedorth.train.logging_utils import read_scalars

    return read_scalars(workdir / "tensorboard")


def copy_of(reference: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    workdir = tmp_path / "w"
    shutil.copytree(reference, workdir)
    return workdir


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def corrupt(step_dir: pathlib.Path, mode: str) -> None:
    """Damages an orbax step as a failing disk or a bad copy would.

    ``truncate``: cut its largest data file in half (orbax fails to read it). ``overwrite``: zero
    32 bytes in the middle of that file (orbax fails, or restores wrong values, depending on what
    they hit). ``swap``: replace its array data by that of the previous step, a valid store that
    orbax restores without complaint (only the digest saved with the step tells them apart).
    """
    if mode == "swap":
        previous = step_dir.parent / str(int(step_dir.name) - 1)
        shutil.rmtree(step_dir / "default")
        shutil.copytree(previous / "default", step_dir / "default")
        return
    data = max(
        (p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    raw = bytearray(data.read_bytes())
    if mode == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[len(raw) // 2 : len(raw) // 2 + 32] = bytes(32)
    data.write_bytes(bytes(raw))


def damage_metrics(workdir: pathlib.Path) -> list[bytes]:
    """A garbled line in the middle (round 2), a line that is not UTF-8, a cut last line (round
    4). Returns the three damaged lines."""
    lines = (workdir / "metrics.jsonl").read_bytes().splitlines()
    garbled, binary, cut = lines[2][:25] + b"#", b"\xff\xfe\x00 round", lines[4][:30]
    damaged = [lines[0], lines[1], garbled, binary, lines[3], cut]
    (workdir / "metrics.jsonl").write_bytes(b"\n".join(damaged))
    return [garbled, binary, cut]


# ---------------------------------------------------------------------------------------------
# Command-line runs (real processes and real files: started, stopped with os.kill,
# damaged, started again), and a real signal in this process.


def cli(workdir: pathlib.Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "experiments.main",
        "--config=configs/fedpac_soap.py",
        f"--workdir={workdir}",
        *args,
    ]


# The CLI equivalent of tiny_config(): configs/fedavg.py is the base config at lr 0.1.
TINY_ARGS = [
    "--config=fedavg",
    "--config.optim.learning_rate=0.05",
    "--config.data.num_clients=4",
    "--config.fed.clients_per_round=2",
    "--config.fed.local_steps=3",
    "--config.model.hidden_sizes=16,",
    "--config.eval_every=1",
]


# The scenario's run: checkpoints every 2 rounds, so that rows exist past the newest one; 12
# rounds leave time to stop it mid-run (it is frozen with SIGSTOP as soon as it gets there).
SCENARIO = {"fed.rounds": 12, "checkpoint_every": 2}
SCENARIO_ARGS = [*TINY_ARGS, "--config.fed.rounds=12", "--config.checkpoint_every=2"]


def tiny_cli(workdir, *args: str) -> list[str]:
    return [sys.executable, "-m", "experiments.main", *TINY_ARGS, f"--workdir={workdir}", *args]


def run_tiny_cli(workdir, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        tiny_cli(workdir, *args), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def wait_for(condition, proc, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def signal_during_round(monkeypatch, at_round: int) -> None:
    """Sends this process SIGINT while round ``at_round`` runs (a real signal, as Ctrl-C)."""

    def patched_build(config):
        experiment = _UNPATCHED_BUILD(config)
        round_fn = experiment.round_fn

        class Signalling:
            def __call__(self, server, data):
                if int(server.round) == at_round - 1:
                    os.kill(os.getpid(), signal.SIGINT)
                return round_fn(server, data)

            def __getattr__(self, name):
                return getattr(round_fn, name)

        experiment.round_fn = Signalling()
        return experiment

    monkeypatch.setattr(loop.builders, "build", patched_build)


# ---------------------------------------------------------------------------------------------
# Fixtures (see the module docstring for the compilation caches).


@pytest.fixture(scope="module", autouse=True)
def cache_every_program():
    """Every program this module compiles goes to the suite's persistent compilation cache
    (tests/conftest.py keeps only those that took 0.5 s or more; the tiny config's round and
    evaluation take less, and each ``train.run`` would compile them again). The suite's own
    folder only; restored after the module."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder or not pathlib.Path(folder).name.startswith("fedorth-xla-cache-"):
        yield
        return
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)


def compilation_cache_env(
    folder: pathlib.Path, base: dict[str, str] | None = None, *, at_once: bool = False
) -> dict[str, str]:
    """``base`` (this process's environment by default) with ``folder`` as the persistent
    compilation cache, every program cached.

    ``at_once``: for commands that run at the same time (a sweep's jobs). A size limit turns on
    JAX's file lock around each read and write of the folder, so that none reads an entry
    another is writing. Not for a command that may be frozen (SIGSTOP) while another needs the
    folder: it would hold the lock, and the other gives up after 10 s with a warning."""
    env = {
        **(os.environ if base is None else base),
        "JAX_COMPILATION_CACHE_DIR": str(folder),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    if at_once:
        env["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2**36)
    return env


@pytest.fixture(scope="module")
def cli_env(cli_compilation_cache) -> dict[str, str]:
    """The environment of the command-line runs: a persistent compilation cache folder of their
    own, one per test process (tests/conftest.py's ``cli_compilation_cache``), every program
    cached (see the module docstring for who may write to it)."""
    return compilation_cache_env(cli_compilation_cache)


@pytest.fixture(scope="module")
def tiny_reference(tiny_reference_run):
    """``tiny_config()`` run by its command (``TINY_ARGS``, 4 rounds, a checkpoint every round);
    it fills ``cli_env``'s cache with the programs of the tiny config's run from its start. Run
    once per test process (tests/conftest.py's ``tiny_reference_run``): every file that asks for
    it gets the same folder, to read or copy."""
    return tiny_reference_run


@pytest.fixture(scope="module")
def scenario_reference(tmp_path_factory):
    """The scenario's config run straight through, in this process."""
    workdir = tmp_path_factory.mktemp("scenario_reference")
    train.run(tiny_config(**SCENARIO), workdir)
    return workdir


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory, cli_env, tiny_reference):
    """One workdir, ``--workdir=~/run`` with HOME in a temporary folder, four processes:

    1. runs until TensorBoard holds a round newer than the newest checkpoint, then is frozen
       (SIGSTOP: it still holds the workdir);
    2. the same command meanwhile: refused;
    3. 1 is killed (SIGKILL: its lock is left to the kernel); the same command again: resumes,
       and gets SIGTERM after a round past the one it resumed from;
    4. the same command again, its output closed after the first line (``| head -1``).
    """
    tmp = tmp_path_factory.mktemp("stopped_runs")
    home = tmp / "home"
    home.mkdir()
    env = {**cli_env, "HOME": str(home)}
    workdir = home / "run"
    command = [sys.executable, "-m", "experiments.main", *SCENARIO_ARGS, "--workdir=~/run"]
    out = {"workdir": workdir, "cwd": tmp}

    def start(**kwargs):
        return subprocess.Popen(command, cwd=tmp, env=env, text=True, **kwargs)

    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    first = start(**pipe)
    try:

        def past_checkpoint():
            steps = steps_in(workdir)
            return steps and max((s for _, s, _ in events_of(workdir)), default=-1) > max(steps)

        wait_for(past_checkpoint, first, "a TensorBoard round past a checkpoint")
        first.send_signal(signal.SIGSTOP)
        out["killed_events"] = events_of(workdir)
        out["killed_steps"] = steps_in(workdir)
        out["first_pid"] = first.pid
        out["second"] = subprocess.run(
            command, cwd=tmp, env=env, capture_output=True, text=True, timeout=300
        )
        out["lock_while_held"] = (workdir / "run.lock").read_text()
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    out["first_returncode"] = first.returncode

    third = start(**pipe)
    try:
        resumed_from = max(out["killed_steps"])
        out["third_first_line"] = third.stderr.readline()  # metrics.jsonl is resumed by then
        wait_for(lambda: max(rounds_in(workdir)) > resumed_from + 1, third, "a resumed round")
        third.send_signal(signal.SIGSTOP)  # a signal then lands mid-run, not after the last round
        third.send_signal(signal.SIGTERM)
        third.send_signal(signal.SIGCONT)
        third_out, third_err = third.communicate(timeout=300)
    finally:
        if third.poll() is None:
            third.kill()
            third.communicate()
    out["third"] = (third.returncode, third_err)
    out["third_steps"] = steps_in(workdir)
    out["third_rounds"] = rounds_in(workdir)

    fourth = start(**pipe)
    out["fourth_first_line"] = fourth.stderr.readline()
    fourth.stderr.close()
    fourth.stdout.close()
    out["fourth_returncode"] = fourth.wait(timeout=300)
    return out


# ---------------------------------------------------------------------------------------------
# docs/ERRORS.md: every message of the cases below, generated from them. Config validation:
# unknown names list the valid choices, out-of-range values name the field, the value and
# the valid range. Each case: (overrides of tiny_config, expected message line).


BAD_CONFIGS = [
    ({"fed.algorithm": "fedavgg"}, "fed.algorithm='fedavgg' is unknown; valid choices: {fed}."),
    ({"optim.name": "adam"}, "optim.name='adam' is unknown; valid choices: {optim}."),
    ({"model.name": "resnet50"}, "model.name='resnet50' is unknown; valid choices: {models}."),
    ({"data.name": "cifar"}, "data.name='cifar' is unknown; valid choices: {data}."),
    ({"data.partition": "dir"}, "data.partition='dir' is unknown; valid choices: {partitions}."),
    ({"fed.strategy": "pmap"}, "fed.strategy='pmap' is unknown; valid choices: {strategies}."),
    ({"optim.schedule": "linear"}, "optim.schedule='linear' is unknown; valid choices: {lrs}."),
    (
        {"fed.options.alpha": 1.5, "fed.algorithm": "fedcm"},
        "fed.options.alpha=1.5 is out of range; valid: a number in [0, 1].",
    ),
    (
        {"optim.learning_rate": 0.0},
        "optim.learning_rate=0.0 is out of range; valid: a finite number > 0.",
    ),
    (
        {"optim.learning_rate": float("nan")},
        "optim.learning_rate=nan is out of range; valid: a finite number > 0.",
    ),
    (
        {"fed.clients_per_round": 5},
        "fed.clients_per_round=5 is out of range; valid: an integer in [1, 4] (<= data.num_clients",
    ),
    ({"fed.local_steps": 0}, "fed.local_steps=0 is out of range; valid: an integer >= 1."),
    ({"fed.rounds": 0}, "fed.rounds=0 is out of range; valid: an integer >= 1."),
    (
        {"data.alpha": 0.0},
        "data.alpha=0.0 is out of range; valid: a finite number > 0 (the Dirichlet",
    ),
    (
        {"fed.batch_size": 0},
        "fed.batch_size=0 is out of range; valid: an integer >= 1 (batches are drawn with repl",
    ),
    ({"eval_every": -1}, "eval_every=-1 is out of range; valid: an integer >= 0."),
    ({"checkpoint_every": -5}, "checkpoint_every=-5 is out of range; valid: an integer >= 0."),
    ({"optim.momentum": 1.5}, "optim.momentum=1.5 is out of range; valid: a number in [0, 1]."),
    (
        {"model.width": 2},
        "model has unknown keys ['width']; valid keys: ['dtype', 'hidden_sizes', 'num_classes'].",
    ),
    (
        {"fed.options.gamma": 0.1},
        "fed.options has unknown keys ['gamma']; valid keys: ['client_state', 'server_lr', "
        "'server_momentum', 'server_opt', 'server_rule'].",
    ),
    (
        {"fed.options.server_opt": "lamb"},
        "fed.options.server_opt='lamb'; valid: ('sgd', 'nesterov', 'adam', 'yogi', 'adagrad').",
    ),
    (
        {"fed.algorithm": "feddyn", "fed.options.alpha": 0.0},
        "fed.options.alpha=0.0 must be > 0 (FedDyn divides by it).",
    ),
    (
        {"fed.algorithm": "fednova", "optim.name": "adamw"},
        "fednova normalizes SGD's updates (heavy-ball momentum); got optim.name='adamw' (use "
        "optim.name='sgd').",
    ),
    (
        {"fed.algorithm": "fedadamw"},
        "fedadamw runs local AdamW: set optim.name='adamw', got 'sgd'.",
    ),
    (
        {"fed.options.server_opt": "adagrad", "fed.options.server_b2": 0.9},
        "fed.options.server_b2 does not apply to fed.options.server_opt='adagrad'; its keys: "
        "server_lr, server_b1, server_tau.",
    ),
    (
        {"fed.algorithm": "fedmuon_zg", "optim.name": "muon"},
        "fedmuon_zg is defined for full participation only",
    ),
    (
        {"fed.aggregation": "median"},
        "fed.aggregation='median' is unknown; valid choices: ['examples', 'uniform'].",
    ),
    (
        {"fed.aggregation": "examples", "fed.algorithm": "feddyn"},
        "fed.aggregation='examples': feddyn combines the clients' updates with its own rule",
    ),
    (
        {"fed.aggregation": "examples", "dp.clip_norm": 1.0, "dp.noise_multiplier": 1.0},
        "fed.aggregation='examples' with dp: DP-FedAvg's fixed denominator needs every client",
    ),
]


REGISTRIES = {
    "fed": sorted(fed.ALGORITHMS),
    "optim": sorted(local.DIRECTIONS),
    "models": sorted(models.MODELS),
    "data": sorted(data_lib.DATASETS),
    "partitions": sorted(data_lib.PARTITIONERS),
    "strategies": sorted(fed.STRATEGIES),
    "lrs": sorted(builders.SCHEDULES),
}


def config_error(overrides: dict) -> str:
    with pytest.raises(validate.ConfigError) as info:
        validate.validate(tiny_config(**overrides))
    return str(info.value)


def lapack_threads_message() -> str:
    before = os.environ.get("FEDORTH_LAPACK_THREADS")
    os.environ["FEDORTH_LAPACK_THREADS"] = "many"
    try:
        return "error: " + config_error({})
    finally:
        os.environ["FEDORTH_LAPACK_THREADS"] = before if before is not None else "1"


def typo_key_message(workdir: pathlib.Path) -> str:
    argv = cli(workdir, "--config.fed.typo=1")[2:]
    return "error: " + validate.unknown_override_message(argv)


def missing_data_message(data_dir: pathlib.Path) -> str:
    with pytest.raises(data_lib.DatasetNotPreparedError) as info:
        builders.build_data(
            tiny_config(**{"data.name": "cifar10", "data.data_dir": str(data_dir)}), 0
        )
    return "error: " + str(info.value)


# lr 0 in round 1 (warmup from 0), then 2.5e11: round 2's local steps overflow to NaN.
DIVERGING = {
    "optim.learning_rate": 1e12,
    "optim.schedule": "warmup_cosine",
    "optim.warmup_rounds": 4,
}


def divergence_message(workdir: pathlib.Path) -> str:
    with pytest.raises(train.DivergenceError) as info:
        train.run(tiny_config(**DIVERGING), workdir)
    return "error: " + str(info.value)


def corrupted_checkpoint_warning(workdir: pathlib.Path, caplog, mode: str = "swap") -> str:
    corrupt(workdir / "checkpoints" / "4", mode)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train.run(tiny_config(), workdir)
    ours = [r for r in caplog.records if r.name == "root" and r.levelno == logging.WARNING]
    return "\n".join(r.getMessage() for r in ours)


def conflict_message(workdir: pathlib.Path) -> str:
    train.run(tiny_config(**{"fed.rounds": 2}), workdir)
    with pytest.raises(train.WorkdirConflictError) as info:
        train.run(tiny_config(**{"fed.rounds": 3, "eval_every": 0}), workdir)
    return "error: " + str(info.value)


def placeholders(message: str, workdir: pathlib.Path, holder: dict) -> str:
    """The lock message with the holder's details as $PID, $HOST, $STARTED, $COMMAND."""
    return (
        message.replace(str(workdir), "$WORKDIR")
        .replace(holder["command"], "$COMMAND")
        .replace(f"pid {holder['pid']}", "pid $PID")
        .replace(f"kill {holder['pid']}", "kill $PID")
        .replace(holder["host"], "$HOST")
        .replace(holder["started"], "$STARTED")
    )


def locked_message(workdir: pathlib.Path) -> str:
    """The refusal of a second lock on ``workdir`` (one process: flock locks belong to open
    files, so two opens of one file exclude each other), with the placeholders."""
    from fedorth.train import workdir as workdir_lib

    lock = workdir_lib.WorkdirLock(workdir)
    try:
        with pytest.raises(train.WorkdirLockedError) as info:
            workdir_lib.WorkdirLock(workdir)
        holder = json.loads((workdir / "run.lock").read_text())
    finally:
        lock.release()
    return placeholders("error: " + str(info.value), workdir, holder)


def workdir_message(workdir) -> str:
    with pytest.raises(train.WorkdirError) as info:
        train.run(tiny_config(), workdir)
    return str(info.value)


def metrics_damaged_warnings(workdir: pathlib.Path, caplog) -> str:
    """The warnings of a rerun after :func:`damage_metrics` (the file's time as <time>)."""
    damage_metrics(workdir)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train.run(tiny_config(), workdir)
    return re.sub(r"corrupt-\d{8}-\d{6}", "corrupt-<time>", "\n".join(warnings_of(caplog)))


def tensorboard_file_message(workdir: pathlib.Path) -> str:
    shutil.rmtree(workdir / "tensorboard", ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tensorboard").write_text("not a folder")
    return "error: " + workdir_message(workdir)


def config_in_checkpoint_message(workdir: pathlib.Path) -> str:
    (workdir / "config.json").unlink()
    with pytest.raises(train.WorkdirConflictError) as info:
        train.run(tiny_config(**{"optim.learning_rate": 0.01}), workdir)
    return "error: " + str(info.value)


def incomplete_checkpoint_warning(workdir: pathlib.Path, caplog) -> str:
    shutil.rmtree(workdir / "checkpoints" / "4")
    (workdir / "checkpoints" / "4").mkdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train.run(tiny_config(), workdir)
    return "\n".join(warnings_of(caplog))


def sizes(message: str) -> str:
    """The space figures of a full-disk message as $NEEDED and $FREE."""
    message = re.sub(r"\d+\.\d [kM]B(?= needed)", "$NEEDED", message)
    return re.sub(r"\d+\.\d [kM]B(?= free)", "$FREE", message)


def disk_full_message(tmp: pathlib.Path) -> str:
    """The message of a full disk during the save of round 5 after checkpoint 4 (for the doc;
    the test above fills a real disk)."""
    workdir = tmp / "w"
    checkpointer = Checkpointer(workdir, every=1)
    try:
        server = builders.init_server(builders.build(tiny_config()))
        checkpointer.save(server.replace(round=jnp.int32(4)))
        with pytest.raises(train.DiskFullError) as info:
            with loop._disk_space(checkpointer.directory / "5", 4_840, checkpointer):
                raise OSError(28, "No space left on device")
    finally:
        checkpointer.close()
    return sizes("error: " + str(info.value))


CLI_TYPO = "`--config.fed.typo=1` (a key the config does not define; exit code 2)"
MISSING_DATA = (
    "`--config.data.name=cifar10 --config.data.data_dir=$DATA_DIR`, nothing prepared there "
    "(exit code 1)"
)
DIVERGENCE = (
    "a learning rate that overflows: `optim.learning_rate=1e12`, `optim.schedule=warmup_cosine`, "
    "`optim.warmup_rounds=4` (exit code 1)"
)
CORRUPTED = (
    "the newest checkpoint's array data replaced by other valid data (a warning; the run resumes)"
)
CONFLICT = (
    "`fed.rounds=3 eval_every=0` in a workdir holding a run with `fed.rounds=2` (exit code 1)"
)
# The --config argument itself (fedorth.catalog.resolve_config; before JAX loads).
CONFIG_ARGUMENTS = {
    "`--config=configs/nope.py` (no such file; exit code 2)": "configs/nope.py",
    "`--config=configs/base.py` (a file that is not a config; exit code 2)": "configs/base.py",
    "`--config=fedpac_soap:nope` (a preset the config lacks; exit code 2)": "fedpac_soap:nope",
}
ROUNDS_COSINE = (
    "`fed.rounds=3` in a workdir holding a `fed.rounds=2` run with `optim.schedule=cosine` "
    "(exit code 1; with a constant or step schedule the run is extended instead)"
)
INTERRUPTED = "Ctrl-C during round 4 with `checkpoint_every=2` (exit code 130)"
LAPACK_THREADS = "`FEDORTH_LAPACK_THREADS=many` in the environment (exit code 2)"
# Workdir, results, signals, disk (section 6).
LOCKED = (
    "a second run on a workdir while a run holds it (exit code 1; a killed holder does not block)"
)
EMPTY_WORKDIR = "`--workdir=` (empty; exit code 2)"
TENSORBOARD_FILE = "a file named `tensorboard` in the workdir (exit code 2)"
METRICS_DAMAGED = (
    "`metrics.jsonl` with a garbled line, a line that is not UTF-8 and a cut last line "
    "(warnings; the run resumes)"
)
CONFIG_IN_CHECKPOINT = (
    "`optim.learning_rate=0.01` in a workdir whose `config.json` was deleted, holding a run at "
    "0.05 (exit code 1)"
)
INCOMPLETE = "an emptied newest checkpoint folder (a warning; the run resumes)"
DISK_FULL = "a full disk while a checkpoint is written (exit code 1)"


def config_argument_message(spec: str) -> str:
    from fedorth import catalog

    with pytest.raises(catalog.ConfigArgumentError) as info:
        catalog.resolve_config(spec)
    # The configs package's folder differs between checkouts and installs.
    return "error: " + str(info.value).replace(str(catalog.config_dir()), "$CONFIGS")


def rounds_cosine_message(workdir: pathlib.Path) -> str:
    cosine = {"optim.schedule": "cosine", "eval_every": 0, "checkpoint_every": 0}
    train.run(tiny_config(**{**cosine, "fed.rounds": 2}), workdir)
    with pytest.raises(train.WorkdirConflictError) as info:
        train.run(tiny_config(**{**cosine, "fed.rounds": 3}), workdir)
    return "error: " + str(info.value)


def interrupted_message(workdir: pathlib.Path) -> str:
    build = builders.build

    def interrupting_build(config):
        experiment = build(config)
        round_fn = experiment.round_fn

        class Interrupting:
            def __call__(self, server, data):
                if int(server.round) == 3:
                    raise KeyboardInterrupt
                return round_fn(server, data)

            def __getattr__(self, name):
                return getattr(round_fn, name)

        experiment.round_fn = Interrupting()
        return experiment

    loop.builders.build = interrupting_build
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            train.run(tiny_config(**{"fed.rounds": 6, "checkpoint_every": 2}), workdir)
    finally:
        loop.builders.build = build
    return str(info.value)


def _cell(text: str, tmp: pathlib.Path) -> str:
    for path, name in ((tmp / "tfds", "$DATA_DIR"), (tmp / "w", "$WORKDIR"), (tmp, "$TMP")):
        text = text.replace(str(path), name)
    return text.replace("|", "\\|").replace("\n", "<br>")


def _row(description: str, message: str, tmp: pathlib.Path) -> str:
    return f"| {description} | {_cell(message, tmp)} |"


def assert_documented(description: str, message: str, tmp: pathlib.Path) -> None:
    row = _row(description, message, tmp)
    assert row in DOC.read_text(), (
        f"docs/ERRORS.md lacks (run python tests/test_reliability.py):\n{row}"
    )


def config_rows() -> list[str]:
    rows = []
    for overrides, _ in BAD_CONFIGS:
        given = ", ".join(f"`{k}={v!r}`" for k, v in overrides.items())
        rows.append(
            _row(
                given + " (exit code 2)",
                "error: " + config_error(overrides),
                pathlib.Path("/nonexistent"),
            )
        )
    return rows


HEADER = """# Error messages

What fedorth says for each bad input that `tests/test_reliability.py` tries. Generated from the
test cases by `python tests/test_reliability.py`; `test_errors_doc_is_current` and each test's
`assert_documented` fail when a message changes and this file does not. Paths are written as
`$WORKDIR` (the `--workdir`) and `$DATA_DIR`.

From the command line (`python -m experiments.main ...`) these are printed as one message,
without a traceback, and the exit code is 2 for a bad config or `--workdir` and 1 for the others
(`fedorth.train.USER_ERRORS`); a run stopped by Ctrl-C exits with 130, by SIGTERM with 143. From
Python, `train.run` raises `ConfigError`, `WorkdirError` and `TrackerError` (each a
`ValueError`), `DatasetNotPreparedError`, `DivergenceError`, `WorkdirConflictError`,
`WorkdirLockedError`, `CheckpointError` or `DiskFullError` (an `OSError`), and `RunInterrupted`
(a `KeyboardInterrupt`) when a signal stopped it.

Config values are checked by `fedorth.train.validate` before anything is loaded or compiled;
every problem is listed at once, one per line. The fields are those of `configs/base.py` (the
cases below override the small FedAvg config of the tests).
"""


def write_doc() -> None:
    """Regenerates docs/ERRORS.md by running every case (about a minute)."""

    class Caplog:  # the records of a logging handler, like pytest's caplog
        def __init__(self):
            self.records = []
            self.handler = logging.Handler()
            self.handler.emit = self.records.append

        def clear(self):
            self.records.clear()

        def at_level(self, level):
            import contextlib

            @contextlib.contextmanager
            def ctx():
                root = logging.getLogger()
                root.addHandler(self.handler)
                old, root.level = root.level, level
                try:
                    yield
                finally:
                    root.removeHandler(self.handler)
                    root.level = old

            return ctx()

    runtime = []
    for description, make in (
        (CLI_TYPO, lambda tmp: typo_key_message(tmp / "w")),
        (MISSING_DATA, lambda tmp: missing_data_message(tmp / "tfds")),
        (DIVERGENCE, lambda tmp: divergence_message(tmp / "w")),
        (CONFLICT, lambda tmp: conflict_message(tmp / "w")),
        *(
            (description, lambda tmp, spec=spec: config_argument_message(spec))
            for description, spec in CONFIG_ARGUMENTS.items()
        ),
        (ROUNDS_COSINE, lambda tmp: rounds_cosine_message(tmp / "w")),
        (INTERRUPTED, lambda tmp: interrupted_message(tmp / "w")),
        (
            CORRUPTED,
            lambda tmp: (
                train.run(tiny_config(), tmp / "w"),
                corrupted_checkpoint_warning(tmp / "w", Caplog()),
            )[1],
        ),
        (LAPACK_THREADS, lambda tmp: lapack_threads_message()),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            runtime.append(_row(description, make(pathlib.Path(tmp)), pathlib.Path(tmp)))

    def finished(tmp: pathlib.Path) -> pathlib.Path:
        train.run(tiny_config(), tmp / "w")
        return tmp / "w"

    results = []
    for description, make in (
        (LOCKED, lambda tmp: locked_message(tmp / "w")),
        (EMPTY_WORKDIR, lambda tmp: "error: " + workdir_message("")),
        (TENSORBOARD_FILE, lambda tmp: tensorboard_file_message(tmp / "w")),
        (METRICS_DAMAGED, lambda tmp: metrics_damaged_warnings(finished(tmp), Caplog())),
        (CONFIG_IN_CHECKPOINT, lambda tmp: config_in_checkpoint_message(finished(tmp))),
        (INCOMPLETE, lambda tmp: incomplete_checkpoint_warning(finished(tmp), Caplog())),
        (DISK_FULL, disk_full_message),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(_row(description, make(pathlib.Path(tmp)), pathlib.Path(tmp)))
    table = "| bad input | message |\n| --- | --- |\n"
    generated = (
        HEADER
        + "\n## Config values\n\n"
        + table
        + "\n".join(config_rows())
        + "\n\n## Command line, data, divergence, checkpoints, workdir\n\n"
        + table
        + "\n".join(runtime)
        + "\n\n"
        + RESULTS_SECTION
        + table
        + "\n".join(results)
        + "\n"
    )
    # Sections written elsewhere (other test files' messages) are kept as they are.
    titles = {line for line in generated.splitlines() if line.startswith("## ")}
    kept = [
        "## " + part
        for part in DOC.read_text().split("\n## ")[1:]
        if "## " + part.splitlines()[0] not in titles
    ]
    DOC.write_text(generated + "".join("\n" + part.rstrip("\n") + "\n" for part in kept))


RESULTS_SECTION = """## Workdir, results, signals, full disk

One run writes to a workdir at a time: it holds `$WORKDIR/run.lock` (an operating-system lock,
released when the process ends however it ends, so a killed run never blocks the next one; the
file keeps the holder's pid, host, start time and command). A multi-process run takes it once, in
process 0. `metrics.jsonl` never loses a readable row: unreadable lines are moved beside it, rows
missing up to the restored checkpoint are rebuilt from the TensorBoard events (or, for the last
round, by evaluating its checkpoint), and the TensorBoard events are rewritten from
`metrics.jsonl` at every start, one value per round. Each checkpoint carries its run's config.
Ctrl-C or SIGTERM stops after the round in progress and saves it ("interrupted (SIGTERM) at round
r; the same command resumes from round r", exit code 130 or 143); a second one stops at once,
from the newest checkpoint; one that comes after the last round lets the run finish. A closed
output (`... | head`) does not stop a run. `$PID`, `$HOST`, `$STARTED`, `$COMMAND`, `$NEEDED`,
`$FREE` stand for the values of the moment.

"""
