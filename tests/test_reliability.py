"""Reliability of the runner (issue 9): bad input gets a clear error, a crash loses nothing, a run
is reproducible.

The error messages a user sees are listed in docs/ERRORS.md, generated from the cases of
tests/reliability_helpers.py: ``python tests/test_reliability.py`` rewrites it, and
``test_errors_doc_is_current`` fails when the doc and the messages drift apart.

The tests are in the files of the modules they test: tests/test_validate.py (config values),
tests/test_builders.py (seeds, the round's LAPACK calls), tests/test_checkpoint.py (damaged
checkpoints), tests/test_logging_utils.py (damaged metrics), tests/test_loop.py (divergence,
another config, reproducibility, kills, signals, a full disk), tests/test_workdir.py, and the
missing dataset and the ``--config`` argument in tests/test_data_tfds.py and tests/test_cli.py.
Their helpers and fixtures are tests/reliability_helpers.py's, re-exported here for the test files
that import them from this file.
"""

from __future__ import annotations

import os

from reliability_helpers import (
    BAD_CONFIGS,
    CLI_TYPO,
    CONFIG_ARGUMENTS,
    CONFIG_IN_CHECKPOINT,
    CONFLICT,
    CORRUPTED,
    DISK_FULL,
    DIVERGENCE,
    DIVERGING,
    DOC,
    EMPTY_WORKDIR,
    HEADER,
    INCOMPLETE,
    INTERRUPTED,
    LAPACK_THREADS,
    LOCKED,
    METRICS_DAMAGED,
    MISSING_DATA,
    REGISTRIES,
    REPO,
    RESULTS_SECTION,
    ROUNDS_COSINE,
    SCENARIO,
    SCENARIO_ARGS,
    SOAP_OVERRIDES,
    TENSORBOARD_FILE,
    TINY_ARGS,
    _cell,
    _row,
    apply,
    assert_documented,
    cache_every_program,
    cli,
    cli_env,
    compilation_cache_env,
    config_argument_message,
    config_error,
    config_in_checkpoint_message,
    config_rows,
    conflict_message,
    copy_of,
    corrupt,
    corrupted_checkpoint_warning,
    damage_metrics,
    disk_full_message,
    divergence_message,
    events_of,
    incomplete_checkpoint_warning,
    interrupted_message,
    lapack_threads_message,
    locked_message,
    metrics_damaged_warnings,
    missing_data_message,
    placeholders,
    restore_latest,
    rounds_cosine_message,
    rounds_in,
    rows_of,
    run_tiny_cli,
    scenario_reference,
    signal_during_round,
    sizes,
    soap_config,
    steps_in,
    stopped_runs,
    tensorboard_file_message,
    tiny_cli,
    tiny_config,
    tiny_reference,
    typo_key_message,
    wait_for,
    warnings_of,
    without_wall,
    workdir_message,
    write_doc,
)

__all__ = [
    "apply",
    "assert_documented",
    "BAD_CONFIGS",
    "cache_every_program",
    "_cell",
    "cli",
    "cli_env",
    "CLI_TYPO",
    "compilation_cache_env",
    "config_argument_message",
    "CONFIG_ARGUMENTS",
    "config_error",
    "CONFIG_IN_CHECKPOINT",
    "config_in_checkpoint_message",
    "config_rows",
    "CONFLICT",
    "conflict_message",
    "copy_of",
    "corrupt",
    "CORRUPTED",
    "corrupted_checkpoint_warning",
    "damage_metrics",
    "DISK_FULL",
    "disk_full_message",
    "DIVERGENCE",
    "divergence_message",
    "DIVERGING",
    "DOC",
    "EMPTY_WORKDIR",
    "events_of",
    "HEADER",
    "INCOMPLETE",
    "incomplete_checkpoint_warning",
    "INTERRUPTED",
    "interrupted_message",
    "LAPACK_THREADS",
    "lapack_threads_message",
    "LOCKED",
    "locked_message",
    "METRICS_DAMAGED",
    "metrics_damaged_warnings",
    "MISSING_DATA",
    "missing_data_message",
    "placeholders",
    "REGISTRIES",
    "REPO",
    "restore_latest",
    "RESULTS_SECTION",
    "ROUNDS_COSINE",
    "rounds_cosine_message",
    "rounds_in",
    "_row",
    "rows_of",
    "run_tiny_cli",
    "SCENARIO",
    "SCENARIO_ARGS",
    "scenario_reference",
    "signal_during_round",
    "sizes",
    "soap_config",
    "SOAP_OVERRIDES",
    "steps_in",
    "stopped_runs",
    "TENSORBOARD_FILE",
    "tensorboard_file_message",
    "TINY_ARGS",
    "tiny_cli",
    "tiny_config",
    "tiny_reference",
    "typo_key_message",
    "wait_for",
    "warnings_of",
    "without_wall",
    "workdir_message",
    "write_doc",
]


def test_errors_doc_is_current():
    text = DOC.read_text()
    for row in config_rows():
        assert row in text, (
            f"docs/ERRORS.md is stale (run python tests/test_reliability.py):\n{row}"
        )
    assert text.startswith(HEADER)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    write_doc()
    print(f"wrote {DOC}")
