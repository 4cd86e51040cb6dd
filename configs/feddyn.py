r"""FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization", Alg. 1):
local SGD on the dynamically regularized loss ``L_k(w) - <grad L_k, w> + alpha/2 ||w -
w^{t-1}||^2``; each client keeps its ``grad L_k``, the server its ``h``, and ``w^t = mean_k w_k
- h / alpha`` (fedorth/fed/algorithms/feddyn.py).

    python -m experiments.main --config=configs/feddyn.py --workdir=runs/feddyn
    python -m experiments.main --config=configs/feddyn.py:cifar100_resnet18 --workdir=...

Presets: the CIFAR-100 setting of FedPAC (Liu et al.) Table 1 and FedMuon (Liu et al.) Table 2
(``cifar100_resnet18``, ``cifar100_vit``: 100 clients, 10% participation, Dir-0.1, K = 50),
with FedAvg's local hyperparameters there (FedPAC Table 8/10 SGD row: lr 0.1, weight decay
0.001) and alpha 0.01 (the middle of FedDyn Sec. 5's grid {0.1, 0.01, 0.001}; neither paper
runs FedDyn, so none is tuned for it).
"""

from configs import base, presets

PRESETS = presets.cifar100_presets(presets.FEDPAC_OPTIM["sgd"], {"alpha": 0.01})


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "feddyn"
    config.fed.options.alpha = 0.01  # the dynamic regularizer's weight
    config.optim.name = "sgd"
    return presets.select(config, arg, PRESETS, "feddyn")
