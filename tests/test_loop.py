"""The training loop (``fedorth.train.loop``): a divergence stops at its round and keeps the
last good checkpoint; a workdir of another config is refused; a run is reproducible and records
its config, version and commit; one writer per workdir; kills, SIGTERM and Ctrl-C save and resume
exactly; a closed output, a full disk.

The tests of :func:`stopped_runs` (one workdir, four real processes: frozen, refused, killed,
resumed and stopped with SIGTERM, its output closed) share that one scenario; those about the
workdir's lock (``fedorth.train.workdir``) and TensorBoard's events
(``fedorth.train.logging_utils``) are here with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reliability_helpers import (
    CONFLICT,
    DISK_FULL,
    DIVERGENCE,
    DIVERGING,
    INTERRUPTED,
    LOCKED,
    REPO,
    ROUNDS_COSINE,
    SCENARIO,
    assert_documented,
    cache_every_program,  # noqa: F401 -- an autouse fixture
    cli_env,  # noqa: F401 -- a fixture
    conflict_message,
    divergence_message,
    events_of,
    interrupted_message,
    placeholders,
    restore_latest,
    rounds_cosine_message,
    rounds_in,
    rows_of,
    run_tiny_cli,
    scenario_reference,  # noqa: F401 -- a fixture
    signal_during_round,
    sizes,
    steps_in,
    stopped_runs,  # noqa: F401 -- a fixture
    tiny_cli,
    tiny_config,
    tiny_reference,  # noqa: F401 -- a fixture
    wait_for,
    without_wall,
)

import fedorth
from configs import base
from fedorth import data as data_lib
from fedorth import train
from fedorth.train import builders, loop
from fedorth.train.checkpoint import Checkpointer

# ---------------------------------------------------------------------------------------------
# Divergence: stop at that round, name the round and the quantity, keep the good checkpoint.


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
# A workdir of another config, another number of rounds, Ctrl-C's message.


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


# ---------------------------------------------------------------------------------------------
# Reproducibility.


def test_same_config_and_seed_give_identical_metrics(tmp_path, tiny_reference):  # noqa: F811
    train.run(tiny_config(), tmp_path / "again")
    assert without_wall(rows_of(tmp_path / "again")) == without_wall(rows_of(tiny_reference))
    assert (tmp_path / "again" / "curves.png").exists()


def test_workdir_records_config_version_and_commit(tiny_reference):  # noqa: F811
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


# ---------------------------------------------------------------------------------------------
# One writer per workdir, kills, signals, a full disk (real processes and real files:
# started, stopped with os.kill, damaged, started again).


def test_a_second_run_on_a_workdir_is_refused_naming_the_holder(stopped_runs):  # noqa: F811
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


def test_a_killed_runs_lock_does_not_block_and_resume_matches(stopped_runs, scenario_reference):  # noqa: F811
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


def test_tensorboard_holds_one_value_per_round_after_kills(stopped_runs):  # noqa: F811
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


def test_sigterm_saves_the_round_and_says_where_it_resumes(stopped_runs):  # noqa: F811
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


def test_a_closed_output_does_not_stop_the_run(stopped_runs):  # noqa: F811
    """The fourth run's stderr was closed after its first line (``2>&1 | head -1``); it went on
    to the last round and exited 0 (its files are its result)."""
    assert stopped_runs["fourth_first_line"].startswith("Resumed from round")
    assert stopped_runs["fourth_returncode"] == 0
    assert rounds_in(stopped_runs["workdir"])[-1] == SCENARIO["fed.rounds"]


def test_second_ctrl_c_stops_at_once_without_traceback(tmp_path, cli_env, tiny_reference):  # noqa: F811
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


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals need the main thread"
)
def test_ctrl_c_saves_the_round_it_ends_and_after_the_last_round_the_run_finishes(
    tmp_path,
    monkeypatch,
    tiny_reference,  # noqa: F811
    capsys,
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


def test_full_disk_is_one_line_naming_file_space_and_last_checkpoint(
    small_disk,
    tiny_reference,  # noqa: F811
    cli_env,  # noqa: F811
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
