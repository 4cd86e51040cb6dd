r"""Runs a grid of seeds and hyperparameters of one config as one compiled program.

    python -m experiments.sweep --config=fedavg --workdir=runs/fedavg_sweep \
        --sweep.seed=42,43,44 --sweep.optim.learning_rate=0.03,0.1
    python -m experiments.sweep --config=fedpac_soap:cifar100_resnet18 --workdir=runs/s \
        --sweep.seed=42,43,44,45,46 --replica_strategy=vmap --replica_chunk_size=4

Each ``--sweep.KEY=v1,v2,...`` names a config key and its values (or the config file gives a
``sweep`` section with the same keys, e.g. ``config.sweep.seed = (42, 43)``; the command line
wins); the replicas are the product of the value lists. ``seed`` and ``data.alpha`` build each
replica's data and initial state; float hyperparameters of ``optim`` and ``fed.options`` enter
the compiled round as arrays (``fedorth.sweep``). ``--config.*`` overrides set the base config
as for ``experiments.main``.

Each replica writes an ordinary run folder ``WORKDIR/KEY=VALUE,.../`` (``config.json``,
``metrics.jsonl``, ``curves.png``, TensorBoard), so ``python -m experiments.report WORKDIR``
reads the sweep like separate runs; the sweep checkpoints all replicas as one
(``WORKDIR/checkpoints``, with the grid) and the same command resumes it, each replica from its
own state whatever the order of the ``--sweep.*`` flags (docs/SWEEPS.md: a changed grid,
signals, deleted folders). Ctrl-C or SIGTERM stops after the round in progress, saved.
``--replica_strategy``: ``auto``
(sequential on CPU; on an accelerator the faster of the two, timed on the first round),
``sequential`` (one compiled round, run once per replica) or ``vmap``;
``--replica_chunk_size`` bounds the replicas vmapped at once.

``--distributed`` (with ``experiments.main``'s launch flags, or detected under SLURM and Open
MPI) runs the sweep on every device of every process, and ``--sweep.devices_per_replica=k``
lays each replica's clients over ``k`` devices (alone, over the devices of one process): the
replicas are placed on groups of devices that share nothing (``fedorth.sweep.placement``); the
sweep says how in one line, and each process writes the folders of the replicas on its devices.

``--sweep.shard=i/n`` runs slice ``i`` of ``n`` of the grid (replicas ``i``, ``i + n``, ...) as
an independent job in the same workdir (a SLURM job array); ``experiments.report WORKDIR`` reads
the union (docs/SWEEPS.md).
"""

from __future__ import annotations

import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import launch
from fedorth import catalog
from fedorth.catalog import ConfigArgumentError, resolve_config_argv

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder of the sweep (one run folder per replica).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Discard another sweep in --workdir.")
_STRATEGY = flags.DEFINE_enum(
    "replica_strategy",
    "auto",
    ["auto", "sequential", "vmap"],
    "How replicas run: auto (sequential on CPU; on an accelerator the faster of the two, "
    "timed on the first round), sequential, vmap.",
)
_CHUNK = flags.DEFINE_integer(
    "replica_chunk_size", 0, "Replicas vmapped at once (0: all); lower it if memory runs out."
)
flags.mark_flags_as_required(["config", "workdir"])

_GRID: dict[str, str] = {}
_SHARD: list[tuple[int, int]] = []
_DEVICES_PER_REPLICA: list[int] = []


def flags_parser(argv: list[str]) -> list[str]:
    """Takes the ``--sweep.*`` grid out of ``argv``, resolves ``--config``, parses the flags."""
    from fedorth.sweep.grid import (
        SweepError,
        parse_devices_per_replica,
        parse_shard,
        parse_sweep_argv,
    )

    try:
        argv, grid = parse_sweep_argv(argv)
        if "devices_per_replica" in grid:
            _DEVICES_PER_REPLICA.append(parse_devices_per_replica(grid.pop("devices_per_replica")))
        if "shard" in grid:
            _SHARD.append(parse_shard(grid.pop("shard")))
            launching = [
                a for a in argv if a.startswith(("--distributed", "--coordinator_address"))
            ]
            if launching:
                raise SweepError(
                    f"--sweep.shard with {launching[0].partition('=')[0]}: a slice of the grid is "
                    "an independent job of one process; run the slices as separate jobs "
                    "without --distributed, or the whole grid with --distributed."
                )
        argv = resolve_config_argv(argv)
    except (SweepError, ConfigArgumentError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _GRID.update(grid)
    from fedorth import train

    return train.flags_parser(argv)


def main(argv):
    from fedorth import train
    from fedorth.sweep import Grid, SweepError
    from fedorth.sweep.grid import config_section
    from fedorth.sweep.runner import run_sweep
    from fedorth.train.checkpoint import drop_abandoned_io_reports
    from fedorth.train.logging_utils import ClosedOutputSafe
    from fedorth.train.loop import stop_on_sigterm

    drop_abandoned_io_reports()  # a corrupted checkpoint's or full disk's report stays one line
    # A reader that goes away (`... | head`) must not stop the sweep: its files are its result.
    sys.stdout, sys.stderr = ClosedOutputSafe(sys.stdout), ClosedOutputSafe(sys.stderr)
    stop_on_sigterm()
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    distributed = launch.initialize()
    if distributed:
        from fedorth.train import distributed as multiprocess
    # Several processes, or --sweep.devices_per_replica: the replicas over every device.
    per_replica = _DEVICES_PER_REPLICA[0] if _DEVICES_PER_REPLICA else (0 if distributed else None)
    config = _CONFIG.value
    values = dict(config_section(config))
    if "sweep" in config:
        with config.unlocked():
            del config["sweep"]
    values.update(_GRID)
    # switches of model, optimizer (and its learning rate) and algorithm, as a run's
    catalog.apply_command_line_switches(config, flags.FLAGS["config"])
    try:
        grid = Grid(config, values)
        if _SHARD:
            grid = grid.sliced(*_SHARD[0])
        run_sweep(
            config,
            grid,
            _WORKDIR.value,
            replica_strategy=_STRATEGY.value,
            replica_chunk_size=_CHUNK.value,
            overwrite=_OVERWRITE.value,
            devices_per_replica=per_replica,
        )
    except (SweepError, *train.USER_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, SweepError | train.ConfigError) else 1
        if distributed:  # the others may wait in a collective for this one: leave at once
            multiprocess.leave(code, together=False)
        sys.exit(code)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: the loop's message names the rounds
        for signum in (signal.SIGINT, signal.SIGTERM):  # no traceback from a further one
            signal.signal(signum, signal.SIG_IGN)
        # A second signal during the clean-up after a stop: the stop's message says where the
        # sweep resumes.
        stop = e
        while stop is not None and not isinstance(stop, train.RunInterrupted):
            stop = stop.__context__  # through what the clean-up raised and handled
        e = stop or e
        print(f"\n{e}" if str(e) else "\ninterrupted", file=sys.stderr)
        code = 128 + (getattr(e, "signum", None) or signal.SIGINT)
        if distributed:  # every process stopped at the same round, or this one at once
            multiprocess.leave(code, together=not getattr(e, "at_once", True))
        sys.exit(code)
    except Exception:
        if distributed:  # a collective failed because a process died: one line naming it
            multiprocess.exit_if_peers_lost()
        raise


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser)
