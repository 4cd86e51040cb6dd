r"""FedPAC_Sophia (FedPAC (Liu et al.) Alg. 2 with Appendix Alg. 9): Sophia local steps warm-started
from the averaged h (Theta; m restarts each round), corrected with the global direction g_G.

    python -m experiments.main --config=configs/fedpac_sophia.py --workdir=runs/fedpac_sophia
    python -m experiments.main --config=configs/fedpac_sophia.py:cifar100_resnet18 --workdir=...

The aligned state keeps its step count across rounds (Alg. 9 counts r K + k), so the Hessian EMA
is refreshed every f_h steps whatever K is. Default preset: embedded digits, f_h = 2, final test
accuracy 0.95 (seed 42; 0.9472 since FedPAC aligns Theta = {h} only, Alg. 2;
``fed.options.aligned="state"``, m and h as before, gives 0.9556).

Presets: FedPAC (Liu et al.) Tables 1/3/12/13 with Table 8/10's FedPAC_Sophia row (lr 3e-4, beta
0.5, betas (0.9, 0.99), weight decay 0.01; the box's clip at rho = 1 (``presets.FEDPAC_OPTIM``
says why), f_h = 10; the table's "Muon" in that row is a typo): ``cifar100_resnet18``,
``cifar100_vit``, ``tiny_imagenet_resnet18``, ``tiny_imagenet_vit`` (Dir-0.1; ``*_dir0.05``,
``*_dir0.5``, ``*_iid``), ``c4_llama{60m,130m,350m}`` (configs/presets.py).

Fine-tuning (docs/FINETUNING.md): FedPAC (Liu et al.) Table 2 ``vit_base_{cifar100,tiny_imagenet}``,
Table 9's FedPAC_Sophia row (lr 1e-4, beta 0.5, (0.9, 0.99), wd 0.01).

Reddi et al. 2021's natural-client tasks with this config's default optimizer and options,
clients weighted uniformly: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_uniform``.
"""

from configs import base, presets

PRESETS = {
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["sophia"], {"beta": 0.5, "aligned": "theta"}),
    # FedPAC (Liu et al.) Table 2 with Table 9's row: lr 1e-4, (0.9, 0.99), wd 0.01, beta 0.5.
    **presets.fedpac_finetune_presets(
        presets.FEDPAC_FINETUNE_OPTIM["sophia"], {"beta": 0.5, "aligned": "theta"}
    ),
    **presets.reddi_uniform_presets(),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedpac_sophia"
    config.fed.options.beta = 0.5  # correction weight of g_G
    config.fed.options.aligned = "theta"  # Alg. 2: align Theta only; "state": whole state
    config.optim.name = "sophia"
    config.optim.learning_rate = 0.05  # base: 0.05; the step is at most lr * rho per entry
    config.optim.b1 = 0.9
    config.optim.b2 = 0.99
    config.optim.rho = 0.04
    config.optim.update_interval = 2  # f_h: Hessian refresh every 2 local steps
    return presets.select(config, arg, PRESETS, "fedpac_sophia")
