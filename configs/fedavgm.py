r"""FedAvgM (Hsu et al. 2019; Reddi et al. 2021): FedAvg whose server applies the averaged update
with momentum, ``v <- mu v + Delta``, ``x <- x + gamma v``.

    python -m experiments.main --config=configs/fedavgm.py --workdir=runs/fedavgm
    python -m experiments.main --config=configs/fedavgm.py:cifar100_resnet18 --workdir=...

Default preset: embedded digits, final test accuracy 0.97 (seed 42).

FedAvgM is not one of the papers' baselines: its presets run FedPAC (Liu et al.)'s settings (Tables 1/3) with
FedAvg's local hyperparameters (Table 8/10 SGD row: lr 0.1, weight decay 0.001) and server
momentum 0.9, server lr 1 (Hsu et al.'s usual choice): ``cifar100_resnet18``, ``cifar100_vit``,
``tiny_imagenet_resnet18``, ``tiny_imagenet_vit`` (Dir-0.1; ``*_dir0.05``), ``c4_llama{60m,130m,350m}``.

Reddi et al. 2021's natural-client tasks at its tuned client and server rates, clients
weighted by their examples: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_examples``
(docs/FIDELITY.md, "Reddi et al.'s natural-client tasks").
"""

from configs import base, presets

_SERVER = {"server_lr": 1.0, "server_momentum": 0.9}

PRESETS = {
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["sgd"], _SERVER),
    **presets.reddi_presets("fedavgm"),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedavgm"
    config.fed.options.server_lr = 1.0  # gamma
    config.fed.options.server_momentum = 0.9  # mu of the server's heavy ball
    config.optim.name = "sgd"
    config.optim.learning_rate = 0.05  # the server momentum amplifies the step ~1/(1 - mu)
    return presets.select(config, arg, PRESETS, "fedavgm")
