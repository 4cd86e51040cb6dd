"""Benchmarks of fedorth, one subcommand each: ``python -m experiments.bench SUBCOMMAND [options]``.

    python -m experiments.bench optim [--shapes ...] [--json out.json]   # one optimizer update
    python -m experiments.bench round [--quick] [--json out.json]        # one federated round
    python -m experiments.bench sweep [--section cpu|gpu] [--json out.json] # replicas vs runs
    python -m experiments.bench data [--clients N] [--json out.json]    # clients streamed
    python -m experiments.bench startup [--rounds N] [--json out.json]  # the quick start's start
    python -m experiments.bench client_state [--clients 1000,10000]     # fed.client_state stores

The subcommands are registered by name in `experiments.bench.cli.SUBCOMMANDS`; each is a
function ``main(argv: list[str]) -> int`` in its own module, beside that module's
``parse_args(argv)`` (tests/test_bench.py parses every documented command with it). The
modules, by job (imports go down this list, never up, so the package has no import cycle):

* `measure` (synchronized timing, the reference matmul, compilations, memory), `flops` (model
  and Newton–Schulz FLOPs), `budget` (``--budget-s`` and interleaved repeats);
* `workloads` (models on random data, the algorithms, a `Case`);
* `runners` (fedorth's round and the PyTorch peer), `jax_loop` (the JAX per-step loop peer,
  built from the engine's own pieces), `sections` (``--memory``, ``--micro``, ``--scaling``),
  `presets` (``--preset targets``), `output` (tables, JSON); `cases` (one case: its runners,
  timed rounds and rows);
* `optim`, `rounds`, `sweep`, `data`, `startup` and `client_state`: the subcommands; `cli`:
  the registry and ``main``.

To add a subcommand: write its module with ``parse_args(argv)`` and ``main(argv) -> int``, and
add ``main`` to `cli.SUBCOMMANDS`.

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` (unless set) before any of its modules can
load torch: libgomp's default active spin-waiting makes the PyTorch peer collapse when the cores
are shared (measured on the 2-core machine: 4 instead of 37 CNN steps/s with 2 threads); passive
waiting gives torch its best numbers.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
