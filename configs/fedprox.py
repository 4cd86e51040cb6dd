r"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks", Alg. 2): local SGD
on the loss plus ``mu/2 ||w - x^r||^2``, the server averages.

    python -m experiments.main --config=configs/fedprox.py --workdir=runs/fedprox
    python -m experiments.main --config=configs/fedprox.py:cifar100_resnet18 --workdir=...

Default preset: embedded digits (20 clients, Dir-0.3, 5 per round, K = 10, 60 rounds), SGD at
FedAvg's learning rate 0.1, ``mu = 0.01``.

Presets (configs/presets.py): the papers' shared CIFAR-100 and Tiny-ImageNet settings of FedPAC
(Liu et al.) Tables 1/3 (100 clients, 10% participation, Dir-0.1 (``*_dir0.05``), K = 50, 300
rounds) with FedAvg's SGD row (lr 0.1, weight decay 0.001): ``cifar100_resnet18``,
``cifar100_vit``, ``tiny_imagenet_resnet18``, ``tiny_imagenet_vit``, and the C4 presets. The
papers do not run FedProx: ``mu = 0.01`` is the middle of Li et al.'s grid
``{0.001, 0.01, 0.1, 1}`` (their Sec. 5.3), untuned for these settings.
"""

from configs import base, presets

_OPTIONS = {"mu": 0.01}

PRESETS = presets.fedpac_presets(presets.FEDPAC_OPTIM["sgd"], _OPTIONS)


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedprox"
    config.fed.options.mu = 0.01
    config.optim.name = "sgd"
    config.optim.learning_rate = 0.1  # FedAvg's default (configs/fedavg.py)
    return presets.select(config, arg, PRESETS, "fedprox")
