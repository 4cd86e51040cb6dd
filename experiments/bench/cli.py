"""The benchmark's subcommands by name, and ``main`` dispatching on ``argv[1]``."""

from __future__ import annotations

import sys
from collections.abc import Callable

from experiments.bench import client_state, data, optim, rounds, startup, sweep

# name -> main(argv without the program and subcommand) -> exit status.
SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "client_state": client_state.main,
    "data": data.main,
    "optim": optim.main,
    "round": rounds.main,
    "startup": startup.main,
    "sweep": sweep.main,
}


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.bench SUBCOMMAND [options]``; `argv` as ``sys.argv``."""
    argv = sys.argv if argv is None else argv
    if len(argv) < 2 or argv[1] not in SUBCOMMANDS:
        print(f"usage: python -m experiments.bench {{{','.join(SUBCOMMANDS)}}} [options]")
        return 2
    return SUBCOMMANDS[argv[1]](argv[2:])
