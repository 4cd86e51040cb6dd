r"""FedAdamW (arXiv 2510.27486, by the FedMuon (Liu et al.) and FedPAC authors), as their released
code runs it: local AdamW (m restarted each round, v and the step count from the server's
average, bias-corrected at the global step) plus half the previous round's global direction,
``x <- x - eta [AdamW(g) + 0.5 g_G]`` (fedorth.fed.algorithms.baselines_fedlada.fedadamw cites
the code).

    python -m experiments.main --config=configs/fedadamw.py --workdir=runs/fedadamw
    python -m experiments.main --config=configs/fedadamw.py:cifar100_resnet18 --workdir=...

Presets: the CIFAR-100 setting of FedPAC (Liu et al.) Table 1 and FedMuon (Liu et al.) Table 2
(``cifar100_resnet18``, ``cifar100_vit``: 100 clients, 10% participation, Dir-0.1, K = 50,
cosine) with the released code's AdamW (betas (0.9, 0.999), decoupled weight decay 0.01,
gamma 0.5) at FedPAC Table 8/10's Local AdamW rate 3e-4 (the code's rate is a command-line
argument). The code also clips every method's gradients at norm 10; no fedorth preset clips,
so this one does not either (``fed.options.clip_norm=10`` does).
"""

from configs import base, presets

PRESETS = presets.cifar100_presets(presets.FEDPAC_OPTIM["adamw"], {"gamma": 0.5})


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedadamw"
    config.fed.options.gamma = 0.5  # weight of the previous round's global direction
    config.optim.name = "adamw"
    config.optim.learning_rate = 0.003  # configs/local_adamw.py's default rate
    config.optim.b1 = 0.9
    config.optim.b2 = 0.999
    config.optim.weight_decay = 0.01  # decoupled, as the released code's AdamW
    return presets.select(config, arg, PRESETS, "fedadamw")
