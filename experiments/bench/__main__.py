"""``python -m experiments.bench SUBCOMMAND [options]`` (see the package docstring)."""

import sys

from experiments.bench.cli import main

sys.exit(main())
