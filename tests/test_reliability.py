"""Reliability of the runner (issue 9): bad input gets a clear error, a crash loses nothing, a run
is reproducible.

The error messages a user sees are listed in docs/ERRORS.md, generated from the cases of this file:
``python tests/test_reliability.py`` rewrites it, and ``test_errors_doc_is_current`` fails when
the doc and the messages drift apart.

Compilation, not training, is most of these tests' time, and they run few distinct programs (the
tiny FedAvg config above all) many times. In this process every program goes to
the suite's persistent compilation cache (:func:`cache_every_program`), so each ``train.run`` of
a config already run gets its round and evaluation from it. The command-line runs of the tiny
config share a cache folder of their own (:func:`cli_env`), filled by the reference run
:func:`tiny_reference`: JAX writes a cache entry non-atomically, so a process killed while
writing one would leave a partial entry that later processes warn about. A process here that is
killed (SIGKILL, a second Ctrl-C) runs the reference run's programs, which ran to its end, and a
few the reference does not run (it saves every round, the killed runs do not), which it compiles
and writes in its first rounds, before it is stopped. Every run killed or stopped here is of the
tiny config: a FedPAC_SOAP round calls host LAPACK, which the persistent cache does not keep, so
each process would compile it again.
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
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import fedorth
from configs import base, fedpac_soap
from fedorth import data as data_lib
from fedorth import fed, models, train
from fedorth.fed import local
from fedorth.train import builders, loop, validate
from fedorth.train import checkpoint as checkpoint_lib
from fedorth.train.checkpoint import Checkpointer, CheckpointError

REPO = pathlib.Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "ERRORS.md"
_UNPATCHED_BUILD = builders.build


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


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """The environment of this module's command-line runs: a persistent compilation cache folder
    of their own, every program cached (see the module docstring for who may write to it)."""
    folder = tmp_path_factory.mktemp("cli_compilation_cache")
    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(folder),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


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


def cli(workdir: pathlib.Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "experiments.main",
        "--config=configs/fedpac_soap.py",
        f"--workdir={workdir}",
        *args,
    ]


# ---------------------------------------------------------------------------------------------
# 1. Config validation: unknown names list the valid choices, out-of-range values name the field,
#    the value and the valid range. Each case: (overrides of tiny_config, expected message line).

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


@pytest.mark.parametrize(("overrides", "expected"), BAD_CONFIGS, ids=lambda x: str(x)[:40])
def test_bad_config_is_rejected_with_field_value_and_valid_range(overrides, expected):
    message = config_error(overrides)
    assert message.startswith("Invalid config:\n  "), message
    expected = expected.format(**REGISTRIES)
    assert expected in message, f"expected {expected!r} in:\n{message}"
    assert len(message.splitlines()) == 2, f"one problem, one line:\n{message}"


def lapack_threads_message() -> str:
    before = os.environ.get("FEDORTH_LAPACK_THREADS")
    os.environ["FEDORTH_LAPACK_THREADS"] = "many"
    try:
        return "error: " + config_error({})
    finally:
        os.environ["FEDORTH_LAPACK_THREADS"] = before if before is not None else "1"


def test_a_bad_lapack_thread_count_is_a_config_problem(tmp_path):
    """FEDORTH_LAPACK_THREADS is read when the round is lowered; the run checks it with the
    config, so a bad value is one line before anything is loaded or compiled."""
    message = lapack_threads_message()
    assert message.splitlines()[1:] == [
        "  FEDORTH_LAPACK_THREADS='many' must be a thread count >= 1 or 'auto' (the cores "
        "divided by the round's CPU devices)."
    ], message
    assert_documented(LAPACK_THREADS, message, tmp_path)


def test_every_problem_is_reported_at_once():
    message = config_error({"fed.rounds": 0, "optim.name": "adam", "eval_every": -1})
    assert len(message.splitlines()) == 4, message


def test_good_configs_pass():
    validate.validate(tiny_config())
    validate.validate(soap_config())
    for preset in ("cifar100_resnet18", "cifar100_vit", "tiny_imagenet_resnet18"):
        validate.validate(fedpac_soap.get_config(preset))


def test_run_validates_before_loading_or_compiling(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("build() ran before the config was validated")

    monkeypatch.setattr(builders, "build", fail)
    with pytest.raises(validate.ConfigError, match=r"fed\.local_steps=0"):
        train.run(tiny_config(**{"fed.local_steps": 0}), tmp_path / "w")
    assert not (tmp_path / "w").exists(), "nothing may be written for an invalid config"


def typo_key_message(workdir: pathlib.Path) -> str:
    argv = cli(workdir, "--config.fed.typo=1")[2:]
    return "error: " + validate.unknown_override_message(argv)


def test_cli_rejects_unknown_config_key(tmp_path):
    out = subprocess.run(
        cli(tmp_path / "w", "--config.fed.typo=1"), cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    expected = typo_key_message(tmp_path / "w")
    assert expected in out.stderr, out.stderr
    assert "config.fed has no key 'typo'" in expected and "'local_steps'" in expected
    assert_documented(CLI_TYPO, expected, tmp_path)


def test_model_name_override_drops_the_files_keys_of_another_model():
    """--config.model.name=cnn on an MLP config: the file's hidden_sizes is dropped (a locked
    config cannot lose keys on the command line); keys given on the command line are kept and
    still checked; without a model.name override nothing changes."""
    config = tiny_config(**{"model.name": "cnn"})
    config.lock()
    assert validate.drop_keys_of_another_model(config, {"model.name": "cnn"}) == [
        "model.hidden_sizes"
    ]
    assert sorted(config.model.keys()) == ["dtype", "name"]  # every model takes dtype
    validate.validate(config)

    config = tiny_config(**{"model.name": "cnn"})
    kept = {"model.name": "cnn", "model.hidden_sizes": (3,)}
    assert validate.drop_keys_of_another_model(config, kept) == []
    assert "model has unknown keys ['hidden_sizes']" in config_error({"model.name": "cnn"})

    config = tiny_config()
    assert validate.drop_keys_of_another_model(config, {"fed.rounds": 2}) == []
    assert validate.drop_keys_of_another_model(config, {"model.name": "mlp"}) == []
    assert config.model.hidden_sizes == (16,)


def test_cli_model_name_override_switches_the_model(tmp_path):
    # fed.rounds=0 stops at validation: it shows which model keys survive without a run.
    args = ["--config.model.name=cnn", "--config.fed.rounds=0"]
    out = subprocess.run(cli(tmp_path / "w", *args), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "the config file's ['model.hidden_sizes'] are not arguments" in out.stderr, out.stderr
    assert "fed.rounds=0 is out of range" in out.stderr and "unknown keys" not in out.stderr
    args = [*args, "--config.model.hidden_sizes=3"]
    out = subprocess.run(cli(tmp_path / "w", *args), cwd=REPO, capture_output=True, text=True)
    assert "model has unknown keys ['hidden_sizes']" in out.stderr, out.stderr


# ---------------------------------------------------------------------------------------------
# 2. Missing data, no network: one paragraph naming the dataset, the folder and the command.


def missing_data_message(data_dir: pathlib.Path) -> str:
    with pytest.raises(data_lib.DatasetNotPreparedError) as info:
        builders.build_data(
            tiny_config(**{"data.name": "cifar10", "data.data_dir": str(data_dir)}), 0
        )
    return "error: " + str(info.value)


def test_cli_missing_dataset_is_a_clear_error_without_traceback(tmp_path):
    data_dir = tmp_path / "tfds"
    args = ["--config.data.name=cifar10", f"--config.data.data_dir={data_dir}"]
    out = subprocess.run(cli(tmp_path / "w", *args), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    expected = missing_data_message(data_dir)
    assert expected in out.stderr, out.stderr
    for needed in ("'cifar10'", str(data_dir), f"tfds build cifar10 --data_dir={data_dir}"):
        assert needed in expected
    assert_documented(MISSING_DATA, expected, tmp_path)


# ---------------------------------------------------------------------------------------------
# 3. Divergence: stop at that round, name the round and the quantity, keep the good checkpoint.

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


def test_divergence_stops_at_the_round_and_keeps_the_last_good_checkpoint(tmp_path):
    workdir = tmp_path / "w"
    message = divergence_message(workdir)
    assert message.startswith(
        "error: Diverged at round 2: the mean local training loss (train_loss) is"
    )
    assert f"the last good checkpoint is round 1 in {workdir / 'checkpoints'}" in message
    assert steps_in(workdir) == [1], "round 2 must not be saved"
    rows = rows_of(workdir)
    assert [row["round"] for row in rows] == [0, 1], "round 2 must not be written"
    assert all(np.isfinite(v) for row in rows for v in row.values())
    experiment = builders.build(tiny_config(**DIVERGING))
    restored = restore_latest(workdir, builders.init_server(experiment))
    assert int(restored.round) == 1
    for leaf in jax.tree.leaves(restored.replace(key=jax.random.key_data(restored.key))):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert_documented(DIVERGENCE, message, tmp_path)
    # The folder says so, as a sweep's diverged replica does: experiments.report reads it.
    from experiments import report

    marker = json.loads((workdir / "diverged.json").read_text())
    assert marker["round"] == 2 and "train_loss" in marker["quantity"], marker
    status = report.load_run(workdir).status
    assert status is not None and status.startswith("diverged at round 2"), status


def test_divergence_in_parameters_or_state_names_the_leaf(tmp_path):
    experiment = builders.build(tiny_config(**{"fed.algorithm": "fedavgm"}))
    server = builders.init_server(experiment)
    checkpointer = Checkpointer(tmp_path, every=1)
    finite = {"train_loss": jnp.float32(1.0)}
    kernel = server.params["Dense_0"]["kernel"]
    bad = server.replace(
        params={
            **server.params,
            "Dense_0": {
                "bias": server.params["Dense_0"]["bias"],
                "kernel": kernel.at[0, 0].set(jnp.inf),
            },
        }
    )
    with pytest.raises(
        train.DivergenceError, match=r"round 7: params\['Dense_0'\]\['kernel'\] contains NaN/Inf"
    ):
        loop._check_finite(7, finite, bad, full_state=False, checkpointer=checkpointer)
    # Server momentum (FedAvgM) is only checked before a save: a checkpoint never holds NaN.
    trace = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), server.server_opt_state)
    bad_state = server.replace(server_opt_state=trace)
    loop._check_finite(3, finite, bad_state, full_state=False, checkpointer=checkpointer)
    with pytest.raises(train.DivergenceError, match=r"round 3: server\.server_opt_state"):
        loop._check_finite(3, finite, bad_state, full_state=True, checkpointer=checkpointer)
    checkpointer.close()


# ---------------------------------------------------------------------------------------------
# 4. Crash safety.


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


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory, cli_env):
    """``tiny_config()`` run by its command (``TINY_ARGS``, 4 rounds, a checkpoint every round);
    it fills ``cli_env``'s cache with the programs of the tiny config's run from its start."""
    workdir = tmp_path_factory.mktemp("tiny_reference") / "w"
    out = run_tiny_cli(workdir, "--config.fed.rounds=4", "--config.checkpoint_every=1", env=cli_env)
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir


def corrupted_checkpoint_warning(workdir: pathlib.Path, caplog, mode: str = "swap") -> str:
    corrupt(workdir / "checkpoints" / "4", mode)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train.run(tiny_config(), workdir)
    ours = [r for r in caplog.records if r.name == "root" and r.levelno == logging.WARNING]
    return "\n".join(r.getMessage() for r in ours)


# Reading a damaged checkpoint makes orbax's tensorstore reads fail inside its asyncio loop,
# which later schedules callbacks on the closed loop ("Event loop is closed", unraisable, in
# orbax's threads): third-party teardown noise, not a result of the code under test.
_ORBAX_DAMAGED_READ_NOISE = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


@_ORBAX_DAMAGED_READ_NOISE
@pytest.mark.parametrize("mode", ["swap", "truncate"])
def test_corrupted_latest_checkpoint_falls_back_with_a_warning(
    tmp_path, caplog, tiny_reference, mode
):
    workdir = tmp_path / "w"
    shutil.copytree(tiny_reference, workdir)
    warning = corrupted_checkpoint_warning(workdir, caplog, mode)
    assert f"Checkpoint {workdir / 'checkpoints' / '4'} is unreadable or corrupted" in warning
    assert "Resuming from checkpoint 3" in warning
    assert [p.name.split("-")[0] for p in (workdir / "checkpoints_unreadable").iterdir()] == ["4"]
    assert steps_in(workdir)[-1] == 4, "round 4 is recomputed and saved again"
    assert without_wall(rows_of(workdir)) == without_wall(rows_of(tiny_reference))
    if mode == "swap":
        assert "do not match the SHA-256 digest" in warning
        assert_documented(CORRUPTED, warning, tmp_path)


@_ORBAX_DAMAGED_READ_NOISE
@pytest.mark.parametrize("mode", ["truncate", "overwrite", "swap"])
def test_checkpointer_detects_damage_and_uses_the_previous_step(tmp_path, caplog, mode):
    experiment = builders.build(tiny_config())
    server = builders.init_server(experiment)
    checkpointer = Checkpointer(tmp_path, every=1)
    states = []
    for step in (1, 2, 3):
        server = server.replace(
            round=jnp.int32(step), params=jax.tree.map(lambda x: x + 1.0, server.params)
        )
        states.append(jax.device_get(server.params))
        checkpointer.save(server)
    checkpointer.close()
    corrupt(tmp_path / "checkpoints" / "3", mode)
    if mode == "swap":  # orbax alone restores step 2's values as step 3, silently
        saveable = checkpoint_lib._to_saveable(server)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, saveable)
        manager = ocp.CheckpointManager(tmp_path / "checkpoints")
        raw = manager.restore(3, args=ocp.args.StandardRestore(abstract))
        manager.close()
        jax.tree.map(np.testing.assert_array_equal, raw["server"].params, states[1])
    with caplog.at_level(logging.WARNING):
        restored = restore_latest(tmp_path, builders.init_server(experiment))
    assert "checkpoints/3 is unreadable or corrupted" in caplog.text
    assert int(restored.round) == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), states[1])
    # With every step damaged, resuming from scratch would silently discard the run: refuse.
    corrupt(tmp_path / "checkpoints" / "2", mode)
    corrupt(tmp_path / "checkpoints" / "1", "truncate")
    with pytest.raises(CheckpointError, match=r"None of the checkpoints \[2, 1\]"):
        restore_latest(tmp_path, builders.init_server(experiment))


def conflict_message(workdir: pathlib.Path) -> str:
    train.run(tiny_config(**{"fed.rounds": 2}), workdir)
    with pytest.raises(train.WorkdirConflictError) as info:
        train.run(tiny_config(**{"fed.rounds": 3, "eval_every": 0}), workdir)
    return "error: " + str(info.value)


def test_workdir_of_a_different_config_is_refused_unless_overwrite(tmp_path):
    workdir = tmp_path / "w"
    message = conflict_message(workdir)
    assert "fed.rounds: 2 there, 3 here" in message and "eval_every: 1 there, 0 here" in message
    assert "different config" in message
    assert [r["round"] for r in rows_of(workdir)] == [0, 1, 2], "the old run is untouched"
    assert json.loads((workdir / "config.json").read_text())["eval_every"] == 1
    train.run(tiny_config(**{"fed.rounds": 3, "eval_every": 0}), workdir, overwrite=True)
    assert json.loads((workdir / "config.json").read_text())["eval_every"] == 0
    # The old run's rows were discarded; the new one's (eval_every=0: only the last round).
    assert [r["round"] for r in rows_of(workdir)] == [3]
    assert steps_in(workdir)[-1] == 3
    assert_documented(CONFLICT, message, tmp_path)


def test_a_config_recorded_before_keys_were_added_is_the_same_config():
    """A run recorded before configs/base.py gained a key of ``loop.ADDED_KEYS`` (its config
    lacks the key, or a whole section such as ``dp``) is the same run as one with the key at its
    default, which computes what the run computed: it resumes. Any other value is a difference."""
    config = json.loads(json.dumps(tiny_config().to_dict()))  # as config.json holds it
    recorded = json.loads(json.dumps(config))  # what config.json held before the keys existed
    for key in loop.ADDED_KEYS:
        section, _, name = key.rpartition(".")
        (recorded[section] if section else recorded).pop(name)
    del recorded["dp"]
    assert loop._config_differences(recorded, config) == []
    changed = json.loads(json.dumps(config))
    changed["fed"]["aggregation"], changed["dp"]["clip_norm"] = "examples", 0.5
    assert loop._config_differences(recorded, changed) == [
        "dp.clip_norm: None there, 0.5 here",
        "fed.aggregation: 'uniform' there, 'examples' here",
    ]
    # The defaults are configs/base.py's.
    for key, value in loop.ADDED_KEYS.items():
        section, _, name = key.rpartition(".")
        assert (base.get_base_config()[section] if section else base.get_base_config())[
            name
        ] == value, key


def test_a_workdir_without_results_is_not_a_conflict(tmp_path):
    missing = tiny_config(**{"data.name": "cifar10", "data.data_dir": str(tmp_path / "tfds")})
    with pytest.raises(data_lib.DatasetNotPreparedError):
        train.run(missing, tmp_path / "w")
    assert (tmp_path / "w" / "config.json").exists() and not steps_in(tmp_path / "w")
    # Another config in the same workdir is not refused (it fails on its data again instead).
    missing.fed.rounds = 7
    with pytest.raises(data_lib.DatasetNotPreparedError):
        train.run(missing, tmp_path / "w")


def test_round_after_checkpoint_cannot_hang_in_batched_lapack():
    """Regression: the main job hung forever right after a checkpoint (round 41).

    Cause (gdb on a reproduction with checkpoint_every=1): not orbax or donation, but the two
    XLA:CPU intra-op threads both inside ``lapack_sgeqrf_ffi`` -> ``jax::ParallelBatchMap``,
    each waiting for batch chunks queued on the same, fully blocked pool (SOAP's vmapped QR basis
    refresh). Fixed in fedorth.optim.linalg (host LAPACK on CPU); here the compiled rounds of the
    algorithms with decompositions must contain no LAPACK custom call.
    """
    for overrides in ({}, {"fed.algorithm": "fedpac_soap_light"}):
        experiment = builders.build(apply(soap_config(), overrides))
        server = builders.init_server(experiment)
        text = experiment.round_fn.lower(server, experiment.data).as_text()
        assert "lapack" not in text, f"{overrides}: the round calls XLA:CPU's LAPACK kernels"
    # The check can see them: a vmapped jnp QR lowers to the (deadlock-prone) batched kernel.
    native = jax.jit(jax.vmap(jnp.linalg.qr)).lower(jnp.ones((2, 4, 4))).as_text()
    assert "lapack" in native


# ---------------------------------------------------------------------------------------------
# 5. Reproducibility.


def test_same_config_and_seed_give_identical_metrics(tmp_path, tiny_reference):
    train.run(tiny_config(), tmp_path / "again")
    assert without_wall(rows_of(tmp_path / "again")) == without_wall(rows_of(tiny_reference))
    assert (tmp_path / "again" / "curves.png").exists()


def test_workdir_records_config_version_and_commit(tiny_reference):
    config = json.loads((tiny_reference / "config.json").read_text())
    assert config == json.loads(json.dumps(tiny_config().to_dict(), default=str))
    info = json.loads((tiny_reference / "run_info.json").read_text())
    assert info["fedorth_version"] == fedorth.__version__
    commit = info["git_commit"]
    assert len(commit) == 40, commit
    # The commit the run used is HEAD or (others commit meanwhile) one of its ancestors.
    is_ancestor = ["git", "merge-base", "--is-ancestor", commit, "HEAD"]
    assert subprocess.run(is_ancestor, cwd=REPO, capture_output=True).returncode == 0
    assert isinstance(info["git_dirty"], bool)
    assert info["jax_version"] == jax.__version__


def test_different_seeds_give_different_partitions_inits_and_samples():
    def parts(seed):
        config = tiny_config(**{"seed": seed, "data.num_clients": 20, "fed.clients_per_round": 5})
        experiment = builders.build(config)
        server = builders.init_server(experiment)
        _, ids = fed.round.sample_clients(server.key, jnp.int32(0), 20, 5)
        batch = data_lib.sample_batch(experiment.data, 0, jax.random.fold_in(server.key, 0), 32)
        return experiment.data, experiment.init_params, ids, batch

    (d1, p1, ids1, b1), (d2, p2, ids2, b2) = parts(1), parts(2)
    assert not np.array_equal(d1.client_index, d2.client_index), "partitions"
    assert not np.array_equal(p1["Dense_0"]["kernel"], p2["Dense_0"]["kernel"]), "inits"
    assert not np.array_equal(ids1, ids2), "sampled clients"
    assert not np.array_equal(b1["x"], b2["x"]), "mini-batches"
    # ... and the same seed gives the same ones.
    d3, p3, ids3, b3 = parts(1)
    np.testing.assert_array_equal(d1.client_index, d3.client_index)
    np.testing.assert_array_equal(p1["Dense_0"]["kernel"], p3["Dense_0"]["kernel"])
    np.testing.assert_array_equal(ids1, ids3)
    np.testing.assert_array_equal(b1["x"], b3["x"])


# ---------------------------------------------------------------------------------------------
# 6. One writer per workdir, results that survive damage, signals, a full disk (real processes
#    and real files: started, stopped with os.kill, damaged, started again).

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


def events_of(workdir: pathlib.Path) -> list[tuple[str, int, float]]:
    from fedorth.train.logging_utils import read_scalars

    return read_scalars(workdir / "tensorboard")


def wait_for(condition, proc, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def rounds_in(workdir: pathlib.Path) -> list[int]:
    try:
        return [row["round"] for row in rows_of(workdir)]
    except (OSError, ValueError):
        return []


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


def test_a_second_run_on_a_workdir_is_refused_naming_the_holder(stopped_runs):
    second = stopped_runs["second"]
    assert second.returncode == 1, second.stderr
    assert "Traceback" not in second.stderr, second.stderr
    workdir, pid = stopped_runs["workdir"], stopped_runs["first_pid"]
    holder = json.loads(stopped_runs["lock_while_held"])
    assert holder["pid"] == pid and holder["host"] == os.uname().nodename
    message = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert message == [
        f"error: {workdir} is in use by another run (pid {pid} on host {holder['host']}, "
        f"started {holder['started']}: {holder['command']}). One run writes to a workdir at a "
        f"time: wait for it to end or stop it (kill {pid}; the same command resumes it), or use "
        "another --workdir."
    ], second.stderr
    assert_documented(LOCKED, placeholders(message[0], workdir, holder), stopped_runs["cwd"])


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


def test_a_killed_runs_lock_does_not_block_and_resume_matches(stopped_runs, scenario_reference):
    """A run killed with SIGKILL mid-run, then the same command: it resumes from the newest
    checkpoint, a save the kill cut is cleaned up, and the run ends with an uninterrupted run's
    config and metrics, bit for bit (JSON floats round-trip exactly; the wall clock aside).

    The killed run is the tiny FedAvg config, whose programs come from the command-line runs'
    compilation cache. The resumption of the state of SOAP-based algorithms (the bases, the
    aligned state, the global direction, on one device and sharded) bit for bit is
    tests/test_runner.py's ``test_stopped_run_resumes_to_the_same_metrics``; that their rounds
    give the same bits in another process, tests/test_fed_golden.py."""
    assert stopped_runs["first_returncode"] == -signal.SIGKILL
    returncode, stderr = stopped_runs["third"]
    resumed = f"Resumed from round {max(stopped_runs['killed_steps'])} in "
    assert stopped_runs["third_first_line"].startswith(resumed), stopped_runs["third_first_line"]
    assert "in use by another run" not in stderr, stderr
    assert stopped_runs["fourth_returncode"] == 0
    workdir = stopped_runs["workdir"]
    leftovers = [p.name for p in (workdir / "checkpoints").iterdir() if not p.name.isdigit()]
    assert not leftovers, f"a save cut by the kill must be cleaned up: {leftovers}"
    assert (workdir / "config.json").read_text() == (scenario_reference / "config.json").read_text()
    assert [r["round"] for r in rows_of(workdir)] == list(range(SCENARIO["fed.rounds"] + 1))
    assert without_wall(rows_of(workdir)) == without_wall(rows_of(scenario_reference))
    assert not list(stopped_runs["cwd"].glob("~*")), "--workdir=~/run is under $HOME"


def test_tensorboard_holds_one_value_per_round_after_kills(stopped_runs):
    """The killed run's events held a round past its newest checkpoint, which the resumed run
    computed again; a round's events that had not reached the file were lost."""
    killed = stopped_runs["killed_events"]
    assert max(s for _, s, _ in killed) > max(stopped_runs["killed_steps"])
    events = events_of(stopped_runs["workdir"])
    rows = rows_of(stopped_runs["workdir"])
    expected = sorted((key, row["round"]) for row in rows for key in row if key != "round")
    assert sorted((tag, step) for tag, step, _ in events) == expected, "one value per round"
    values = {(tag, step): value for tag, step, value in events}
    for row in rows:
        for key, value in row.items():
            if key != "round":  # TensorBoard stores float32
                assert values[(key, row["round"])] == pytest.approx(value, rel=1e-6)


def test_sigterm_saves_the_round_and_says_where_it_resumes(stopped_runs):
    returncode, stderr = stopped_runs["third"]
    assert returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr, stderr
    stopped_at = stopped_runs["third_rounds"][-1]
    assert stopped_at < SCENARIO["fed.rounds"]
    assert stderr.rstrip().endswith(
        f"interrupted (SIGTERM) at round {stopped_at}; the same command resumes from round "
        f"{stopped_at} ({stopped_runs['workdir']})."
    ), stderr
    assert max(stopped_runs["third_steps"]) == stopped_at, "the round it stopped at is saved"


def test_a_closed_output_does_not_stop_the_run(stopped_runs):
    """The fourth run's stderr was closed after its first line (``2>&1 | head -1``); it went on
    to the last round and exited 0 (its files are its result)."""
    assert stopped_runs["fourth_first_line"].startswith("Resumed from round")
    assert stopped_runs["fourth_returncode"] == 0
    assert rounds_in(stopped_runs["workdir"])[-1] == SCENARIO["fed.rounds"]


def test_second_ctrl_c_stops_at_once_without_traceback(tmp_path, cli_env, tiny_reference):
    workdir = tmp_path / "w"
    command = tiny_cli(workdir, "--config.fed.rounds=200", "--config.checkpoint_every=50")
    # faulthandler: a run that does not stop is ended with SIGABRT, which prints its threads.
    env = {**cli_env, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    seen = False
    try:
        wait_for(lambda: len(rounds_in(workdir)) > 2, proc, "round 2")
        proc.send_signal(signal.SIGINT)
        for line in proc.stderr:
            seen = line.startswith("SIGINT: stopping after the round in progress, saved")
            if seen:
                break
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=120)  # a run that does not stop fails, not hangs
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            stacks = proc.communicate(timeout=60)[1]
            pytest.fail(f"the run did not stop after the second Ctrl-C; its threads:\n{stacks}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert seen, "the first Ctrl-C says the run stops after the round in progress"
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert "\ninterrupted " in stderr and "the same command resumes from round" in stderr, stderr


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


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals need the main thread"
)
def test_ctrl_c_saves_the_round_it_ends_and_after_the_last_round_the_run_finishes(
    tmp_path, monkeypatch, tiny_reference, capsys
):
    workdir = tmp_path / "w"
    handler = signal.getsignal(signal.SIGINT)
    signal_during_round(monkeypatch, 2)
    with pytest.raises(train.RunInterrupted) as info:
        train.run(tiny_config(**{"checkpoint_every": 0}), workdir)
    assert str(info.value) == (
        f"interrupted (SIGINT) at round 2; the same command resumes from round 2 ({workdir})."
    )
    assert steps_in(workdir) == [2], "saved although checkpoint_every=0"
    assert "SIGINT: stopping after the round in progress, saved" in capsys.readouterr().err
    # Ctrl-C during the last round: the run has finished; it ends as finished.
    signal_during_round(monkeypatch, 4)
    last = train.run(tiny_config(**{"checkpoint_every": 0}), workdir)
    assert last["round"] == 4
    assert without_wall(rows_of(workdir)) == without_wall(rows_of(tiny_reference))
    err = capsys.readouterr().err
    assert (
        "interrupted" not in err and f"Finished round 4: train_loss {last['train_loss']:.4f}" in err
    )
    assert signal.getsignal(signal.SIGINT) is handler, "the handler is restored"


def test_empty_workdir_is_refused_and_tilde_is_expanded(tmp_path):
    out = subprocess.run(
        tiny_cli("", "--config.fed.rounds=1"), cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written into the current folder"
    message = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert message == ["error: " + workdir_message("")], out.stderr
    assert_documented(EMPTY_WORKDIR, message[0], tmp_path)
    assert loop.workdir_lib.resolve("~/x") == pathlib.Path.home() / "x"


def workdir_message(workdir) -> str:
    with pytest.raises(train.WorkdirError) as info:
        train.run(tiny_config(), workdir)
    return str(info.value)


def copy_of(reference: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    workdir = tmp_path / "w"
    shutil.copytree(reference, workdir)
    return workdir


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def damage_metrics(workdir: pathlib.Path) -> list[bytes]:
    """A garbled line in the middle (round 2), a line that is not UTF-8, a cut last line (round
    4). Returns the three damaged lines."""
    lines = (workdir / "metrics.jsonl").read_bytes().splitlines()
    garbled, binary, cut = lines[2][:25] + b"#", b"\xff\xfe\x00 round", lines[4][:30]
    damaged = [lines[0], lines[1], garbled, binary, lines[3], cut]
    (workdir / "metrics.jsonl").write_bytes(b"\n".join(damaged))
    return [garbled, binary, cut]


def metrics_damaged_warnings(workdir: pathlib.Path, caplog) -> str:
    """The warnings of a rerun after :func:`damage_metrics` (the file's time as <time>)."""
    damage_metrics(workdir)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train.run(tiny_config(), workdir)
    return re.sub(r"corrupt-\d{8}-\d{6}", "corrupt-<time>", "\n".join(warnings_of(caplog)))


def test_unreadable_metrics_lines_are_kept_aside_and_valid_rows_kept(
    tmp_path, caplog, tiny_reference
):
    """A garbled line in the middle, a line that is not UTF-8, a cut last line: every readable
    row stays, the unreadable lines go to metrics.jsonl.corrupt-<time> (one warning), the
    rows lost in them are rebuilt from TensorBoard's events (one warning)."""
    workdir = copy_of(tiny_reference, tmp_path)
    damaged = damage_metrics(copy_of(tiny_reference, tmp_path / "again"))
    warnings = metrics_damaged_warnings(workdir, caplog)
    rows, reference = rows_of(workdir), rows_of(tiny_reference)
    assert without_wall(rows) == without_wall(reference), "every row is back"
    assert [r["wall_s"] for r in rows] == pytest.approx([r["wall_s"] for r in reference])
    (aside,) = workdir.glob("metrics.jsonl.corrupt-*")
    assert aside.read_bytes().splitlines() == damaged
    moved, rebuilt = warnings.splitlines()
    assert moved == (
        f"{workdir / 'metrics.jsonl'}: 3 line(s) hold no readable row (cut by a kill, garbled, "
        "not UTF-8, or a second row of a round); moved to "
        f"{workdir / 'metrics.jsonl.corrupt-<time>'}, the 3 readable rows are kept."
    )
    assert rebuilt.startswith(f"{workdir / 'metrics.jsonl'} lacked the rows of rounds 2, 4; ")
    assert_documented(METRICS_DAMAGED, warnings, tmp_path)


def test_finished_runs_deleted_metrics_are_rebuilt(tmp_path, caplog, tiny_reference):
    """From TensorBoard's events when they hold the rows; without them, the last round's test
    metrics from its checkpoint (its training metrics are gone)."""
    workdir = copy_of(tiny_reference, tmp_path)
    (workdir / "metrics.jsonl").unlink()
    train.run(tiny_config(), workdir)
    assert without_wall(rows_of(workdir)) == without_wall(rows_of(tiny_reference))
    (workdir / "metrics.jsonl").write_text("")
    shutil.rmtree(workdir / "tensorboard")
    with caplog.at_level(logging.WARNING):
        train.run(tiny_config(), workdir)
    (row,) = rows_of(workdir)
    last = rows_of(tiny_reference)[-1]
    assert row == {k: v for k, v in last.items() if k.startswith(("test_", "comm_", "round"))}
    assert any("rebuilt it by evaluating checkpoint 4" in w for w in warnings_of(caplog))


def tensorboard_file_message(workdir: pathlib.Path) -> str:
    shutil.rmtree(workdir / "tensorboard", ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tensorboard").write_text("not a folder")
    return "error: " + workdir_message(workdir)


def test_tensorboard_path_that_is_a_file_is_one_line(tmp_path, tiny_reference):
    workdir = copy_of(tiny_reference, tmp_path)
    message = tensorboard_file_message(workdir)
    assert message == (
        f"error: {workdir / 'tensorboard'} is a file; the run writes its TensorBoard events into "
        "a folder of that name: move the file away (or delete it) and rerun."
    )
    assert_documented(TENSORBOARD_FILE, message, tmp_path)


def config_in_checkpoint_message(workdir: pathlib.Path) -> str:
    (workdir / "config.json").unlink()
    with pytest.raises(train.WorkdirConflictError) as info:
        train.run(tiny_config(**{"optim.learning_rate": 0.01}), workdir)
    return "error: " + str(info.value)


def test_checkpoint_carries_its_config_when_config_json_is_gone(tmp_path, tiny_reference):
    workdir = copy_of(tiny_reference, tmp_path)
    before = (workdir / "metrics.jsonl").read_text()
    message = config_in_checkpoint_message(workdir)
    assert message == (
        f"error: {workdir} holds a run of a different config (recorded in checkpoint 4: "
        "optim.learning_rate: 0.05 there, 0.01 here). Use another --workdir (this one keeps "
        "that run)."
    )
    assert (workdir / "metrics.jsonl").read_text() == before
    assert_documented(CONFIG_IN_CHECKPOINT, message, tmp_path)
    train.run(tiny_config(), workdir)  # the same config resumes, and config.json is back
    assert json.loads((workdir / "config.json").read_text())["optim"]["learning_rate"] == 0.05


def incomplete_checkpoint_warning(workdir: pathlib.Path, caplog) -> str:
    shutil.rmtree(workdir / "checkpoints" / "4")
    (workdir / "checkpoints" / "4").mkdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train.run(tiny_config(), workdir)
    return "\n".join(warnings_of(caplog))


def test_incomplete_newest_checkpoint_is_skipped_in_one_line(tmp_path, caplog, tiny_reference):
    """An emptied newest step folder: the previous one is used and the run ends as a straight
    run would; all damaged: refused, naming no remedy that discards the run."""
    workdir = copy_of(tiny_reference, tmp_path)
    warning = incomplete_checkpoint_warning(workdir, caplog)
    assert warning == (
        f"Checkpoint {workdir / 'checkpoints' / '4'} is incomplete: a save or copy that did "
        "not finish. Resuming from checkpoint 3; the skipped ones were moved to "
        f"{workdir / 'checkpoints_unreadable'}."
    )
    assert_documented(INCOMPLETE, warning, tmp_path)
    assert steps_in(workdir)[-1] == 4
    assert without_wall(rows_of(workdir)) == without_wall(rows_of(tiny_reference))
    for step in steps_in(workdir):
        shutil.rmtree(workdir / "checkpoints" / str(step) / "default")
    with pytest.raises(CheckpointError) as info:
        train.run(tiny_config(), workdir)
    assert "--overwrite" not in str(info.value) and "they are left as they are" in str(info.value)


@_ORBAX_DAMAGED_READ_NOISE
def test_cli_corrupted_checkpoint_fallback_is_one_line(tmp_path, tiny_reference, cli_env):
    workdir = copy_of(tiny_reference, tmp_path)
    corrupt(workdir / "checkpoints" / "4", "truncate")
    out = run_tiny_cli(workdir, "--config.fed.rounds=4", "--config.checkpoint_every=1", env=cli_env)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line and not line.startswith("[")]
    assert len(lines) == 3, out.stderr  # the fallback, "Resumed from round 3", "Finished"
    assert "checkpoints/4 is unreadable or corrupted" in lines[0] and "Resuming" in lines[0]
    assert lines[1] == f"Resumed from round 3 in {workdir}."
    last = rows_of(tiny_reference)[-1]
    assert lines[2] == (  # a finished run's summary: its last metrics and where its files are
        f"Finished round 4: train_loss {last['train_loss']:.4f}, test_loss "
        f"{last['test_loss']:.4f}, test_accuracy {last['test_accuracy']:.4f}. Metrics in "
        f"{workdir / 'metrics.jsonl'}, curves in {workdir / 'curves.png'}, TensorBoard events in "
        f"{workdir / 'tensorboard'}, checkpoint {workdir / 'checkpoints' / '4'}."
    )
    assert without_wall(rows_of(workdir)) == without_wall(rows_of(tiny_reference))


def test_full_disk_is_one_line_naming_file_space_and_last_checkpoint(
    small_disk, tiny_reference, cli_env
):
    """A finished 4-round run extended to 6 on a disk with room for its rows but not for a
    checkpoint: one line names the checkpoint that could not be written, the space, and the
    intact checkpoint 4."""
    workdir = small_disk / "w"
    shutil.copytree(tiny_reference, workdir)
    shutil.rmtree(workdir / "checkpoints" / "2")  # room for the run's small files only
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(bytes(max(free - 16_000, 0)))
    out = run_tiny_cli(workdir, "--config.fed.rounds=6", "--config.checkpoint_every=1", env=cli_env)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(out.stderr.splitlines()) < 12, out.stderr
    message = sizes(errors[0])
    assert message == (
        f"error: No space left on the device of {workdir / 'checkpoints' / '5'}: it could not "
        "be written (about $NEEDED needed, $FREE free); the last intact checkpoint is "
        f"{workdir / 'checkpoints' / '4'} (the same command resumes from it once space is "
        "freed)."
    ), errors[0]
    assert [r["round"] for r in rows_of(workdir)] == [0, 1, 2, 3, 4, 5]
    assert steps_in(workdir)[-1] == 4
    assert not list((workdir / "checkpoints").glob("*tmp*")), "the cut save is removed"
    assert_documented(DISK_FULL, message, small_disk)


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


# ---------------------------------------------------------------------------------------------
# docs/ERRORS.md: every message above, generated from these cases.

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


def test_config_argument_errors_are_documented(tmp_path):
    for description, spec in CONFIG_ARGUMENTS.items():
        assert_documented(description, config_argument_message(spec), tmp_path)


def test_rounds_change_of_a_cosine_run_and_ctrl_c_are_documented(tmp_path):
    """The cosine schedule decays over fed.rounds: a longer run would not continue the same
    trajectory, so the change is refused and nothing of the old run is touched. Ctrl-C during
    round 4 with checkpoints every 2 rounds names round 3 and the resume round 2."""
    message = rounds_cosine_message(tmp_path / "w")
    assert "optim.schedule='cosine' decays over fed.rounds" in message, message
    assert "another fed.rounds (fed.rounds: 2 there, 3 here)" in message, message
    assert [r["round"] for r in rows_of(tmp_path / "w")] == [2]  # eval_every=0: the last round
    assert json.loads((tmp_path / "w" / "config.json").read_text())["fed"]["rounds"] == 2
    assert_documented(ROUNDS_COSINE, message, tmp_path)
    message = interrupted_message(tmp_path / "i" / "w")
    assert message == (
        f"interrupted at round 3; the same command resumes from round 2 ({tmp_path / 'i' / 'w'})."
    )
    assert_documented(INTERRUPTED, message, tmp_path / "i")


def _cell(text: str, tmp: pathlib.Path) -> str:
    for path, name in ((tmp / "tfds", "$DATA_DIR"), (tmp / "w", "$WORKDIR"), (tmp, "$TMP")):
        text = text.replace(str(path), name)
    return text.replace("|", "\\|").replace("\n", "<br>")


def _row(description: str, message: str, tmp: pathlib.Path) -> str:
    return f"| {description} | {_cell(message, tmp)} |"


def assert_documented(description: str, message: str, tmp: pathlib.Path) -> None:
    row = _row(description, message, tmp)
    assert row in DOC.read_text(), (
        f"docs/ERRORS.md lacks (run python tests/{pathlib.Path(__file__).name}):\n{row}"
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


def test_errors_doc_is_current():
    text = DOC.read_text()
    for row in config_rows():
        assert row in text, (
            f"docs/ERRORS.md is stale (run python tests/test_reliability.py):\n{row}"
        )
    assert text.startswith(HEADER)


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


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    write_doc()
    print(f"wrote {DOC}")


_ABANDONED_READS = """
import asyncio, sys, types
from fedorth.train import checkpoint


@types.coroutine
def _suspend():
    yield


async def _read_array_index_and_device_put():  # the name of orbax's read
    try:
        await _suspend()
    finally:
        raise RuntimeError("abandoned read")


async def _another_coroutine():
    try:
        await _suspend()
    finally:
        raise RuntimeError("another failure")


async def _open_and_write():  # the name of orbax's write
    raise RuntimeError("abandoned write")


async def _another_task():
    raise RuntimeError("another task failure")


def abandon():
    for make in (_read_array_index_and_device_put, _another_coroutine):
        coroutine = make()
        coroutine.send(None)
        del coroutine  # finalized now: GeneratorExit, then the finally's RuntimeError is unraisable
    loop = asyncio.new_event_loop()
    for make in (_open_and_write, _another_task):
        task = loop.create_task(make())
        loop.run_until_complete(asyncio.sleep(0))  # the task fails; nobody retrieves its exception
        del task  # finalized now: asyncio logs "Task exception was never retrieved"
    loop.close()


abandon()  # without the hook
print("--- hook", file=sys.stderr, flush=True)
checkpoint.drop_abandoned_io_reports()
abandon()
print("done")
"""


def test_the_commands_drop_late_reports_of_orbaxs_abandoned_reads_and_writes_only():
    """A corrupted checkpoint's one line must stay one: orbax's abandoned reads can be finalized
    after the fallback's own garbage collection, each printed as "Exception ignored in:
    <coroutine _read_array_index_and_device_put>". The hook the commands install (in a real
    process, as they run) drops exactly those; another coroutine's failure is still printed. One
    process shows the failures without the hook, then installs it and shows them again."""
    run = subprocess.run(
        [sys.executable, "-c", _ABANDONED_READS], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.split() == ["done"], run.stderr
    plain, hook = run.stderr.split("--- hook\n")  # the same failures, before and after the hook
    stderr = {"plain": plain, "hook": hook}
    assert "_read_array_index_and_device_put" in stderr["plain"]  # what the hook is for
    assert "another failure" in stderr["plain"]
    assert "_read_array_index_and_device_put" not in stderr["hook"], stderr["hook"]
    assert "abandoned read" not in stderr["hook"]
    assert "another failure" in stderr["hook"] and "_another_coroutine" in stderr["hook"]
    # A full disk's save: its abandoned writes, reported by asyncio when they are finalized.
    assert "_open_and_write" in stderr["plain"] and "abandoned write" in stderr["plain"]
    assert "_open_and_write" not in stderr["hook"] and "abandoned write" not in stderr["hook"]
    assert "another task failure" in stderr["hook"] and "_another_task" in stderr["hook"]
