r"""FedMuon_SVD (FedMuon (Liu et al.) Sec. 5.2, Table 7): FedMuon whose clients upload each
momentum matrix as its top-k singular triplets, k = 5% of the rank.

    python -m experiments.main --config=configs/fedmuon_svd.py --workdir=runs/fedmuon_svd
    python -m experiments.main --config=configs/fedmuon_svd.py:fedmuon_liu_cifar100_resnet18_dir0.1 \
        --workdir=...

Default preset: embedded digits, 30 rounds (the per-client SVDs dominate the CPU time), FedMuon's
Muon (Alg. 2, ``M = 0.98 M + G``, as configs/fedmuon.py), final test accuracy 0.9417 (seed 42).
``muon_reference``: the previous default (Nesterov momentum 0.9, Jordan's shape factor, Adam at
the Muon rate, no weight decay), 0.95.

Presets: the same settings and values as ``configs/fedmuon.py`` (its Table 2, with FedMuon's
Muon, ``presets.fedmuon_liu_muon``, and FedPAC (Liu et al.)'s settings), with ``svd_ratio = 0.05``;
Table 7's ``Agg-m-SVD`` row is ``fedmuon_liu_table7_{resnet18,vit}_agg_m_svd`` (CIFAR-100, Dir-0.1).

Reddi et al. 2021's natural-client tasks with this config's default optimizer and options,
clients weighted uniformly: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_uniform``.
"""

from configs import base, fedmuon, presets

_OPTIONS = {"alpha": 0.5, "svd_ratio": 0.05}

_FEDMUON_LIU = presets.fedmuon_liu_presets(
    {"resnet18": fedmuon.muon(3e-2), "vit_tiny": fedmuon.muon(2e-2)}, _OPTIONS
)

PRESETS = {
    "muon_reference": presets.muon_reference(0.9),
    **_FEDMUON_LIU,
    **{
        f"fedmuon_liu_table7_{short}_agg_m_svd": _FEDMUON_LIU[
            f"fedmuon_liu_cifar100_{short}_dir0.1"
        ]
        for short in ("resnet18", "vit")
    },
    **presets.fedpac_presets(fedmuon.muon(3e-2), _OPTIONS),
    **presets.reddi_uniform_presets(),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedmuon_svd"
    config.fed.rounds = 30  # base: 60
    config.checkpoint_every = 10  # base: 20
    config.fed.options.alpha = 0.5  # local-global alignment weight
    config.fed.options.svd_ratio = 0.05  # rank kept when uploading the momentum
    # FedMuon's Muon (configs/fedmuon.py): Alg. 2 at lr 0.02, M = 0.98 M + G.
    presets.set_optim(config, presets.default_muon("fedmuon_liu", 0.02))
    return presets.select(config, arg, PRESETS, "fedmuon_svd")
