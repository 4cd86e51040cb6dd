r"""FedPAC_Sophia_light (FedPAC (Liu et al.) Table 11): FedPAC_Sophia whose clients upload h
(Theta) low-rank (truncated SVD keeping 5% of each matrix's rank).

    python -m experiments.main --config=configs/fedpac_sophia_light.py --workdir=runs/fedpac_sophia_light
    python -m experiments.main --config=configs/fedpac_sophia_light.py:cifar100_vit_dir0.05 --workdir=...

Default preset: the FedPAC_Sophia default (configs/fedpac_sophia.py) with 30 rounds (two SVDs
per matrix and client dominate the CPU time), final test accuracy 0.92 (seed 42; 0.9167 since
FedPAC aligns and uploads Theta = {h} only, Alg. 2; ``fed.options.aligned="state"`` gives 0.95).

Presets: those of configs/fedpac_sophia.py (FedPAC (Liu et al.) Tables 1/3/12/13, Table 8/10
values).

Reddi et al. 2021's natural-client tasks with this config's default optimizer and options,
clients weighted uniformly: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_uniform``.
"""

from configs import fedpac_sophia, presets

PRESETS = {
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["sophia"], {"beta": 0.5, "aligned": "theta"}),
    **presets.reddi_uniform_presets(),
}


def get_config(arg: str | None = None):
    config = fedpac_sophia.get_config()
    config.fed.algorithm = "fedpac_sophia_light"  # fedpac_sophia + light_ratio 0.05
    config.fed.rounds = 30  # base: 60
    config.checkpoint_every = 10  # base: 20
    return presets.select(config, arg, PRESETS, "fedpac_sophia_light")
