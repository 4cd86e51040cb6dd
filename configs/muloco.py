r"""MuLoCo (arXiv 2505.23725, "MuLoCo: Muon is a practical inner optimizer for DiLoCo"): Muon
local (inner) steps and DiLoCo's outer Nesterov momentum SGD on the outer gradient ``Delta =
x - mean_i x_i`` (Douillard et al. 2023, Alg. 1): FedAvg with the Muon local optimizer and
``fed.options.server_opt="nesterov"``.

    python -m experiments.main --config=configs/muloco.py --workdir=runs/muloco
    python -m experiments.main --config=configs/muloco.py:cifar100_resnet18 --workdir=...

The outer step is configs/diloco.py's (lr 0.7, momentum 0.9: DiLoCo's values; MuLoCo's own
tuned outer values and its compression of ``Delta`` are not transcribed). The Muon is each
setting's Local Muon (configs/local_muon.py: FedPAC (Liu et al.) Alg. 6, EMA momentum 0.9, no
Nesterov, Jordan's quintic, weight decay 0.01, AdamW on the leaves Muon does not
orthogonalize), so MuLoCo differs from Local Muon by its server step alone.

Presets: ``cifar100_resnet18``, ``cifar100_vit`` (FedPAC (Liu et al.) Table 1's CIFAR-100
setting, 100 clients, 10% participation, Dir-0.1, K = 50) with its Local Muon row.
"""

from configs import base, presets

PRESETS = presets.cifar100_presets(presets.FEDPAC_OPTIM["muon"], presets.DILOCO_OUTER)


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedavg"
    presets.set_options(config, presets.DILOCO_OUTER)  # Nesterov, lr 0.7, momentum 0.9
    # configs/local_muon.py's default Muon (FedPAC (Liu et al.) Alg. 6 at lr 0.05).
    presets.set_optim(config, presets.default_muon("fedpac", 0.05))
    config.optim.group_shapes = False
    return presets.select(config, arg, PRESETS, "muloco")
