"""The papers' tables that ``python -m experiments.reproduce`` runs, with their published numbers.

Each :class:`Table` names its methods (a config of ``configs/`` each), its columns (the paper
preset of each column, and what the column changes at ``--scale small`` on the embedded data),
the random seeds, and the numbers the paper prints, transcribed with the table and row
they come from (docs/PAPERS.md has the references). Where a paper shows a comparison as curves
only, ``published`` is None and ``source`` names the figure: there is nothing to transcribe.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class Column:
    """A column of a table: its paper preset and its small-scale overrides."""

    name: str
    preset: str  # the preset of every method's config at --scale paper
    small: dict[str, Any]  # config overrides at --scale small (the embedded default preset)


@dataclasses.dataclass(frozen=True)
class Method:
    """A row: the label the paper prints and the config that runs it.

    ``small``: config overrides of this method at ``--scale small``, applied after the column's
    (in order; ``"optim"`` replaces the whole section), so that the small table compares what
    the paper compares under the paper's rule (e.g. FedPAC's variants at their Local X's
    learning rate). ``preset_suffix``: appended to the column's preset at ``--scale paper``
    (the LMO paper's Adam baselines, ``..._adam``).
    """

    label: str
    config: str  # a config name of configs/ (python -m experiments.main --config=NAME)
    small: dict[str, Any] = dataclasses.field(default_factory=dict)
    preset_suffix: str = ""


@dataclasses.dataclass(frozen=True)
class Table:
    key: str
    paper: str
    source: str  # the table (or figure) and its caption, as the paper gives them
    methods: tuple[Method, ...]
    columns: tuple[Column, ...]
    # label -> one number per column, in the paper's units (test accuracy or AUC in %), or None.
    published: dict[str, tuple[float, ...]] | None
    seeds: tuple[int, ...] = (42, 43, 44, 45, 46)
    small_seeds: tuple[int, ...] = (42, 43)
    small_rounds: int = 30
    metric: str = "test_accuracy"
    # "final": the metric at the last round; "best": its maximum over the evaluated rounds.
    # Each table follows its paper (FedPAC Tables 12-13: "the final test accuracy after 300
    # communication rounds"; FedMuon (Liu et al.) Sec. 7: "a top accuracy of 74.12%").
    reported: str = "final"
    reported_why: str = "the paper shows curves: ours is their last point"


def _dir(alpha: float) -> dict[str, Any]:
    """The small scale of a Dirichlet-``alpha`` column: the embedded digits (1437 examples) over
    10 clients, since at alpha = 0.05 some of the default 20 clients would get no example, with
    the papers' split (Hsu et al. 2019, ``dirichlet_hsu``: every paper with a Dir-alpha column
    follows it; docs/FIDELITY.md, "The Dirichlet split")."""
    return {"data.alpha": alpha, "data.num_clients": 10, "data.partition": "dirichlet_hsu"}


def _optim_of(config: str) -> dict[str, Any]:
    """The ``optim`` section of ``configs/<config>``'s default preset, as a small override."""
    module = importlib.import_module(f"configs.{config}")
    return {"optim": module.get_config().optim.to_dict()}


# FedPAC (Liu et al.) Table 8: Local Sophia and FedPAC_Sophia share (beta1, beta2) = (0.9, 0.99).
_SOPHIA_TABLE8 = {"optim.b1": 0.9, "optim.b2": 0.99}

# The LMO paper runs LocalMuon and FedMuon with one inexact LMO, one EMA momentum (weight 0.1 on
# the gradient: Alg. 1 line 8, Alg. 4 line 7) and momentum SGD on the non-matrix leaves (Appendix
# G): LocalMuon at the small scale takes configs/fedmuon_bc.py's default (spectral LMO, 5
# classic Newton-Schulz steps, no shape factor, lr 0.05, non-matrix leaves at 1.0 x lr).
_LMO_LOCAL_MUON = {
    "optim": {
        "name": "muon",
        "learning_rate": 0.05,
        "beta": 0.9,
        "ema": True,
        "nesterov": False,
        "ns_steps": 5,
        "ns_coeffs": "classic",
        "shape_scaling": "none",
        "fallback": "momentum_sgd",
        "fallback_lr_ratio": 1.0,
        "weight_decay": 0.0,
        "schedule": "constant",
    }
}


def _zg(period: int) -> dict[str, Any]:
    """FedMuon (Zhang & Gao) Sec. 7 at the small scale: 8 workers, all of them every round, an
    i.i.d. split, K = tau = ``period`` local steps, for FedMuon and every baseline alike."""
    return {
        "fed.local_steps": period,
        "data.num_clients": 8,
        "fed.clients_per_round": 8,
        "data.partition": "iid",
    }


def _fedlada_options() -> dict[str, Any]:
    options = importlib.import_module("configs.fedlada").PAPER_OPTIONS
    return {f"fed.options.{name}": value for name, value in options.items()}


FEDPAC_TABLE1 = Table(
    key="fedpac:table1",
    paper="FedPAC (Liu et al.)",
    source=(
        "Table 1: Test accuracy of each method on CIFAR-100 and Tiny-Imagenet using ResNet-18 "
        "and ViT-Tiny over 300 communication rounds under Dir-0.1 and Dir-0.05 (100 clients, "
        "10% participation, batch size 50, K=50)"
    ),
    methods=(
        Method("FedAvg", "fedavg"),
        Method("SCAFFOLD", "scaffold"),
        Method("FedCM", "fedcm"),
        Method("Local AdamW", "local_adamw"),
        # FedPAC Sec. 6: "We set the learning rate of FedPAC variants to be same with Local
        # Sophia, Local Muon and Local SOAP"; Table 8: the same (beta1, beta2) for both Sophias.
        Method("Local Sophia", "local_sophia", small=_SOPHIA_TABLE8),
        Method(
            "FedPAC_Sophia", "fedpac_sophia", small={**_optim_of("local_sophia"), **_SOPHIA_TABLE8}
        ),
        Method("Local Muon", "local_muon"),
        Method("FedPAC_Muon", "fedpac_muon", small=_optim_of("local_muon")),
        Method("Local SOAP", "local_soap"),
        Method("FedPAC_SOAP", "fedpac_soap", small=_optim_of("local_soap")),
    ),
    columns=(
        Column("ResNet-18 CIFAR-100 Dir-0.1", "cifar100_resnet18", _dir(0.1)),
        Column("ResNet-18 CIFAR-100 Dir-0.05", "cifar100_resnet18_dir0.05", _dir(0.05)),
        Column("ResNet-18 Tiny-ImageNet Dir-0.1", "tiny_imagenet_resnet18", _dir(0.1)),
        Column("ResNet-18 Tiny-ImageNet Dir-0.05", "tiny_imagenet_resnet18_dir0.05", _dir(0.05)),
        Column("ViT-Tiny CIFAR-100 Dir-0.1", "cifar100_vit", _dir(0.1)),
        Column("ViT-Tiny CIFAR-100 Dir-0.05", "cifar100_vit_dir0.05", _dir(0.05)),
        Column("ViT-Tiny Tiny-ImageNet Dir-0.1", "tiny_imagenet_vit", _dir(0.1)),
        Column("ViT-Tiny Tiny-ImageNet Dir-0.05", "tiny_imagenet_vit_dir0.05", _dir(0.05)),
    ),
    reported_why='FedPAC Tables 12-13: "the final test accuracy after 300 communication rounds"',
    # FedPAC (Liu et al.) Table 1, one row per method (the arrows' gains left out).
    published={
        "FedAvg": (60.17, 56.75, 47.48, 43.80, 27.24, 23.42, 15.68, 14.05),
        "SCAFFOLD": (60.69, 56.43, 47.76, 43.92, 26.86, 23.23, 15.70, 14.21),
        "FedCM": (66.61, 62.65, 41.16, 36.00, 16.95, 14.74, 8.88, 8.15),
        "Local AdamW": (59.23, 55.24, 44.01, 40.00, 37.57, 36.06, 24.31, 21.35),
        "Local Sophia": (56.65, 50.89, 41.23, 36.15, 34.05, 32.25, 22.49, 21.14),
        "FedPAC_Sophia": (59.96, 53.66, 43.81, 36.37, 39.79, 32.71, 23.01, 22.37),
        "Local Muon": (67.26, 49.86, 52.83, 34.76, 44.00, 39.68, 30.51, 28.25),
        "FedPAC_Muon": (71.85, 65.56, 57.95, 54.00, 47.81, 41.76, 31.45, 30.25),
        "Local SOAP": (68.44, 58.16, 54.42, 50.02, 49.41, 41.68, 33.30, 30.36),
        "FedPAC_SOAP": (69.25, 64.16, 55.62, 51.81, 51.16, 47.55, 34.32, 31.33),
    },
)

FEDMUON_LIU_TABLE2 = Table(
    key="fedmuon_liu:table2",
    paper="FedMuon (Liu et al.)",
    source=(
        "Table 2: Test accuracy, training loss of each method on CIFAR-100 using ResNet-18 and "
        "ViT-Tiny over 300 communication rounds under Dir-0.6 and Dir-0.1 (100 clients, 10% "
        "participation, batch size 50, K=50); mean over seeds 42-46"
    ),
    methods=(
        Method("FedAvg", "fedavg"),
        Method("SCAFFOLD", "scaffold"),
        Method("FedCM", "fedcm"),
        # FedLADA's options of its paper presets (configs/fedlada.py: alpha 0.1, the authors'
        # released FedLADA).
        Method("FedLADA", "fedlada", small=_fedlada_options()),
        Method("Local AdamW", "local_adamw"),
        # Sec. 7 runs Local Muon with FedMuon's Muon (Alg. 2's M = 0.98 M + G, one rate).
        Method("Local Muon", "local_muon", small=_optim_of("fedmuon")),
        Method("FedMuon", "fedmuon"),
    ),
    columns=(
        Column("ResNet-18 Dir-0.6", "fedmuon_liu_cifar100_resnet18_dir0.6", _dir(0.6)),
        Column("ResNet-18 Dir-0.1", "fedmuon_liu_cifar100_resnet18_dir0.1", _dir(0.1)),
        Column("ViT-Tiny Dir-0.6", "fedmuon_liu_cifar100_vit_dir0.6", _dir(0.6)),
        Column("ViT-Tiny Dir-0.1", "fedmuon_liu_cifar100_vit_dir0.1", _dir(0.1)),
    ),
    # FedMuon (Liu et al.) Table 2, the "Test Acc" columns of each row (stds and losses left out).
    reported="best",
    reported_why='Sec. 7: FedMuon "reaching a top accuracy of 74.12% and 73.05%"',
    published={
        "FedAvg": (64.08, 60.25, 32.36, 27.14),
        "SCAFFOLD": (65.01, 59.37, 32.17, 27.31),
        "FedCM": (70.42, 66.73, 26.33, 23.18),
        "FedLADA": (65.07, 57.78, 38.33, 31.50),
        "Local AdamW": (62.84, 58.97, 40.47, 37.86),
        "Local Muon": (71.66, 66.71, 46.69, 40.53),
        "FedMuon": (74.12, 73.05, 50.22, 48.18),
    },
)

FEDMUON_LMO_CIFAR10 = Table(
    key="fedmuon_lmo:cifar10",
    paper="FedMuon-LMO (bias-corrected LMO)",
    source=(
        "Appendix G, CIFAR-10 with ResNet-18 under Dirichlet beta = 10 and 0.1 (its Table 3 "
        "gives the tuned learning rates; the accuracies are shown as curves only)"
    ),
    methods=(
        Method("FedAvg", "fedavg"),
        Method("FedAvg (Adam)", "local_adamw"),
        Method("SCAFFOLD", "scaffold"),
        Method(
            "SCAFFOLD (Adam)", "scaffold", small=_optim_of("local_adamw"), preset_suffix="_adam"
        ),
        Method("LocalMuon", "local_muon", small=_LMO_LOCAL_MUON),
        Method("FedMuon", "fedmuon_bc"),
    ),
    columns=(
        Column("ResNet-18 beta=10", "fedmuon_lmo_cifar10_resnet18_beta10", _dir(10.0)),
        Column("ResNet-18 beta=0.1", "fedmuon_lmo_cifar10_resnet18_beta0.1", _dir(0.1)),
    ),
    published=None,
)

FEDMUON_ZG_MAIN = Table(
    key="fedmuon_zg:main",
    paper="FedMuon (Zhang & Gao)",
    source=(
        "Section 7, CIFAR-10 with ResNet-18, 8 workers, all of them every round, i.i.d. split, "
        "communication period 4 and 16 (Figures 1 and 5: curves only, no table of numbers)"
    ),
    # Its eleven baselines (Sec. 7, "Baselines"), in its order.
    methods=(
        Method("FedAvg", "fedavg"),
        Method("SCAFFOLD", "scaffold"),
        Method("FedAvg-M", "fedavg_m"),
        Method("FedAvg-VR", "fedavg_vr"),
        Method("SCAFFOLD-M", "scaffold_m"),
        Method("SCAFFOLD-VR", "scaffold_vr"),
        Method("PAdaMFed", "padamfed"),
        Method("PAdaMFed-VR", "padamfed_vr"),
        Method("FedAdam", "fedadam"),
        Method("FAFED", "fafed"),
        Method("Adam-BiClip", "adam_biclip"),
        Method("FedMuon", "fedmuon_zg"),
    ),
    columns=(
        Column("ResNet-18 tau=4", "fedmuon_zg_cifar10_resnet18_tau4", _zg(4)),
        Column("ResNet-18 tau=16", "fedmuon_zg_cifar10_resnet18_tau16", _zg(16)),
    ),
    published=None,
)

MINIMAX_AUC = Table(
    key="minimax:auc",
    paper="Fed minimax (Zhang & Gao)",
    source=(
        "Section 5, deep AUC maximization on Sentiment140, r = 0.1, i.i.d., communication "
        "period p = 4 and 16 (Figures 1 and 2: test AUC curves only, no table of numbers)"
    ),
    methods=(
        Method("LocalSGDAM", "local_sgdam"),
        Method("FedSGDA-M", "fedsgda_m"),
        Method("F-SAGDA", "f_sagda"),
        Method("FESS-GDA", "fess_gda"),
        Method("FedSGDA-Clip", "fedsgda_clip"),
        Method("Fed-NSGDA-M", "fed_nsgda_m"),
        Method("FedMuon-DA", "fedmuon_da"),
    ),
    columns=(
        Column("Sentiment140 p=4", "sentiment140_homo_p4", {"fed.local_steps": 4}),
        Column("Sentiment140 p=16", "sentiment140_homo_p16", {"fed.local_steps": 16}),
    ),
    published=None,
    metric="test_auc",
)

TABLES: dict[str, Table] = {
    t.key: t
    for t in (FEDPAC_TABLE1, FEDMUON_LIU_TABLE2, FEDMUON_LMO_CIFAR10, FEDMUON_ZG_MAIN, MINIMAX_AUC)
}
