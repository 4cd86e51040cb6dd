"""One round loop for a single run and a sweep (``fedorth.train.rounds``): what the single run
does around a round, a sweep does too. Real command-line processes and real signals.

Each module-scoped fixture runs one command twice: stopped by a Ctrl-C that comes while the
rows of round 2 are written (it saves round 2), then started again and stopped by two signals
while its checkpoint is restored (it stops at once, in the one line of a second signal). A
``sitecustomize`` on the command's path sends the first signal and slows the restore.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from reliability_helpers import (
    REPO,
    TINY_ARGS,
    assert_documented,
    cli_env,  # noqa: F401 -- a fixture
    wait_for,
)
from test_startup import LIMITED_CLI

# Loaded by the commands below (PYTHONPATH). FEDORTH_TEST_SIGNAL_AT_ROUND: the process sends
# itself SIGINT after it wrote the first row of that round (the others of the round follow).
# FEDORTH_TEST_SLOW_RESTORE: a file the restore of the checkpoint creates before it waits.
_HOOK = """
import os, pathlib, signal, time

_at = os.environ.get("FEDORTH_TEST_SIGNAL_AT_ROUND")
_slow = os.environ.get("FEDORTH_TEST_SLOW_RESTORE")
if _at:
    from fedorth.train import logging_utils

    _write = logging_utils.MetricsWriter.write
    _sent = []

    def write(self, row):
        _write(self, row)
        if row.get("round") == int(_at) and not _sent:
            _sent.append(row)
            os.kill(os.getpid(), signal.SIGINT)

    logging_utils.MetricsWriter.write = write
if _slow:
    from fedorth.train import checkpoint

    _restore = checkpoint.Checkpointer.restore_latest

    def restore_latest(self, *args, **kwargs):
        pathlib.Path(_slow).touch()
        time.sleep(300)
        return _restore(self, *args, **kwargs)

    checkpoint.Checkpointer.restore_latest = restore_latest
"""

SWEEP = ["--sweep.seed=42,43", "--config.log_condition_number=True"]


def _lines(stderr: str) -> list[str]:
    """The lines that are not the progress bar's."""
    return [line for line in stderr.splitlines() if line and not line.startswith("[")]


def _rows(folder: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _twice_during_restore(command, env, marker: pathlib.Path, signum: int) -> tuple[int, str]:
    """Starts ``command``; two ``signum`` once the restore began; its exit status and stderr."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(marker.exists, proc, "the checkpoint's restore", timeout=300)
        proc.send_signal(signum)
        time.sleep(0.5)
        proc.send_signal(signum)
        stderr = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, stderr


def _stopped_twice(tmp: pathlib.Path, env: dict[str, str], module: str, *args: str, signum):
    """``module``'s command stopped at round 2 of 3 by a Ctrl-C during the round's writes, then
    started again and stopped by two ``signum`` during the restore."""
    (tmp / "hook").mkdir()
    (tmp / "hook" / "sitecustomize.py").write_text(_HOOK)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp / "hook"), str(REPO)])}
    workdir = tmp / "w"
    command = [
        sys.executable,
        "-m",
        module,
        *TINY_ARGS,
        "--config.fed.rounds=3",
        "--config.checkpoint_every=0",
        *args,
        f"--workdir={workdir}",
    ]
    first = subprocess.run(
        command,
        cwd=REPO,
        env={**env, "FEDORTH_TEST_SIGNAL_AT_ROUND": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    marker = tmp / "restoring"
    code, stderr = _twice_during_restore(
        command, {**env, "FEDORTH_TEST_SLOW_RESTORE": str(marker)}, marker, signum
    )
    return workdir, first, (code, stderr)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, cli_env):  # noqa: F811
    tmp = tmp_path_factory.mktemp("single")
    return _stopped_twice(tmp, cli_env, "experiments.main", signum=signal.SIGTERM)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, cli_env):  # noqa: F811
    tmp = tmp_path_factory.mktemp("sweep")
    return _stopped_twice(tmp, cli_env, "experiments.sweep", *SWEEP, signum=signal.SIGINT)


def test_a_ctrl_c_during_a_sweep_rounds_writes_saves_that_round(sweep):
    workdir, first, _ = sweep
    assert first.returncode == 130, first.stderr[-3000:]
    assert "Traceback" not in first.stderr, first.stderr
    assert _lines(first.stderr)[-1] == (
        f"interrupted (SIGINT) at round 2; the same command resumes the sweep from round 2 "
        f"({workdir})."
    ), first.stderr
    assert (workdir / "checkpoints" / "2").is_dir(), "the round of the stop is saved"
    for name in ("seed=42", "seed=43"):
        assert [row["round"] for row in _rows(workdir / name)] == [0, 1, 2], name


def test_a_ctrl_c_during_a_single_runs_writes_saves_that_round(single_run):
    workdir, first, _ = single_run
    assert first.returncode == 130, first.stderr[-3000:]
    assert _lines(first.stderr)[-1] == (
        f"interrupted (SIGINT) at round 2; the same command resumes from round 2 ({workdir})."
    ), first.stderr
    assert (workdir / "checkpoints" / "2").is_dir(), "the round of the stop is saved"


def test_a_sweep_logs_condition_numbers_as_a_single_run(sweep):
    """``log_condition_number``: each evaluated row of each replica has the mean and largest
    condition number of its weight matrices (the initial model's row has none, as a run's)."""
    workdir, _, _ = sweep
    for name in ("seed=42", "seed=43"):
        rows = _rows(workdir / name)
        for row in rows[1:]:
            assert row["condition_number_max"] >= row["condition_number_mean"] >= 1.0, row
        assert "condition_number_mean" not in rows[0]


def test_a_second_sigterm_during_a_single_runs_restore_stops_at_once_in_one_line(single_run):
    """Two SIGTERMs while the checkpoint of round 2 is restored, before any round runs: the
    second signal's line (not a bare "interrupted"), and 143 (SIGTERM's exit status)."""
    workdir, _, (code, stderr) = single_run
    assert code == 143, stderr
    assert "Traceback" not in stderr, stderr
    lines = _lines(stderr)
    assert lines[0].startswith("SIGTERM: stopping after the round in progress"), stderr
    assert lines[-1] == (
        f"interrupted at round 2; the same command resumes from round 2 ({workdir})."
    ), stderr
    assert_documented(
        "two SIGTERMs while the newest checkpoint is restored, before the rounds run (exit code "
        "143; Ctrl-C: 130)",
        lines[-1].replace("round 2", "round $SAVED"),
        workdir.parent,
    )


def test_a_second_ctrl_c_during_a_sweeps_restore_names_the_round_it_resumes_from(sweep):
    workdir, _, (code, stderr) = sweep
    assert code == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert _lines(stderr)[-1] == (
        f"interrupted at round 2; the same command resumes the sweep from round 2 ({workdir})."
    ), stderr


# tests/test_startup.py's command with its address space limited, running the sweep.
_LIMITED = LIMITED_CLI.replace('"experiments.main"', '"experiments.sweep"')
assert _LIMITED != LIMITED_CLI


def test_a_sweeps_round_out_of_memory_is_the_documented_paragraph(tmp_path):
    """FedMuon-LMO's kept state of 10 clients (1.5 GB, a 4096-wide MLP) fits in 2.2 GiB; the
    round, which writes it anew, does not: the paragraph of a single run's round out of memory
    (the sweep's size check first asks for 3 copies of the state in host memory)."""
    from fedorth.sweep import runner

    available = runner._available_memory()
    if available is not None and available < 5e9:
        pytest.skip("the sweep's size check needs 4.5 GB of available host memory")
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_ARENA_MAX": "2"}
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED, "2.2", "--config=configs/fedmuon_bc.py",
         "--config.model.hidden_sizes=(4096,4096)", "--config.fed.client_state=device",
         "--config.data.num_clients=10", "--config.fed.local_steps=1", "--config.fed.rounds=1",
         "--sweep.seed=42", f"--workdir={tmp_path / 'sweep'}"],
        env=env, capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: A round does not fit in the memory of cpu:0: XLA asked for"), (
        done.stderr[-3000:]
    )
    assert "Remedies:" in last and "Traceback" not in done.stderr
