r"""FedAdagrad (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 2): local SGD; the
server runs Adagrad with momentum on the pseudo-gradient ``-Delta``: FedAvg with
``fed.options.server_opt="adagrad"``.

    python -m experiments.main --config=configs/fedadagrad.py --workdir=runs/fedadagrad
    python -m experiments.main --config=configs/fedadagrad.py:cifar100_resnet18 --workdir=...

Alg. 2's Adagrad: ``m <- b1 m + (1 - b1) Delta``, ``v <- v + Delta^2``, ``x <- x + eta m /
(sqrt(v) + tau)``, with ``v`` from 0 as fedorth's FedAdam
(``fedorth.optim.momentum_vr.scale_by_reddi_adaptive``). Alg. 2 writes the first moment for
FedAdagrad too, and b1 = 0.9 here as for FedAdam; Flower's ``FedAdagrad`` defaults to b1 = 0
(plain Adagrad): ``--config.fed.options.server_b1=0`` runs that.

Presets: the CIFAR-100 setting of FedPAC (Liu et al.) Table 1 and FedMuon (Liu et al.) Table 2
(``cifar100_resnet18``, ``cifar100_vit``: 100 clients, 10% participation, Dir-0.1, K = 50),
with FedAvg's local hyperparameters there (FedPAC Table 8/10 SGD row: lr 0.1, weight decay
0.001) and FedAdam's server values (server lr 0.01, b1 0.9, tau 1e-3; neither paper runs
FedAdagrad, so none is tuned for it).

Reddi et al. 2021's natural-client tasks at its tuned client and server rates, clients
weighted by their examples: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_examples``
(docs/FIDELITY.md, "Reddi et al.'s natural-client tasks").
"""

from configs import base, presets

PRESETS = {
    **presets.cifar100_presets(presets.FEDPAC_OPTIM["sgd"], presets.reddi_server("adagrad")),
    **presets.reddi_presets("fedadagrad"),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    presets.reddi_default(config, "adagrad")  # configs/fedadam.py's default, Alg. 2's Adagrad
    return presets.select(config, arg, PRESETS, "fedadagrad")
