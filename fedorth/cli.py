r"""The ``fedorth`` command, installed with the package.

    fedorth run --config=fedpac_soap --workdir=runs/fedpac_soap [--config.KEY=VALUE ...]
    fedorth list
    fedorth config fedpac_soap:cifar100_resnet18 [--config.KEY=VALUE ...]
    fedorth sweep --config=fedavg --workdir=runs/sweep --sweep.seed=42,43,44
    fedorth report runs/ --no-plot
    fedorth prepare cifar100

``fedorth run`` is ``python -m experiments.main``; ``sweep``, ``report`` and ``prepare`` are
``python -m experiments.sweep``, ``.report`` and ``.prepare``; ``list`` is ``--list``;
``config`` prints the config a run would write to ``config.json``, after the command line's
overrides and switches, without running it.

Unlike ``python -m experiments.main``, which imports ``experiments`` and ``configs`` from the
current directory first, the command finds the ``experiments`` and ``configs`` packages shipped
beside ``fedorth`` (:func:`fedorth.catalog.shipped_package`), so a user's own folders of those
names do not hide them.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Sequence

from fedorth.catalog import print_config, shipped_package

USAGE = """\
usage: fedorth COMMAND [ARGS]

Federated learning with orthogonalized and second-order local optimizers (JAX/Optax).

commands:
  run      run one experiment (or resume it):
             fedorth run --config=NAME[:PRESET] --workdir=DIR [--config.KEY=VALUE ...]
  list     the algorithms, configs and their presets (by paper and table), models, datasets
           and optimizers
  config   print the config a run would use, without running it:
             fedorth config NAME[:PRESET] [--config.KEY=VALUE ...]
  sweep    a grid of seeds and hyperparameters of one config as one compiled program:
             fedorth sweep --config=NAME[:PRESET] --workdir=DIR --sweep.seed=42,43,44 ...
  report   tabulate and plot runs, seeds aggregated: fedorth report DIR ... [--no-plot]
  prepare  prepare a TFDS dataset once: fedorth prepare NAME [--data_dir=DIR]

`fedorth COMMAND --help` lists a command's flags. `fedorth run` takes the arguments of
`python -m experiments.main` (README.md, "Running experiments").
"""


LIST_HELP = (
    "Prints the algorithms, the configs and their presets (by paper and table), the models, "
    "datasets and optimizers, each with its paper. Takes no arguments."
)


def _error(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


_HELP = ("-h", "--help", "--helpshort", "-?")


def _flags_help(usage: str, *modules: types.ModuleType) -> int:
    """``fedorth COMMAND --help``: the command's usage and the flags its modules define (absl's
    own ``--help`` lists the flags of the program's main module, which here is this one)."""
    from absl import flags

    try:
        helps = [flags.FLAGS.module_help(module) for module in modules]
        print(f"usage: {usage}\n" + "\n\n".join(h for h in helps if h))
        print("\nThe flags of absl (verbosity, logging) are listed by --helpfull.", flush=True)
    except BrokenPipeError:  # `... --help | head`: the rest goes nowhere, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


RUN_USAGE = "fedorth run --config=NAME[:PRESET] --workdir=DIR [--config.KEY=VALUE ...]"
SWEEP_USAGE = (
    "fedorth sweep --config=NAME[:PRESET] --workdir=DIR --sweep.KEY=V1,V2,... "
    "[--config.KEY=VALUE ...]"
)


def _run(argv: Sequence[str]) -> int:
    from absl import app

    from experiments import launch
    from experiments import main as run_main

    if any(a in _HELP for a in argv):
        return _flags_help(RUN_USAGE, run_main, launch)
    sys.argv = ["fedorth run", *argv]
    app.run(run_main.main, flags_parser=run_main.flags_parser)  # exits
    return 0


def _config(argv: Sequence[str]) -> int:
    """``fedorth config NAME[:PRESET] [--config.KEY=VALUE ...]``."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fedorth config NAME[:PRESET] [--config.KEY=VALUE ...]")
        return 0 if argv else 2
    return print_config(argv[0].removeprefix("--config="), argv[1:])


def _list(argv: Sequence[str]) -> int:
    if list(argv) in (["-h"], ["--help"]):
        print("usage: fedorth list\n\n" + LIST_HELP)
        return 0
    if argv:
        return _error(f"fedorth list takes no arguments, got {list(argv)}")
    from fedorth import catalog

    print(catalog.listing(catalog.config_dir()))
    return 0


def _report(argv: Sequence[str]) -> int:
    from experiments import report

    report.main(list(argv))
    return 0


def _prepare(argv: Sequence[str]) -> int:
    from experiments import prepare

    return prepare.main(list(argv))


def _sweep(argv: Sequence[str]) -> int:
    from absl import app

    from experiments import launch, sweep

    if any(a in _HELP for a in argv):
        return _flags_help(SWEEP_USAGE, sweep, launch)
    sys.argv = ["fedorth sweep", *argv]
    app.run(sweep.main, flags_parser=sweep.flags_parser)  # exits
    return 0


COMMANDS = {
    "run": _run,
    "list": _list,
    "config": _config,
    "sweep": _sweep,
    "report": _report,
    "prepare": _prepare,
}


def main(argv: Sequence[str] | None = None) -> int:
    """The ``fedorth`` console script (``[options.entry_points]`` in setup.cfg)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        from fedorth import __version__

        print(f"fedorth {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        return _error(
            f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (fedorth --help)"
        )
    # Before anything loads NumPy or JAX: experiments/__init__.py sets the process-wide thread
    # and CPU-device settings; then `import experiments` / `configs` are the shipped packages.
    shipped_package("experiments")
    shipped_package("configs")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
