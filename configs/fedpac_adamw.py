r"""FedPAC over AdamW: FedPAC's alignment (average Adam's moments, warm-start clients from them)
and correction (mix with g_G) applied to an optimizer none of the papers pairs it with.

    python -m experiments.main --config=configs/fedpac_adamw.py --workdir=runs/fedpac_adamw
    python -m experiments.main --config=configs/fedpac_adamw.py:cifar100_vit --workdir=...

This is the "FedPAC for any optimizer" capability (fedorth/fed/algorithms/fedpac.py): the
``fedpac`` algorithm works over any direction of ``fedorth.fed.local.DIRECTIONS`` whose state is
averageable -- change ``optim.name`` (e.g. ``--config.optim.name=sgd`` with momentum) to align
another optimizer. Adam's step count is a shared schedule counter, so the warm-started moments
keep their bias correction across rounds. Default preset: embedded digits, final test accuracy
0.98 (seed 42).

Presets: FedPAC (Liu et al.) Tables 1/3/12/13 with Table 8/10's AdamW values (lr 3e-4, betas (0.9,
0.999), weight decay 0.01) and FedPAC's beta 0.5 -- an extension, not a result of the paper:
``cifar100_resnet18``, ``cifar100_vit``, ``tiny_imagenet_resnet18``, ``tiny_imagenet_vit`` (Dir-0.1;
``*_dir0.05``, ``*_dir0.5``, ``*_iid``), ``c4_llama{60m,130m,350m}`` (configs/presets.py).
"""

from configs import base, presets

PRESETS = presets.fedpac_presets(presets.FEDPAC_OPTIM["adamw"], {"beta": 0.5})


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedpac"  # FedPAC over the optimizer named by optim.name
    config.fed.options.beta = 0.5  # correction weight of g_G
    config.fed.options.align = True  # average and warm-start Adam's (m, v)
    config.optim.name = "adamw"
    config.optim.learning_rate = 0.003  # base: 0.05 (an SGD rate)
    config.optim.b1 = 0.9
    config.optim.b2 = 0.999
    return presets.select(config, arg, PRESETS, "fedpac_adamw")
