r"""DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", Alg. 1): AdamW local (inner) steps, and on the server an outer Nesterov momentum SGD
on the outer gradient ``Delta = x - mean_i x_i``: FedAvg with ``fed.options.server_opt=
"nesterov"``, which any algorithm takes.

    python -m experiments.main --config=configs/diloco.py --workdir=runs/diloco
    python -m experiments.main --config=configs/diloco.py:cifar100_resnet18 --workdir=...

Outer step (PyTorch's Nesterov SGD, as DiLoCo's): ``v <- mu v + Delta``, ``x <- x - lr (Delta
+ mu v)``, lr 0.7 and mu 0.9 (DiLoCo Sec. 3). DiLoCo trains every replica on an iid shard and
all take part every round; fedorth samples ``S`` of ``N`` clients as for every algorithm, and the
inner AdamW starts from a fresh state each round, as FedAvg's (DiLoCo keeps each replica's inner
state: ``fed.options.client_state="persistent"``).

Presets: the CIFAR-100 setting of FedPAC (Liu et al.) Table 1 and FedMuon (Liu et al.) Table 2
(``cifar100_resnet18``, ``cifar100_vit``: 100 clients, 10% participation, Dir-0.1, K = 50)
with the Local AdamW row there (lr 3e-4, betas (0.9, 0.999), weight decay 0.01) and DiLoCo's
outer values.
"""

from configs import base, presets

PRESETS = presets.cifar100_presets(presets.FEDPAC_OPTIM["adamw"], presets.DILOCO_OUTER)


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedavg"
    presets.set_options(config, presets.DILOCO_OUTER)  # Nesterov, lr 0.7, momentum 0.9
    config.optim.name = "adamw"
    config.optim.learning_rate = 0.003  # configs/local_adamw.py's default rate
    config.optim.b1 = 0.9
    config.optim.b2 = 0.999
    return presets.select(config, arg, PRESETS, "diloco")
