"""A run's metrics files (``fedorth.train.logging_utils``): ``metrics.jsonl`` never loses a
readable row (unreadable lines are moved aside, missing rows rebuilt from the TensorBoard events
or the last checkpoint); a file in the place of the TensorBoard folder is one line. One value per
round in TensorBoard after kills is tested in tests/test_loop.py, with that file's killed runs.
"""

from __future__ import annotations

import logging
import shutil

import pytest
from reliability_helpers import (
    METRICS_DAMAGED,
    TENSORBOARD_FILE,
    assert_documented,
    cache_every_program,  # noqa: F401 -- an autouse fixture
    cli_env,  # noqa: F401 -- a fixture
    copy_of,
    damage_metrics,
    metrics_damaged_warnings,
    rows_of,
    tensorboard_file_message,
    tiny_config,
    tiny_reference,  # noqa: F401 -- a fixture
    warnings_of,
    without_wall,
)

from fedorth import train


def test_unreadable_metrics_lines_are_kept_aside_and_valid_rows_kept(
    tmp_path,
    caplog,
    tiny_reference,  # noqa: F811
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


def test_finished_runs_deleted_metrics_are_rebuilt(tmp_path, caplog, tiny_reference):  # noqa: F811
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


def test_tensorboard_path_that_is_a_file_is_one_line(tmp_path, tiny_reference):  # noqa: F811
    workdir = copy_of(tiny_reference, tmp_path)
    message = tensorboard_file_message(workdir)
    assert message == (
        f"error: {workdir / 'tensorboard'} is a file; the run writes its TensorBoard events into "
        "a folder of that name: move the file away (or delete it) and rerun."
    )
    assert_documented(TENSORBOARD_FILE, message, tmp_path)
