"""Checkpoints (``fedorth.train.checkpoint``): a damaged, swapped or incomplete step is
detected (a swapped one by the SHA-256 digest saved with it) and the run goes on from the
previous one after one warning; with every step damaged the run is refused; each checkpoint
carries its run's config; orbax's late reports of abandoned reads and writes are dropped. Real
files, damaged as a failing disk or a bad copy would.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from reliability_helpers import (
    CONFIG_IN_CHECKPOINT,
    CORRUPTED,
    INCOMPLETE,
    assert_documented,
    cache_every_program,  # noqa: F401 -- an autouse fixture
    cli_env,  # noqa: F401 -- a fixture
    config_in_checkpoint_message,
    copy_of,
    corrupt,
    corrupted_checkpoint_warning,
    incomplete_checkpoint_warning,
    restore_latest,
    rows_of,
    run_tiny_cli,
    steps_in,
    tiny_config,
    tiny_reference,  # noqa: F401 -- a fixture
    without_wall,
)

from fedorth import train
from fedorth.train import builders
from fedorth.train import checkpoint as checkpoint_lib
from fedorth.train.checkpoint import Checkpointer, CheckpointError

# Reading a damaged checkpoint makes orbax's tensorstore reads fail inside its asyncio loop,
# which later schedules callbacks on the closed loop ("Event loop is closed", unraisable, in
# orbax's threads): third-party teardown noise, not a result of the code under test.
_ORBAX_DAMAGED_READ_NOISE = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


@_ORBAX_DAMAGED_READ_NOISE
@pytest.mark.parametrize("mode", ["swap", "truncate"])
def test_corrupted_latest_checkpoint_falls_back_with_a_warning(
    tmp_path,
    caplog,
    tiny_reference,  # noqa: F811
    mode,
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


def test_checkpoint_carries_its_config_when_config_json_is_gone(tmp_path, tiny_reference):  # noqa: F811
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


def test_incomplete_newest_checkpoint_is_skipped_in_one_line(tmp_path, caplog, tiny_reference):  # noqa: F811
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
def test_cli_corrupted_checkpoint_fallback_is_one_line(tmp_path, tiny_reference, cli_env):  # noqa: F811
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
