r"""FedPAC_Muon_light (FedPAC (Liu et al.) Table 11): FedPAC_Muon whose clients upload the
momentum low-rank (truncated SVD keeping 5% of each matrix's rank).

    python -m experiments.main --config=configs/fedpac_muon_light.py --workdir=runs/fedpac_muon_light
    python -m experiments.main --config=configs/fedpac_muon_light.py:cifar100_vit_dir0.05 --workdir=...

Default preset: the FedPAC_Muon default (configs/fedpac_muon.py: Alg. 7's Muon) with 30 rounds
(the per-client SVDs dominate the CPU time), final test accuracy 0.9472 (seed 42;
``muon_reference``, the Muon reference form it ran before, 0.9611).

Presets: those of configs/fedpac_muon.py (Tables 1/3/12/13, Table 8/10 values, its Muon).

Reddi et al. 2021's natural-client tasks with this config's default optimizer and options,
clients weighted uniformly: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_uniform``.
"""

from configs import fedpac_muon, presets

PRESETS = {
    "muon_reference": presets.muon_reference(0.9),
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["muon"], {"beta": 0.5, "aligned": "theta"}),
    **presets.reddi_uniform_presets(),
}


def get_config(arg: str | None = None):
    config = fedpac_muon.get_config()
    config.fed.algorithm = "fedpac_muon_light"  # fedpac_muon + light_ratio 0.05
    config.fed.rounds = 30  # base: 60
    config.checkpoint_every = 10  # base: 20
    return presets.select(config, arg, PRESETS, "fedpac_muon_light")
