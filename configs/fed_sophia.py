r"""Fed-Sophia (Elbakary et al. 2024, Alg. 1), a second-order baseline of FedPAC (Liu et al.)
(Tables 12-13): devices run Sophia locally (keeping their own ``m`` and ``h``), the server
averages.

    python -m experiments.main --config=configs/fed_sophia.py --workdir=runs/fed_sophia
    python -m experiments.main --config=configs/fed_sophia.py:cifar100_resnet18 --workdir=...

Default preset: embedded digits, final test accuracy 0.93 (seed 42, 60 rounds).

Presets: (default) embedded digits on 2 CPU cores; FedPAC (Liu et al.)'s settings
(configs/presets.py): ``{cifar100,tiny_imagenet}_{resnet18,vit}`` (Dir-0.1), the same with
``_dir0.05``, and the other levels of Tables 12-13, ``_iid`` and ``_dir0.5``, with its Table 8's
Sophia (lr 3e-4, betas 0.9/0.99, weight decay 0.01; the box's clip at rho = 1, eps 1e-12, a
Hessian refresh every 10 steps: ``presets.FEDPAC_OPTIM["sophia"]`` says why rho is 1).

The digits default runs clients one after another (``fed.strategy="sequential"``): each device
keeps its own step count, so under ``vmap`` the Hessian refresh branch becomes a select and the
Hutchinson estimate is taken at every step; sequentially it is taken every ``update_interval``
steps (same numbers, less work on a CPU). The papers' presets batch clients (``"vmap"``).
"""

import ml_collections

from configs import base, presets

PAPER_OPTIM = presets.FEDPAC_OPTIM["sophia"]


def table12_presets(options) -> dict[str, presets.Preset]:
    """FedPAC (Liu et al.) Tables 12-13: the vision settings (IID, Dir-0.5, Dir-0.1, Dir-0.05)."""
    out = {}
    for name, preset in presets.fedpac_presets(PAPER_OPTIM, options, c4=False).items():

        def vision(config, preset=preset):
            config = preset(config)
            config.fed.strategy = "vmap"  # clients batched on the accelerator
            return config

        out[name] = vision
    return out


PRESETS = table12_presets({"client_state": "persistent"})


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fed_sophia"
    config.fed.options.client_state = "persistent"  # devices keep m, h ("reset": Local Sophia)
    config.fed.strategy = "sequential"  # see the module docstring
    config.optim = ml_collections.ConfigDict(
        {
            "name": "sophia",
            "learning_rate": 0.1,
            "schedule": "constant",
            "weight_decay": 0.0,
            "b1": 0.9,
            "b2": 0.99,
            "rho": 0.04,  # clip level of m / max(h, eps)
            "update_interval": 10,  # steps between Hessian refreshes
            "estimator": "hutchinson",
        }
    )
    return presets.select(config, arg, PRESETS, "fed_sophia")
