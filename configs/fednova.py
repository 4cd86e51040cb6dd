r"""FedNova (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", Sec. 4): normalized averaging of clients that run different numbers of
local SGD steps, ``x <- x + tau_eff mean_i (x_i - x) / ||a_i||_1``
(fedorth/fed/algorithms/fednova.py).

    python -m experiments.main --config=configs/fednova.py --workdir=runs/fednova
    python -m experiments.main --config=configs/fednova.py:cifar100_resnet18 --workdir=...

With every client running the same ``K`` steps FedNova is FedAvg; these configs give the
clients different step counts, as FedNova's experiments do (local epochs drawn per client and
round from [2, 5], Sec. 7): client ``i`` runs ``tau_i`` uniform in ``{min_local_steps, ...,
K}`` per round, ``min_local_steps = 2K/5`` (``K`` as five epochs of ``K/5`` steps: our
reading).

Presets: the CIFAR-100 setting of FedPAC (Liu et al.) Table 1 and FedMuon (Liu et al.) Table 2
(``cifar100_resnet18``, ``cifar100_vit``: 100 clients, 10% participation, Dir-0.1, K = 50,
so ``tau_i`` in {20, ..., 50}) with FedAvg's local hyperparameters there (FedPAC Table 8/10 SGD
row: lr 0.1, weight decay 0.001).
"""

from configs import base, presets

PRESETS = presets.cifar100_presets(presets.FEDPAC_OPTIM["sgd"], {"min_local_steps": 20})


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fednova"
    config.fed.options.min_local_steps = 2 * config.fed.local_steps // 5
    config.optim.name = "sgd"
    return presets.select(config, arg, PRESETS, "fednova")
