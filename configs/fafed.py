r"""FAFED (Wu et al. 2023, Alg. 1), a baseline of FedMuon (Zhang & Gao) Sec. 7: local STORM momentum ``u``,
adaptive matrix ``sqrt(v-bar) + rho`` frozen during a round; ``x``, ``u``, ``v`` averaged.

    python -m experiments.main --config=configs/fafed.py --workdir=runs/fafed
    python -m experiments.main --config=configs/fafed.py:fedmuon_zg_cifar10_resnet18_tau4 --workdir=...

Default preset: embedded digits, final test accuracy 0.96 (seed 42, 60 rounds; measured on 2 CPU
cores, with FAFED's start and per-client previous iterates as in its released code).

Presets: (default) embedded digits on 2 CPU cores; FedMuon (Zhang & Gao)'s settings
(``fedmuon_zg_*``: configs/presets.py; hyperparameter notes in configs/fedavg_m.py).
FAFED's own hyperparameters are algorithm options (``a``, ``b2``, ``rho``); ``optim`` is a
plain-gradient client giving the learning rate. On the digits default ``eta = 0.01`` with
``rho = 1e-3`` diverges (a coordinate whose ``v`` was small at the round's start takes steps of
``eta u / rho``); ``eta = 3e-3`` learns.
"""

from configs import base, presets

PRESETS = presets.fedmuon_zg_presets(
    {"name": "sgd", "learning_rate": 1e-3, "weight_decay": 5e-4},
    {"a": 0.1, "b2": 0.99, "rho": 1e-3},
)


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fafed"
    config.fed.options.a = 0.1  # STORM weight of the fresh gradient (u = g + (1-a)(u - g_prev))
    config.fed.options.b2 = 0.99  # decay of the second moment v
    config.fed.options.rho = 1e-3  # adaptive matrix sqrt(v-bar) + rho
    config.optim.name = "sgd"
    config.optim.learning_rate = 3e-3
    return presets.select(config, arg, PRESETS, "fafed")
