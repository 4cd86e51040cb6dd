"""The launch flags of a command that runs on several processes (``jax.distributed``), shared by
``experiments.main`` and ``experiments.sweep``: ``--distributed``, ``--coordinator_address``,
``--num_processes``, ``--process_id`` (left out: detected from SLURM, Open MPI or a TPU pod) and
``--heartbeat_timeout_s``."""

from __future__ import annotations

from absl import flags

DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() first (multi-host runs)."
)
COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id in [0, n).")
HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s",
    10,
    "With --distributed: seconds without a heartbeat after which a silent process (a host that "
    "lost power) counts as dead and the others stop; a killed process is found in about 2 s.",
)


def initialize() -> bool:
    """Starts ``jax.distributed`` when ``--distributed`` or ``--coordinator_address`` is given
    (before anything starts a JAX backend); whether it did."""
    if not (DISTRIBUTED.value or COORDINATOR.value):
        return False
    from fedorth.train import distributed

    distributed.initialize(
        COORDINATOR.value,
        NUM_PROCESSES.value,
        PROCESS_ID.value,
        heartbeat_timeout_s=HEARTBEAT.value,
    )
    return True
