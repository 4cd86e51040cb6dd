"""Ctrl-C at the moments a new user hits it: while the command starts, twice during the first
compilation, twice during a checkpoint save. Each ends in one line and a defined exit code (130),
never a traceback or a crash, and the same command resumes. Real processes and real signals.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

from test_reliability import (
    REPO,
    TINY_ARGS,
    assert_documented,
    cli_env,  # noqa: F401 -- a fixture
    wait_for,
)


def _start(workdir: pathlib.Path, *args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.main", *TINY_ARGS, f"--workdir={workdir}", *args],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ctrl_c_twice(proc: subprocess.Popen, gap_s: float) -> str:
    """Two SIGINTs ``gap_s`` apart (unless the process has ended); its stderr once it ends."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(gap_s)
    return _finish(proc)


def _loaded(pid: int, library: str) -> bool:
    try:
        return library in pathlib.Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _after_progress(stderr: str) -> list[str]:
    """The lines that are not the progress bar's."""
    return [line for line in stderr.splitlines() if line and not line.startswith("[")]


def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path, cli_env):  # noqa: F811
    """Ctrl-C while JAX is imported (its library is being loaded): "interrupted", exit code
    130, no traceback of the cut import, nothing written."""
    workdir = tmp_path / "w"
    proc = _start(workdir, "--config.fed.rounds=2", env=cli_env)
    try:
        wait_for(lambda: _loaded(proc.pid, "jaxlib"), proc, "JAX's import", timeout=60)
        proc.send_signal(signal.SIGINT)
    finally:
        stderr = _finish(proc)
    assert proc.returncode == 130, stderr
    assert _after_progress(stderr) == ["interrupted"], stderr
    assert not workdir.exists()
    assert_documented("Ctrl-C while the command starts (exit code 130)", "interrupted", tmp_path)


def test_ctrl_c_twice_during_the_first_compilation_exits_cleanly(tmp_path, cli_env):  # noqa: F811
    """Without a compilation cache: the round is compiled after the round-0 evaluation is
    printed; two Ctrl-C then. Exit code 130 (no crash: 139 is a segmentation fault), one line
    saying from which round the command resumes, and the command resumes."""
    env = {k: v for k, v in cli_env.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    workdir = tmp_path / "w"
    proc = _start(workdir, "--config.fed.rounds=3", env=env)
    try:
        for line in proc.stderr:
            if "round 0/3" in line:
                break
    finally:
        stderr = _ctrl_c_twice(proc, 0.3)
    assert proc.returncode == 130, stderr
    lines = _after_progress(stderr)
    assert "Traceback" not in stderr and "Fatal Python error" not in stderr, stderr
    assert re.fullmatch(
        r"interrupted (\(SIGINT\) )?at round \d; the same command resumes from round \d.*",
        lines[-1],
    ), stderr


def test_ctrl_c_twice_during_a_checkpoint_save_exits_cleanly_and_resumes(
    tmp_path,
    cli_env,  # noqa: F811
):
    """A model whose checkpoint takes a while to write (3 x 1024 hidden units); two Ctrl-C as
    soon as a save's temporary folder appears: exit code 130, one line, no traceback of the cut
    save, and the same command resumes from the newest complete checkpoint to the end."""
    workdir = tmp_path / "w"
    args = [
        "--config.model.hidden_sizes=1024,1024,1024",
        "--config.fed.local_steps=1",
        "--config.fed.rounds=40",
        "--config.checkpoint_every=1",
    ]
    proc = _start(workdir, *args, env=cli_env)
    checkpoints = workdir / "checkpoints"

    def saving() -> bool:
        found = list(checkpoints.iterdir()) if checkpoints.is_dir() else []
        return any("tmp" in p.name for p in found) and any(p.name.isdigit() for p in found)

    try:
        wait_for(saving, proc, "a save in progress", timeout=300)
    finally:
        stderr = _ctrl_c_twice(proc, 0.05)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "Exception" not in stderr, stderr
    lines = _after_progress(stderr)
    assert lines[0].startswith("SIGINT: stopping after the round in progress"), stderr
    assert len(lines) == 2 and lines[1].startswith("interrupted"), stderr
    steps = [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
    last = max(steps, default=0)
    resume = [*args[:3], f"--config.fed.rounds={last + 1}", "--config.checkpoint_every=1"]
    resumed = _start(workdir, *resume, env=cli_env)
    stderr = _finish(resumed)
    assert resumed.returncode == 0, stderr
    assert f"Resumed from round {last} in {workdir}." in stderr or last == 0, stderr
    assert f"Finished round {last + 1}:" in stderr, stderr


# Loaded by the command below (PYTHONPATH): the clean-up of the second Ctrl-C never ends, as in
# a deadlock of a thread the run waits for; the main thread waits on a lock, in native code.
_STUCK_CLEAN_UP = """
import threading

from fedorth.train import loop

_never = threading.Lock()
_never.acquire()


def _stuck(*args, **kwargs):
    _never.acquire()


loop.stopped_at_once = _stuck
"""


def test_a_third_signal_ends_a_stop_that_does_not_end(tmp_path, cli_env):  # noqa: F811
    """The second Ctrl-C's clean-up hangs (patched to wait forever): a third signal ends the
    process at once in one line, exit code 130, although the main thread is held in native code
    where Python's handlers cannot run; the same command resumes."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_STUCK_CLEAN_UP)
    env = {**cli_env, "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), str(REPO)])}
    workdir = tmp_path / "w"
    args = ["--config.fed.rounds=400", "--config.checkpoint_every=2"]
    proc = _start(workdir, *args, env=env)
    try:
        wait_for(lambda: (workdir / "checkpoints" / "2").is_dir(), proc, "round 2's checkpoint")
        proc.send_signal(signal.SIGINT)
        line = proc.stderr.readline()
        while line.startswith("[") or not line.strip():  # the progress bar's lines
            line = proc.stderr.readline()
        assert line.startswith("SIGINT: stopping after the round in progress"), line
        proc.send_signal(signal.SIGINT)  # at once, from the newest checkpoint: never ends here
        time.sleep(2)
        assert proc.poll() is None, "the patched clean-up should hold the run"
        proc.send_signal(signal.SIGINT)
    finally:
        stderr = _finish(proc)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert _after_progress(stderr)[-1] == (
        "SIGINT again: exiting now; the same command resumes from the newest checkpoint."
    ), stderr
    assert_documented(
        "a third Ctrl-C, the second's stop not ending (exit code 130; SIGTERM: 143)",
        _after_progress(stderr)[-1],
        tmp_path,
    )
    resumed = _start(workdir, "--config.fed.rounds=6", "--config.checkpoint_every=2", env=cli_env)
    stderr = _finish(resumed)
    assert resumed.returncode == 0, stderr
    assert re.search(rf"Resumed from round \d+ in {re.escape(str(workdir))}\.", stderr), stderr
