r"""Runs one federated experiment from a config file.

    python -m experiments.main --config=configs/fedpac_soap.py --workdir=runs/fedpac_soap
    python -m experiments.main --config=configs/fedpac_soap.py:cifar100_resnet18 \
        --workdir=runs/x --config.fed.rounds=10

Running the same command again resumes from the newest checkpoint in ``--workdir``.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from fedorth import train

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for metrics, checkpoints and plots.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Discard a different run in --workdir.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() first (multi-host runs)."
)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id in [0, n).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    if _DISTRIBUTED.value or _COORDINATOR.value:
        import jax

        # Arguments left as None are detected from the cluster (SLURM, Open MPI, TPU pods).
        jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    config = _CONFIG.value
    dropped = train.drop_keys_of_another_model(
        config, config_flags.get_override_values(flags.FLAGS["config"])
    )
    if dropped:
        print(
            f"note: --config.model.name={config.model.name}: the config file's {dropped} "
            "are not arguments of that model and were dropped.",
            file=sys.stderr,
        )
    try:
        train.run(config, _WORKDIR.value, overwrite=_OVERWRITE.value)
    except train.USER_ERRORS as e:  # bad input: the message says what to do, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, train.ConfigError) else 1)


if __name__ == "__main__":
    app.run(main, flags_parser=train.flags_parser)
