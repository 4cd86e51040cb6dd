r"""Runs one federated experiment from a config file.

    python -m experiments.main --config=fedpac_soap --workdir=runs/fedpac_soap
    python -m experiments.main --config=configs/fedpac_soap.py:cifar100_resnet18 \
        --workdir=runs/x --config.fed.rounds=10
    python -m experiments.main --list

``--config`` takes a config's name (``fedpac_soap``, a file of the ``configs`` package, which
is installed with fedorth) or a path (``configs/fedpac_soap.py``; a path that does not exist
from the current directory is looked up in the ``configs`` package), optionally followed by
``:preset``. ``--list`` prints the algorithms, configs with their presets, models, datasets and
optimizers, each with its paper.

``--config.model.name``, ``--config.optim.name`` and ``--config.fed.algorithm`` switch the
model, optimizer and algorithm: the config file's keys the new choice does not take are dropped
with a note; keys typed on the command line are kept and checked; a new optimizer gets its own
learning rate for the setting unless one is typed (``fedorth.catalog.apply_switches``).
``--dry_run`` (or ``fedorth config NAME[:preset] [--config.KEY=VALUE ...]``) prints the
resulting config without running it.

Running the same command again resumes from the newest checkpoint in ``--workdir``; with a
larger ``--config.fed.rounds`` it extends a finished run.
"""

from __future__ import annotations

import os
import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import launch
from fedorth import catalog
from fedorth.catalog import ConfigArgumentError, config_dir, resolve_config_argv

# fedorth (and JAX) load after the --config argument is resolved: its errors come at once.

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for metrics, checkpoints and plots.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Discard a different run in --workdir.")
_LIST = flags.DEFINE_bool(
    "list", False, "Print the algorithms, configs and presets, models, datasets, optimizers."
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Print the config the run would use (what its config.json holds: --config with the "
    "--config.KEY=VALUE overrides and switches applied) and exit without running.",
)
flags.mark_flags_as_required(["config", "workdir"])


def _interrupted_at_start(signum, frame):
    """Ctrl-C while the command starts (JAX's import, the config): nothing is written yet, so it
    ends at once, in one line, without a traceback of the import it cut."""
    os.write(2, b"\ninterrupted\n")
    os._exit(128 + signum)


def flags_parser(argv: list[str]) -> list[str]:
    """Resolves ``--config``, answers ``--list`` and ``--dry_run``, then parses the flags
    (one-line errors)."""
    signal.signal(signal.SIGINT, _interrupted_at_start)  # until main() starts the run
    if "--list" in argv:
        print(catalog.listing(config_dir()))
        sys.exit(0)
    if "--dry_run" in argv:  # no --workdir needed: nothing runs
        from fedorth.catalog import print_config

        names = [a.removeprefix("--config=") for a in argv if a.startswith("--config=")]
        overrides = [a for a in argv if a.startswith("--config.")]
        if not names:
            print("error: --dry_run prints the config of --config=NAME[:preset].", file=sys.stderr)
            sys.exit(2)
        sys.exit(print_config(names[-1], overrides))
    try:
        argv = resolve_config_argv(argv)
    except ConfigArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from fedorth import train

    return train.flags_parser(argv)


def main(argv):
    from fedorth import train
    from fedorth.train.checkpoint import drop_abandoned_io_reports
    from fedorth.train.logging_utils import ClosedOutputSafe, exit_now
    from fedorth.train.loop import stop_on_sigterm

    drop_abandoned_io_reports()  # a corrupted checkpoint's or full disk's report stays one line
    # A reader that goes away (`... | head`) must not stop the run: its files are its result.
    sys.stdout, sys.stderr = ClosedOutputSafe(sys.stdout), ClosedOutputSafe(sys.stderr)
    stop_on_sigterm()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the run's own handling from here

    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    distributed = launch.initialize()
    if distributed:
        from fedorth.train import distributed as multiprocess
    config = _CONFIG.value
    # switches of model, optimizer (and its learning rate) and algorithm
    catalog.apply_command_line_switches(config, flags.FLAGS["config"])
    try:
        train.run(config, _WORKDIR.value, overwrite=_OVERWRITE.value)
    except train.USER_ERRORS as e:  # bad input: the message says what to do, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, train.ConfigError | train.WorkdirError) else 1)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: the loop's message names the rounds
        for signum in (signal.SIGINT, signal.SIGTERM):  # no traceback from a further one
            signal.signal(signum, signal.SIG_IGN)
        print(f"\n{e}" if str(e) else "\ninterrupted", file=sys.stderr)
        code = 128 + (getattr(e, "signum", None) or signal.SIGINT)
        if distributed:  # every process stopped at the same round, or this one at once
            multiprocess.leave(code, together=not getattr(e, "at_once", True))
        # The run's files are closed and its lock released: the interpreter's teardown, where a
        # compilation or save cut short still runs in its threads, is skipped.
        exit_now(code)
    except Exception:
        if distributed:  # a collective failed because a process died: one line naming it
            multiprocess.exit_if_peers_lost()
        raise


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser)
