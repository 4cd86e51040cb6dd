"""The experiment loop: builders from configs, checkpoints, metrics, plots."""

from fedorth.train.loop import (  # noqa: F401
    USER_ERRORS,
    DiskFullError,
    DivergenceError,
    RunInterrupted,
    WorkdirConflictError,
    run,
)
from fedorth.train.trackers import TrackerError  # noqa: F401
from fedorth.train.validate import (  # noqa: F401
    ConfigError,
    drop_keys_of_another_model,
    flags_parser,
)
from fedorth.train.workdir import WorkdirError, WorkdirLockedError  # noqa: F401
