"""A run folder is data, never instructions (``fedorth.train.workdir``).

A workdir may come from someone else. Links in the place of the run's own files are refused in
one line, the links' targets untouched; the lock survives the deletion of ``run.lock``; a full
disk while ``run.lock`` is written is one line; nothing a run reads from its folder is unpickled
or evaluated. The commands run as real processes, on real links and files.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_reliability import (
    EMPTY_WORKDIR,
    REPO,
    assert_documented,
    cli_env,  # noqa: F401 -- a fixture
    run_tiny_cli,
    tiny_cli,
    tiny_reference,  # noqa: F401 -- a fixture
    workdir_message,
)

from fedorth.train import loop
from fedorth.train import workdir as workdir_lib

TARGET_BYTES = b"a colleague's file: not the run's to write\n"


def errors_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


LINKED = [
    "run.lock",
    ".config.json.tmp",
    ".run_info.json.tmp",
    ".metrics.jsonl.tmp",
    ".curves.png.tmp.png",
    "config.json",
    "run_info.json",
    "metrics.jsonl",
]


@pytest.mark.parametrize("name", LINKED)
def test_a_link_in_the_place_of_a_runs_file_is_refused_and_its_target_untouched(
    tmp_path,
    name,
    cli_env,  # noqa: F811
):
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_bytes(TARGET_BYTES)
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / name).symlink_to(target)
    out = run_tiny_cli(workdir, "--config.fed.rounds=1", env=cli_env)
    assert target.read_bytes() == TARGET_BYTES, "the link's target was written"
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert errors_of(out.stderr) == [
        f"error: {workdir / name} is a symbolic link (to {target}); a run writes its own files "
        "there and never through a link, which would overwrite the link's target: remove the "
        "link (its target is left as it is) and rerun, or use another --workdir."
    ], out.stderr
    assert (workdir / name).is_symlink(), "the link is left for its owner"
    if name == "run.lock":
        assert_documented(LINK, errors_of(out.stderr)[0].replace(str(target), "$TARGET"), tmp_path)


def test_writes_never_follow_a_link_made_after_the_check(tmp_path):
    """``O_NOFOLLOW`` at each write: a link made while the run goes on is refused too."""
    target = tmp_path / "precious.txt"
    target.write_bytes(TARGET_BYTES)
    for name in ("metrics.jsonl", ".config.json.tmp"):
        (tmp_path / name).symlink_to(target)
    with pytest.raises(workdir_lib.WorkdirError, match="is a symbolic link"):
        workdir_lib.append_own(tmp_path / "metrics.jsonl", b"{}\n")
    with pytest.raises(workdir_lib.WorkdirError, match="is a symbolic link"):
        workdir_lib.write_atomic(tmp_path / "config.json", "{}")
    assert target.read_bytes() == TARGET_BYTES


HOLD_LOCK = """
import pathlib, sys, time
from fedorth.train import workdir
lock = workdir.WorkdirLock(pathlib.Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def test_deleting_run_lock_does_not_let_a_second_run_in(tmp_path, cli_env):  # noqa: F811
    """A process holds the workdir; its ``run.lock`` is deleted; the run command is refused
    all the same (the folder itself is locked), and nothing of the workdir is written."""
    workdir = tmp_path / "w"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(workdir)],
        cwd=REPO,
        env=cli_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        (workdir / "run.lock").unlink()
        out = run_tiny_cli(workdir, "--config.fed.rounds=1", env=cli_env)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 1, out.stderr
    assert errors_of(out.stderr) == [
        f"error: {workdir} is in use by another run (a process whose run.lock, which would name "
        "it, was deleted). One run writes to a workdir at a time: wait for it to end or stop "
        "it, or use another --workdir."
    ], out.stderr
    assert sorted(p.name for p in workdir.iterdir()) == [], "the refused run wrote nothing"
    assert_documented(LOCK_DELETED, errors_of(out.stderr)[0], tmp_path)


def test_full_disk_while_run_lock_is_written_is_one_line(small_disk, cli_env):  # noqa: F811
    workdir = small_disk / "w"
    workdir.mkdir()
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(bytes(free))
    out = run_tiny_cli(workdir, "--config.fed.rounds=1", env=cli_env)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = errors_of(out.stderr)
    assert len(errors) == 1 and len(out.stderr.splitlines()) == 1, out.stderr
    message = re.sub(r"\d+\.\d [kM]B free", "$FREE free", errors[0])
    assert message == (
        f"error: No space left on the device of {workdir / 'run.lock'}: it could not be written "
        "($FREE free); nothing of the run was changed (free some space, then the same command "
        "starts or resumes it)."
    ), out.stderr
    assert_documented(LOCK_DISK_FULL, message, small_disk)


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


# ---------------------------------------------------------------------------------------------
# Nothing of a run folder is unpickled or evaluated.


class _Payload:
    """Unpickling it creates the file ``marker``."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("part", ["results", "checkpoints"])
def test_a_resumed_run_unpickles_and_evaluates_nothing_of_its_folder(
    tmp_path,
    part,
    tiny_reference,  # noqa: F811
    cli_env,  # noqa: F811
):
    """A finished run's files replaced by pickles (or ``.npy`` files of objects, or Python
    source) whose loading would create a marker file, and such files planted where a loader
    might look; then the run is extended. ``results``: its rows, events, info and curves (the
    run resumes from its checkpoint, sets the unreadable rows aside and finishes);
    ``checkpoints``: the checkpoints' files but the metadata naming their config (none can be
    restored: one line)."""
    workdir = tmp_path / "w"
    shutil.copytree(tiny_reference, workdir)
    marker, source = tmp_path / "unpickled", tmp_path / "evaluated"
    payloads = [
        pickle.dumps(_Payload(marker)),
        _npy_of_objects(_Payload(marker)),
        f"open({str(source)!r}, 'w')\n".encode(),
    ]
    kept = {"config.json", "run.lock", "_CHECKPOINT_METADATA", "commit_success.txt"}
    files = [p for p in sorted(workdir.rglob("*")) if p.is_file() and p.name not in kept]
    in_checkpoints = [p for p in files if "checkpoints" in p.relative_to(workdir).parts]
    replaced = in_checkpoints if part == "checkpoints" else sorted(set(files) - set(in_checkpoints))
    planted = ["config.py", "params.pkl", "state.npy", "checkpoints/4/state.pickle"]
    for i, path in enumerate([*replaced, *(workdir / name for name in planted)]):
        path.write_bytes(payloads[i % len(payloads)])
    out = run_tiny_cli(workdir, "--config.fed.rounds=5", "--config.checkpoint_every=1", env=cli_env)
    assert not marker.exists(), "a file of the run folder was unpickled"
    assert not source.exists(), "a file of the run folder was evaluated"
    assert "Traceback" not in out.stderr, out.stderr
    if part == "results":
        assert out.returncode == 0, out.stderr
        assert "hold no readable row" in out.stderr, out.stderr
        assert [json.loads(line)["round"] for line in (workdir / "metrics.jsonl").open()] == [
            4,
            5,
        ]
    else:
        assert out.returncode == 1, out.stderr
        assert errors_of(out.stderr)[0].startswith("error: None of the checkpoints"), out.stderr


def _npy_of_objects(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.array([obj], dtype=object), allow_pickle=True)
    return buffer.getvalue()


# What would load code or objects from bytes: pickle and its relatives, numpy's object arrays,
# eval/exec, an unsafe YAML loader.
_UNSAFE = re.compile(
    r"\b(?:c?pickle|dill|cloudpickle|marshal|shelve|joblib)\b|allow_pickle\s*=\s*True"
    r"|(?<![\w.])(?:eval|exec)\s*\(|yaml\.(?:unsafe_)?load\(|torch\.load\("
)


def test_no_code_unpickles_or_evaluates():
    """The package and the commands (not the tests, which make payloads) hold no call that
    could load code from a file: a run folder stays data."""
    found = []
    for folder in ("fedorth", "experiments", "configs"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if _UNSAFE.search(line.split("#")[0]):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_unsafe_pattern_finds_what_it_should():
    for line in (
        "import pickle",
        "x = np.load(f, allow_pickle=True)",
        "eval(text)",
        "exec(code, {})",
        "yaml.load(s)",
        "import cloudpickle",
    ):
        assert _UNSAFE.search(line), line
    for line in ("np.load(path)", "model.eval()", "evaluate(x)", "jax.jit(f)"):
        assert not _UNSAFE.search(line), line


# ---------------------------------------------------------------------------------------------
# docs/ERRORS.md rows (the "Workdir, results, signals, full disk" section).

LINK = (
    "a symbolic link named `run.lock` (or `.config.json.tmp`, `metrics.jsonl`, ...) in the "
    "workdir, to `$TARGET` (exit code 2; the target is untouched)"
)
LOCK_DELETED = "a second run on a workdir whose holder's `run.lock` was deleted (exit code 1)"
LOCK_DISK_FULL = "a full disk while `run.lock` is written (exit code 1)"
