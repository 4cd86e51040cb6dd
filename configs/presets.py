r"""The papers' experimental settings, shared by the algorithm configs' presets.

A *setting* fixes the data, model and federation (clients, participation, batch, K, rounds,
schedule); a config adds its algorithm's hyperparameters. Each config file builds its presets
with the helpers below and selects one with :func:`select`::

    PRESETS = presets.fedpac_presets(presets.FEDPAC_OPTIM["muon"], beta=0.5)
    def get_config(arg=None):
        config = ...  # the default (embedded digits) preset
        return presets.select(config, arg, PRESETS, "fedpac_muon")

Settings (seed files in docs/PAPERS.md):

* FedPAC (Liu et al.) (FedPAC) Table 1 / Tables 12-13: CIFAR-100 and Tiny-ImageNet, ResNet-18 (BN) and
  ViT-Tiny, 100 clients, 10% participation, batch 50, K = 50, 300 rounds, Dir-0.1 (and -0.05),
  cosine decay; Table 3 / Appendix D.6: C4 with LLaMA 60M/130M/350M, 20 clients, 20%
  participation, batch 16, K = 50, 100 rounds. Hyperparameters: Tables 8 and 10
  (:data:`FEDPAC_OPTIM`).
* FedMuon (Liu et al.) (FedMuon, Liu et al.) Sec. 7 / Table 2: CIFAR-100, ResNet-18 and ViT-Tiny, 100
  clients, 10% participation, batch 50, K = 50, 300 rounds, Dir-0.6 / 0.1 (0.05 as in FedPAC (Liu et al.)),
  cosine decay, seeds 42-46.
* FedMuon-LMO (FedMuon, bias-corrected LMO) Sec. 7.1 and Appendix G: FashionMNIST / LeNet-5 (100
  "epochs") and CIFAR-10 / ResNet-18 with GroupNorm (200), 16 clients, 8 sampled, K = 5,
  Dirichlet beta in {10, 0.1}; grid-searched step sizes (Appendix G Tables 2-3).
* FedMuon (Zhang & Gao) (FedMuon, Zhang & Gao) Sec. 7 and Appendix A: 8 workers, full participation, batch
  64, communication period tau in {4, 16} (= K), cosine decay; CIFAR-10/100 with ResNet-18 or
  the ViT of its Table 2, Sentiment140 (1% of the training set) with the RNN of its Table 3.
* Fine-tuning from pretrained checkpoints (``model.pretrained``; docs/FINETUNING.md):
  FedMuon (Liu et al.) Table 3, Swin-T on CIFAR-100 / Tiny ImageNet, 100 clients, 5%
  participation, batch 16, K = 50, 100 rounds, Dir-0.1 (:func:`fedmuon_liu_swin`), and Table 4,
  RoBERTa-base + LoRA rank 16 on seven GLUE tasks, 4 clients, full participation, Dir-0.8
  (:func:`fedmuon_liu_glue`); FedPAC (Liu et al.) Table 2 / Appendix D.5, ViT-B/16 from the
  ImageNet-21k weights, 50 clients, 10% participation, batch 16, K = 50, 100 rounds, Dir-0.1,
  RandAugment (:func:`fedpac_vit_base`). Rates: FedPAC Table 9 (:data:`FEDPAC_FINETUNE_OPTIM`);
  FedMuon Sec. 7's 3e-3 for Muon, FedPAC Table 9's SGD/AdamW values where FedMuon gives a grid
  only (:data:`FEDMUON_LIU_FINETUNE_OPTIM`).

Choices where the papers are silent (stated once here, referenced by the configs):

* FedMuon-LMO reports "epochs" (100 FashionMNIST, 200 CIFAR-10) and no batch size: we run that many
  *rounds* with batch 64. Its FedAvg/SCAFFOLD use momentum SGD: momentum 0.9.
* FedMuon (Zhang & Gao) gives no round count: 100 epochs of a worker's shard, ``rounds = ceil(100 · (M/8) /
  (64 · tau))`` (:func:`fedmuon_zg_rounds`); its Dir(0.5) run is CIFAR-10 / ResNet-18 with tau = 4.
* FedPAC (Liu et al.) Table 8 lists (beta1, beta2) = (0.9, 0.95) for Muon; Alg. 6 line 7 /
  Alg. 7 line 6 use beta1 as the momentum EMA, so Muon's momentum is 0.9; Alg. 6/7 have one
  momentum, and beta2 = 0.95 is that of the Adam on the non-matrix leaves (the rule below), as
  in both authors' released codes. Its FedPAC_Sophia row
  names "Muon" as the local optimizer: a typo (Sophia).
* LLaMA on C4: an iid split (C4 has no labels for a Dirichlet split), float32; without a
  tokenizer file the run falls back to bytes (:func:`fedpac_c4` states the sizes).

Muon-based methods (docs/FIDELITY.md, "Muon-based methods"; tests/test_fairness.py checks that
the methods one table compares get the same choice):

* Leaves Muon does not orthogonalize (biases, norm scales, a (1, 1, d) class token): no paper
  that is silent about them tells the methods apart, so every compared Muon-based method steps
  them with AdamW at *the same paper's* AdamW learning rate and b1 = 0.9, b2 = 0.95 (FedPAC
  Table 8's Muon rows; the ``SingleDeviceMuonWithAuxAdam`` Adam groups of both authors'
  released codes), eps = 1e-8 (optax's; theirs is 1e-10) (:func:`muon_fallback`). Their
  decoupled weight decay is at that AdamW rate too (each parameter group decays at its own
  rate, as in the authors' code). The bias-corrected-LMO paper is not silent: Appendix G tunes a "Stepsize of Momentum
  SGD" for LocalMuon and FedMuon alike: both presets do that (``fallback="momentum_sgd"`` in
  configs/local_muon.py, ``other_lr_ratio`` in configs/fedmuon_bc.py).
* Orthogonalization: Jordan's quintic Newton-Schulz coefficients (3.4445, -4.7750, 2.0315), 5
  steps, for every Muon-based method of every paper (:data:`NS`). FedMuon (Liu et al.) Sec. 3:
  "five Newton-Schulz iterations ... (Jordan et al.)"; FedPAC (Liu et al.) Alg. 6 line 29 gives
  these coefficients, while its Alg. 7 line 24 writes the cubic ``X <- X (3I - A) / 2``: we run
  Alg. 6's quintic for Local Muon and FedPAC_Muon alike (five cubic steps grow a small
  singular value of the ||G||_F-normalized input by at most 1.5^5 = 7.6, the quintic's by up to
  3.4445^5 = 487: the cubic's 5-step output is far from UV^T). The bias-corrected-LMO paper analyses
  (15/8, -5/4, 3/8) (Theorem 3) but runs its experiments "following Liu et al. (2025a)", whose
  Muon uses Jordan's coefficients; its presets use them for LocalMuon and FedMuon alike, and
  the ``*_ns_classic`` variants give both the analysed coefficients.
* Momentum and shape scaling, per box: FedMuon (Liu et al.) Alg. 2 line 7 ``M = beta M + G``
  (no EMA, no Nesterov), UV^T with no factor; FedPAC (Liu et al.) Alg. 6/7 an EMA, no
  Nesterov, the "optional" gamma(m, n) left out (``shape_scaling="none"``); bias-corrected LMO
  Alg. 1/4 an EMA with weight alpha = 0.1 on the gradient and Liu et al. (2025a)'s per-layer
  0.2 sqrt(max(m, n)) (Sec. 7.1), on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from configs import base

Preset = Callable[[ml_collections.ConfigDict], ml_collections.ConfigDict]

# Jordan et al.'s quintic Newton-Schulz, 5 steps: every Muon-based method of every paper
# (module docstring, "Muon-based methods").
NS: dict[str, Any] = {"ns_steps": 5, "ns_coeffs": "jordan"}


def muon_fallback(muon_lr: float, adamw_lr: float, *, b2: float = 0.95) -> dict[str, float]:
    """The rule for the leaves Muon does not orthogonalize: AdamW at the paper's AdamW rate.

    fedorth's Muon direction scales its Adam fallback by ``fallback_lr_ratio`` = fallback lr /
    Muon lr (one schedule drives both); b1 = 0.9 and b2 = 0.95: FedPAC (Liu et al.) Table 8's
    Muon rows (beta1 0.9, beta2 0.95), the ``betas=(0.9, 0.95)`` of the ``SingleDeviceMuonWithAuxAdam``
    Adam groups in both authors' released codes (FedPAC's ``main_FedPAC.py``, FedMuon's
    ``main_FedMuon.py``); eps stays optax's 1e-8 (their Adam's is 1e-10). The config's
    decoupled weight decay lambda applies to every leaf (the boxes' ``lambda x``), each group at
    its own rate: ``lr * lambda`` on Muon's matrices, ``fallback_lr_ratio * lr * lambda`` on the
    fallback's leaves, as the authors' code decays its ``SingleDeviceMuonWithAuxAdam`` groups
    (``fedorth.fed.local.decay_rates``).

    Args:
      muon_lr: the Muon learning rate of the preset.
      adamw_lr: the AdamW learning rate the same paper uses for its AdamW-based methods.
      b2: the fallback Adam's second-moment decay (the default configs keep their AdamW's 0.999).
    """
    return {"fallback_lr_ratio": adamw_lr / muon_lr, "fallback_b1": 0.9, "fallback_b2": b2}


# FedPAC (Liu et al.) Tables 8 (ResNet-18/ViT-Tiny) and 10 (LLaMA): local optimizer
# hyperparameters. Muon: Alg. 6/7 (EMA momentum beta1 = 0.9, no Nesterov, gamma left out).
FEDPAC_OPTIM: dict[str, dict[str, Any]] = {
    "sgd": {"name": "sgd", "learning_rate": 0.1, "weight_decay": 0.001},
    "adamw": {"name": "adamw", "learning_rate": 3e-4, "b1": 0.9, "b2": 0.999, "weight_decay": 0.01},
    # Sophia: FedPAC (Liu et al.) Alg. 8/9's box, D = clip(m / max(h, eps), -rho, rho)
    # (clip_mode="paper"); Table 8 gives no rho, eps or f_h. rho = 1, not SophiaG's 0.04: in the
    # box rho is the clip level and caps every coordinate's step at lr * rho, 1.2e-5 at lr 3e-4
    # with 0.04, 25x below SophiaG at the same lr (whose 0.04 scales the denominator, clip at
    # +-1; sophia.py: the box with rho equals rho x SophiaG with gamma = rho). Measured (200
    # steps, batch 50, lr 3e-4, wd 0.01, f_h 10, Hutchinson; MLP 200-200 on the embedded digits;
    # mean |step| / lr over steps 151-200; train loss from 2.34): box rho = 0.04: 0.035, loss
    # 2.16 (barely moves); box rho = 1: 0.25, loss 0.26; SophiaG form (clip_mode="optax", gamma
    # 0.04): 0.84, loss 0.15; AdamW at 3e-4: 0.24, loss 0.30. Table 1 has Local Sophia close
    # to Local AdamW (Table 11, ViT-Tiny: 34.05 vs 37.57): the box with rho = 1 (SophiaG's clip
    # level) keeps the paper's formula and moves like AdamW; with 0.04 it does not train at the
    # table's lr. eps 1e-12 and f_h 10 are SophiaG's. Local Sophia, FedPAC_Sophia(_light) and
    # Fed-Sophia (Tables 12-13) all read this entry.
    "sophia": {
        "name": "sophia",
        "learning_rate": 3e-4,
        "b1": 0.9,
        "b2": 0.99,
        "rho": 1.0,
        "eps": 1e-12,
        "update_interval": 10,
        "clip_mode": "paper",
        "weight_decay": 0.01,
    },
    "muon": {
        "name": "muon",
        "learning_rate": 3e-2,
        "beta": 0.9,
        "ema": True,  # Alg. 6 line 7: M <- beta1 M + (1 - beta1) G
        "nesterov": False,
        **NS,
        "shape_scaling": "none",  # Alg. 7 line 9: gamma(m, n) is "optional"
        **muon_fallback(3e-2, 3e-4),  # Table 8/10's AdamW rate
        "weight_decay": 0.01,
    },
    "soap": {"name": "soap", "learning_rate": 3e-3, "b1": 0.95, "b2": 0.95, "weight_decay": 0.01},
}

# FedMuon (Liu et al.) Sec. 7: the AdamW rate of its grid that its Local AdamW presets use (the
# value FedPAC (Liu et al.), by the same authors, reports for the same setting).
FEDMUON_LIU_ADAMW_LR = FEDPAC_OPTIM["adamw"]["learning_rate"]


def fedmuon_liu_muon(
    learning_rate: float, adamw_lr: float = FEDMUON_LIU_ADAMW_LR
) -> dict[str, Any]:
    """FedMuon (Liu et al.)'s Muon, for FedMuon, FedMuon_SVD and Local Muon alike.

    Alg. 2 line 7 ``M = beta M + G`` with beta = 0.98 (line 1, Table 6), line 8 ``UV^T`` with
    no shape factor, line 9 weight decay lambda = 0.01 (Sec. 7); Sec. 3's five Newton-Schulz
    iterations of Jordan et al.; AdamW at ``adamw_lr`` for the other leaves.

    Args:
      learning_rate: Sec. 7's "3e-2, 2e-2, 3e-3" (ResNet-18, ViT-Tiny, fine-tuning).
      adamw_lr: the AdamW rate of the same table's Local AdamW (:data:`FEDMUON_LIU_ADAMW_LR`, or
        :data:`FEDMUON_LIU_FINETUNE_ADAMW_LR` for Tables 3-4).
    """
    return {
        "name": "muon",
        "learning_rate": learning_rate,
        "beta": 0.98,
        "ema": False,
        "nesterov": False,
        **NS,
        "shape_scaling": "none",
        **muon_fallback(learning_rate, adamw_lr),
        "weight_decay": 0.01,
    }


# The bias-corrected-LMO paper's inexact LMO, for LocalMuon and FedMuon alike (Sec. 7.1: the
# step "scaled per layer" following Liu et al. (2025a), i.e. 0.2 sqrt(max(m, n))).
FEDMUON_LMO_ORTHOGONALIZATION: dict[str, Any] = {**NS, "shape_scaling": "moonlight"}
# Its Theorem 3's coefficients (15/8, -5/4, 3/8), for the ``*_ns_classic`` variants.
FEDMUON_LMO_ORTHOGONALIZATION_CLASSIC: dict[str, Any] = {
    "ns_steps": 5,
    "ns_coeffs": "classic",
    "shape_scaling": "moonlight",
}

# FedMuon-LMO (bias-corrected LMO) §7.1: the baselines of its table are treated like its FedMuon
# (Alg. 1): every client keeps its local optimizer state between the rounds it joins (Alg. 4
# line 5, LocalMuon: M_i^(r,0) <- M_i^(r-1,K); Alg. 1 line 6) and the server takes the step
# X <- (n-S)/n X + 1/n sum_{i in S} X_i (Alg. 1 line 18, Alg. 3 line 10, Alg. 4 line 15), which
# at S = n/2 is half the plain average's step. Alg. 3 (FedAvg) writes plain SGD; §7.1 runs it
# with momentum SGD or Adam, whose state we keep per client as Alg. 4 does.
FEDMUON_LMO_TABLE_OPTIONS: dict[str, Any] = {"client_state": "persistent", "server_rule": "partial"}

# ------------------------------------------------------ default (embedded-data) configs

# The AdamW rate of the default configs (configs/local_adamw.py): the rate of the non-matrix
# leaves of the default Muon configs, by the rule above (AdamW at the same setting's AdamW rate).
DEFAULT_ADAMW_LR = 0.003


def default_muon(box: str, learning_rate: float) -> dict[str, Any]:
    """The Muon of a default (embedded-data) config: its paper's box at ``learning_rate``.

    ``box``: ``"fedpac"`` (FedPAC (Liu et al.) Alg. 6/7, :data:`FEDPAC_OPTIM`: EMA momentum
    0.9, no Nesterov, no shape factor) or ``"fedmuon_liu"`` (FedMuon (Liu et al.) Alg. 2,
    :func:`fedmuon_liu_muon`: ``M = 0.98 M + G``, no shape factor); Jordan's quintic, weight
    decay 0.01 (the boxes' ``lambda x``, each group at its own rate), and AdamW at
    :data:`DEFAULT_ADAMW_LR` with the default AdamW's (0.9, 0.999) on the other leaves
    (:func:`muon_fallback`; the paper presets' b2 is 0.95), which the recorded accuracies of the
    default configs were measured with.
    The previous default form is the ``muon_reference`` preset (:func:`muon_reference`).
    """
    if box == "fedpac":
        optim = {**FEDPAC_OPTIM["muon"], "learning_rate": learning_rate}
        return {**optim, **muon_fallback(learning_rate, DEFAULT_ADAMW_LR, b2=0.999)}
    if box == "fedmuon_liu":
        return {**fedmuon_liu_muon(learning_rate, DEFAULT_ADAMW_LR), "fallback_b2": 0.999}
    raise ValueError(f"box={box!r}; valid: ('fedpac', 'fedmuon_liu').")


def muon_reference(beta: float) -> Preset:
    """The ``muon_reference`` preset of a default Muon config: Keller Jordan's Muon step.

    Heavy-ball momentum ``M <- beta M + g`` with Nesterov's step ``g + beta M``, the factor
    ``sqrt(max(1, fan_out / fan_in))`` (``shape_scaling="jordan"``), Jordan's quintic, no weight
    decay, and Adam (0.9, 0.999, eps 1e-8) at the Muon rate on the other leaves (the Muon
    reference's auxiliary Adam has its own rate, b2 = 0.95, eps = 1e-10): the default configs'
    form before they ran their papers' boxes, kept by name so that its runs can be repeated.
    Only the optimizer changes: the embedded-data setting stays the default's.
    """
    optim = {
        "beta": beta,
        "nesterov": True,
        "ema": False,
        **NS,
        "shape_scaling": "jordan",
        "fallback_lr_ratio": 1.0,
        "fallback_b1": 0.9,
        "fallback_b2": 0.999,
        "weight_decay": 0.0,
    }
    return variant(lambda config: config, optim=optim)


# ------------------------------------------------------------ fine-tuning from checkpoints

# Hugging Face names of the checkpoints the fine-tuning presets start from (``model.pretrained``:
# a cached name or a folder; docs/FINETUNING.md says how to get them).
SWIN_T_CHECKPOINT = "microsoft/swin-tiny-patch4-window7-224"
VIT_BASE_CHECKPOINT = "google/vit-base-patch16-224-in21k"
ROBERTA_BASE_CHECKPOINT = "roberta-base"
# FedMuon (Liu et al.) Table 4's GLUE tasks, in its column order.
GLUE_TASKS = ("cola", "rte", "sst2", "qqp", "mrpc", "qnli", "mnli")
GLUE_CLASSES = {"mnli": 3}  # the others are binary

# FedPAC (Liu et al.) Table 9 (ViT-Base fine-tuning): Table 8's rows with the rates divided by
# 3: SGD 0.1 (wd 1e-3; FedCM beta 0.9), AdamW 1e-4 (0.9, 0.999; wd 0.01), Sophia 1e-4 (0.9,
# 0.99; wd 0.01), Muon 1e-2 (beta1 0.9; wd 0.01), SOAP 1e-3 (0.95, 0.95; wd 0.01), FedPAC beta
# 0.5. Muon's non-matrix leaves: AdamW at Table 9's AdamW rate 1e-4 (the rule above).
FEDPAC_FINETUNE_OPTIM: dict[str, dict[str, Any]] = {
    "sgd": dict(FEDPAC_OPTIM["sgd"]),
    "adamw": {**FEDPAC_OPTIM["adamw"], "learning_rate": 1e-4},
    "sophia": {**FEDPAC_OPTIM["sophia"], "learning_rate": 1e-4},
    "muon": {**FEDPAC_OPTIM["muon"], "learning_rate": 1e-2, **muon_fallback(1e-2, 1e-4)},
    "soap": {**FEDPAC_OPTIM["soap"], "learning_rate": 1e-3},
}

# FedMuon (Liu et al.) Tables 3-4 (Swin-T, RoBERTa-base + LoRA). Sec. 7 gives FedMuon's and
# Local Muon's rate as "3e-2, 2e-2, 3e-3": read in the order of its models, 3e-3 is the rate of
# the fine-tuned transformers (ResNet-18 and ViT-Tiny take the first two). For the other methods
# it gives grids only ({1e-2, 3e-2, 5e-2, 1e-1, 3e-1}, wd 1e-3, for FedAvg/SCAFFOLD/FedCM;
# {1e-4, 3e-4, 5e-4, 8e-4, 1e-3}, wd 0.01 or 0.001, for FedLADA/Local AdamW): we take the values
# its authors report for fine-tuning in FedPAC (Liu et al.) Table 9 (SGD 0.1 wd 1e-3, AdamW 1e-4
# wd 0.01), both inside those grids. Muon's non-matrix leaves: AdamW at that 1e-4.
FEDMUON_LIU_FINETUNE_MUON_LR = 3e-3
FEDMUON_LIU_FINETUNE_ADAMW_LR = FEDPAC_FINETUNE_OPTIM["adamw"]["learning_rate"]
FEDMUON_LIU_FINETUNE_OPTIM: dict[str, dict[str, Any]] = {
    "sgd": dict(FEDPAC_FINETUNE_OPTIM["sgd"]),
    "adamw": dict(FEDPAC_FINETUNE_OPTIM["adamw"]),
}

# DiLoCo's outer optimizer (Douillard et al. 2023, Sec. 3: Nesterov momentum 0.9, lr 0.7), the
# server step of configs/diloco.py and configs/muloco.py.
DILOCO_OUTER: dict[str, Any] = {"server_opt": "nesterov", "server_lr": 0.7, "server_momentum": 0.9}
# Reddi et al. 2021's server values for its adaptive optimizers (Sec. 5: betas (0.9, 0.99),
# tau 1e-3; server lr 0.01), FedAdam's presets' (configs/fedadam.py), FedYogi's and FedAdagrad's.
REDDI_SERVER: dict[str, Any] = {
    "server_lr": 0.01,
    "server_b1": 0.9,
    "server_b2": 0.99,
    "server_tau": 1e-3,
}


def reddi_server(server_opt: str) -> dict[str, Any]:
    """FedAvg's ``fed.options`` with Reddi et al. 2021's server optimizer ``server_opt``
    (``"yogi"``, ``"adagrad"``) at :data:`REDDI_SERVER` (Adagrad takes no ``server_b2``)."""
    options = {"server_opt": server_opt, **REDDI_SERVER}
    if server_opt == "adagrad":
        del options["server_b2"]
    return options


def reddi_default(config: ml_collections.ConfigDict, server_opt: str) -> None:
    """The embedded-digits default of FedYogi and FedAdagrad: configs/fedadam.py's (local SGD
    at lr 0.1, server lr 0.03) with the server optimizer ``server_opt``."""
    config.fed.algorithm = "fedavg"
    set_options(config, reddi_server(server_opt))
    config.fed.options.server_lr = 0.03
    config.optim.name = "sgd"
    config.optim.learning_rate = 0.1  # base: 0.05


# (dataset, model, num_classes) of FedPAC (Liu et al.)'s vision presets, by preset stem.
_FEDPAC_VISION = {
    "cifar100_resnet18": ("cifar100", "resnet18", 100),
    "cifar100_vit": ("cifar100", "vit_tiny", 100),
    "tiny_imagenet_resnet18": ("tiny_imagenet", "resnet18", 200),
    "tiny_imagenet_vit": ("tiny_imagenet", "vit_tiny", 200),
}
LLAMA_SIZES = ("60m", "130m", "350m")
# (Dirichlet alpha or None for iid, preset suffix): Table 1 (Dir-0.1, Dir-0.05), Tables 12-13.
FEDPAC_LEVELS = ((0.1, ""), (0.05, "_dir0.05"), (0.5, "_dir0.5"), (None, "_iid"))


def select(
    config: ml_collections.ConfigDict,
    arg: str | None,
    presets: Mapping[str, Preset],
    name: str,
) -> ml_collections.ConfigDict:
    """``config`` for ``arg`` None/"" (the default preset), else ``presets[arg](config)``.

    Raises:
      ValueError: ``arg`` is not a preset of config ``name`` (the message lists the valid ones).
    """
    if arg in (None, ""):
        return base.with_model_dtype(config)
    if arg not in presets:
        raise ValueError(
            f"Unknown preset {arg!r} for configs/{name}.py; valid presets: '' (default), "
            f"{', '.join(sorted(presets))}."
        )
    return base.with_model_dtype(presets[arg](config))


def set_optim(config: ml_collections.ConfigDict, optim: Mapping[str, Any]) -> None:
    """Replaces ``config.optim`` by ``optim``, keeping the schedule and ``ns_dtype`` fields of
    the setting (so ``--config.optim.ns_dtype`` works on every preset)."""
    schedule = config.optim.get("schedule", "constant")
    ns_dtype = config.optim.get("ns_dtype", "auto")
    config.optim = ml_collections.ConfigDict(
        {"ns_dtype": ns_dtype, **dict(optim), "schedule": schedule}
    )


def set_options(config: ml_collections.ConfigDict, options: Mapping[str, Any]) -> None:
    """Replaces ``config.fed.options`` (the algorithm's own options) by ``options``."""
    config.fed.options = ml_collections.ConfigDict(dict(options))


def _preset(setting: Preset, optim: Mapping[str, Any] | None, options: Mapping[str, Any] | None):
    def apply(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        config = setting(config)
        if optim is not None:
            set_optim(config, optim)
        if options is not None:
            set_options(config, options)
        return config

    return apply


# ------------------------------------------------------------------------------------ settings


def fedpac_vision(dataset: str, model: str, num_classes: int, alpha: float | None) -> Preset:
    """FedPAC (Liu et al.) Tables 1, 12 and 13: 100 clients, 10% participation, batch 50,
    K = 50, 300 rounds, cosine; Dir-``alpha``, or an iid split when ``alpha`` is None."""

    def setting(config):
        config = base.paper_setting(
            config, dataset=dataset, model=model, num_classes=num_classes, alpha=alpha
        )
        if alpha is None:
            config.data.partition = "iid"
        return config

    return setting


def fedpac_c4(size: str) -> Preset:
    """FedPAC (Liu et al.) Table 3: C4, LLaMA ``size``, 20 clients, 20% participation, batch
    16, K = 50, 100 rounds, cosine; test loss on held-out C4 windows every 10 rounds.

    The named sizes 60M / 130M / 350M hold with the paper's 32k subword vocabulary (a tokenizer
    file in ``data.dataset_kwargs.tokenizer``). Without one the run falls back to fedorth's byte
    tokenizer (vocabulary 257): the models then have 25.6M / 85.3M / 303M parameters, and their
    losses (per byte, not per subword token) are not comparable with Table 3.
    """

    def setting(config):
        config.data.name = "c4"
        config.data.partition = "iid"
        config.data.num_clients = 20
        config.data.augment = False
        # The table's 32k subword vocabulary (GaLore's T5 tokenizer) gives the named sizes;
        # without a tokenizer file the run falls back to bytes (vocabulary 257: 25.6M / 85.3M /
        # 303M parameters, losses not comparable with Table 3), and says so in the log.
        config.data.dataset_kwargs = ml_collections.ConfigDict(
            {"tokenizer": config_dict.placeholder(str)}  # PATH to T5's tokenizer.json/spiece.model
        )
        # No vocab_size: the embedding follows the tokenizer (a mismatch is an error).
        config.model = ml_collections.ConfigDict({"name": "llama", "size": size})
        return base.paper_federation(
            config,
            rounds=100,
            clients_per_round=4,
            local_steps=50,
            batch_size=16,
            eval_batch_size=64,
        )

    return setting


def fedmuon_liu_vision(model: str, alpha: float) -> Preset:
    """FedMuon (Liu et al.) Table 2: CIFAR-100, 100 clients, 10% participation, batch 50, K = 50, 300
    rounds, Dir-``alpha``, cosine decay."""

    def setting(config):
        return base.paper_setting(
            config, dataset="cifar100", model=model, num_classes=100, alpha=alpha
        )

    return setting


def fedmuon_lmo(dataset: str, alpha: float) -> Preset:
    """FedMuon-LMO Sec. 7.1: 16 clients, 8 sampled, K = 5, Dirichlet ``alpha`` (its beta);
    FashionMNIST / LeNet-5 for 100 rounds, or CIFAR-10 / ResNet-18 (GroupNorm) for 200."""
    if dataset not in ("fashion_mnist", "cifar10"):
        raise ValueError(f"FedMuon-LMO dataset={dataset!r}; valid: ('fashion_mnist', 'cifar10').")

    def setting(config):
        config.data.name = dataset
        config.data.num_clients = 16
        config.data.partition = base.PAPER_DIRICHLET  # "Following ... (Hsu et al., 2019)"
        config.data.alpha = alpha
        if dataset == "fashion_mnist":
            config.data.augment = False
            config.model = ml_collections.ConfigDict({"name": "lenet5", "num_classes": 10})
            config.fed.rounds = 100
        else:
            config.data.augment = True
            config.model = ml_collections.ConfigDict(
                {"name": "resnet18", "num_classes": 10, "norm": "group"}
            )
            config.fed.rounds = 200
        config.fed.clients_per_round = 8
        config.fed.local_steps = 5
        config.fed.batch_size = 64  # not stated in FedMuon-LMO (module docstring)
        config.optim.schedule = "constant"
        config.eval_every = 5
        config.checkpoint_every = 20
        return config

    return setting


# Training-set sizes used to turn FedMuon (Zhang & Gao)'s epochs into rounds.
_TRAIN_SIZES = {"cifar10": 50_000, "cifar100": 50_000, "sentiment140": 16_000}


def fedmuon_zg_rounds(dataset: str, period: int, *, epochs: int = 100, workers: int = 8) -> int:
    """Rounds of ``epochs`` passes over one worker's shard with batch 64 and ``period`` steps."""
    steps_per_epoch = _TRAIN_SIZES[dataset] / workers / 64
    return math.ceil(epochs * steps_per_epoch / period)


def fedmuon_zg(dataset: str, model: str, period: int, *, alpha: float | None = None) -> Preset:
    """FedMuon (Zhang & Gao) Sec. 7: 8 workers, full participation, batch 64, K = tau = ``period``, cosine;
    iid unless ``alpha`` (its Dir(0.5) run)."""

    def setting(config):
        config.data.name = dataset
        config.data.num_clients = 8
        if alpha is None:
            config.data.partition = "iid"
        else:
            config.data.partition = base.PAPER_DIRICHLET  # its ref. [9], Hsu et al. 2019
            config.data.alpha = alpha
        if dataset == "sentiment140":
            config.data.augment = False
            # "retain only 1% of the original training data" (Appendix A.2): 16,000 tweets.
            config.data.dataset_kwargs = ml_collections.ConfigDict(
                {"max_train": 16_000, "vocab_size": 20_000, "max_len": 64}
            )
            config.model = ml_collections.ConfigDict(
                {"name": "rnn", "num_classes": 2, "vocab_size": 20_000}  # Table 3: 300/4096/2
            )
        else:
            classes = 100 if dataset == "cifar100" else 10
            config.data.augment = True
            config.model = ml_collections.ConfigDict({"name": model, "num_classes": classes})
        config.fed.rounds = fedmuon_zg_rounds(dataset, period)
        config.fed.clients_per_round = 8
        config.fed.local_steps = period
        config.fed.batch_size = 64
        config.optim.schedule = "cosine"
        config.eval_every = 10 if period >= 16 else 25
        config.checkpoint_every = config.eval_every
        config.eval_batch_size = 500
        return config

    return setting


def _finetune_vision(
    config: ml_collections.ConfigDict,
    *,
    dataset: str,
    model: str,
    checkpoint: str,
    num_clients: int,
    clients_per_round: int,
) -> ml_collections.ConfigDict:
    """Fine-tuning of a pretrained vision transformer at 224x224: batch 16, K = 50, 100 rounds,
    Dir-0.1, cosine; random crop + flip at the dataset's resolution, then a bilinear resize."""
    classes = {"cifar100": 100, "tiny_imagenet": 200}[dataset]
    config = base.paper_setting(
        config,
        dataset=dataset,
        model=model,
        num_classes=classes,
        rounds=100,
        num_clients=num_clients,
        clients_per_round=clients_per_round,
        local_steps=50,
        batch_size=16,
        alpha=0.1,
    )
    config.model.pretrained = checkpoint  # a cached Hugging Face name or a folder (users override)
    config.data.image_size = 224
    config.eval_batch_size = 128  # 224x224 test batches
    return config


def fedmuon_liu_swin(dataset: str) -> Preset:
    """FedMuon (Liu et al.) Table 3: Swin-T fine-tuned on ``dataset`` (CIFAR-100 or Tiny
    ImageNet), 100 clients, 5% participation (5 per round), batch 16, K = 50, 100 rounds,
    Dir-0.1, cosine decay (Sec. 7); images resized to 224x224 (the checkpoint's resolution),
    random crop and flip.

    The paper names no checkpoint: ``model.pretrained`` is the standard Swin-T, Hugging Face's
    :data:`SWIN_T_CHECKPOINT` (its ImageNet head is re-initialized for the task's classes, and
    the loader reports it); any folder with the same layout can be given instead.
    """

    def setting(config):
        return _finetune_vision(
            config,
            dataset=dataset,
            model="swin_t",
            checkpoint=SWIN_T_CHECKPOINT,
            num_clients=100,
            clients_per_round=5,
        )

    return setting


def fedpac_vit_base(dataset: str) -> Preset:
    """FedPAC (Liu et al.) Table 2 / Appendix D.5: ViT-B/16 from the official ImageNet-21k
    weights (:data:`VIT_BASE_CHECKPOINT`), all layers fine-tuned on ``dataset`` (CIFAR-100 or
    Tiny ImageNet), 50 clients, 10% participation (5 per round), batch 16, K = 50, 100 rounds,
    Dir-0.1, cosine; images resized to 224x224 (bilinear), random crop, horizontal flip and
    RandAugment on the clients (``data.rand_augment``)."""

    def setting(config):
        config = _finetune_vision(
            config,
            dataset=dataset,
            model="vit_b16",
            checkpoint=VIT_BASE_CHECKPOINT,
            num_clients=50,
            clients_per_round=5,
        )
        config.data.rand_augment = True
        return config

    return setting


def fedmuon_liu_glue(task: str) -> Preset:
    """FedMuon (Liu et al.) Table 4: RoBERTa-base (:data:`ROBERTA_BASE_CHECKPOINT`) with LoRA
    rank 16 on GLUE ``task``, 4 clients, full participation, batch 16, K = 50, 100 rounds,
    Dir-0.8 label split, cosine decay (Sec. 7).

    The paper gives the rank only. Adapters on the query and value projections (LoRA's default,
    Hu et al. 2021), alpha = rank (scale 1), the classification head trained, the rest frozen
    (``fedorth.models.lora``); sequences of at most 128 subword tokens. The tokenizer is
    RoBERTa's ``tokenizer.json``, given as ``data.dataset_kwargs.tokenizer=PATH`` (no default:
    the run stops with the command that fetches it).
    """
    if task not in GLUE_TASKS:
        raise ValueError(f"GLUE task {task!r}; valid: {GLUE_TASKS}.")

    def setting(config):
        config.data.name = f"glue/{task}"
        config.data.num_clients = 4
        config.data.partition = base.PAPER_DIRICHLET
        config.data.alpha = 0.8
        config.data.augment = False
        config.data.dataset_kwargs = ml_collections.ConfigDict(
            {"tokenizer": config_dict.placeholder(str), "max_len": 128}
        )
        config.model = ml_collections.ConfigDict(
            {
                "name": "roberta_base",
                "num_classes": GLUE_CLASSES.get(task, 2),
                "pretrained": ROBERTA_BASE_CHECKPOINT,
                "lora_rank": 16,
                "lora_alpha": 16.0,
                "lora_targets": ("query", "value"),
                "lora_trainable": ("head.*",),
                "dtype": config.model.get("dtype", "float32"),
            }
        )
        return base.paper_federation(
            config,
            rounds=100,
            clients_per_round=4,
            local_steps=50,
            batch_size=16,
            eval_batch_size=128,
        )

    return setting


# ----------------------------------------------------------------------------- preset families


def fedpac_presets(
    optim: Mapping[str, Any], options: Mapping[str, Any] | None = None, *, c4: bool = True
) -> dict[str, Preset]:
    """FedPAC (Liu et al.)'s settings with the algorithm's hyperparameters (Tables 8 and 10).

    Names: ``cifar100_resnet18``, ``cifar100_vit``, ``tiny_imagenet_resnet18``,
    ``tiny_imagenet_vit`` (Dir-0.1, Table 1), the same with ``_dir0.05`` (Table 1), ``_dir0.5``
    and ``_iid`` (Tables 12 and 13), and ``c4_llama60m``, ``c4_llama130m``, ``c4_llama350m``
    (Table 3) when ``c4``.
    """
    out = {}
    for stem, (dataset, model, classes) in _FEDPAC_VISION.items():
        for alpha, suffix in FEDPAC_LEVELS:
            out[stem + suffix] = _preset(
                fedpac_vision(dataset, model, classes, alpha), optim, options
            )
    if c4:
        for size in LLAMA_SIZES:
            out[f"c4_llama{size}"] = _preset(fedpac_c4(size), optim, options)
    return out


def cifar100_presets(
    optim: Mapping[str, Any], options: Mapping[str, Any] | None = None
) -> dict[str, Preset]:
    """The CIFAR-100 setting FedPAC (Liu et al.) Table 1 and FedMuon (Liu et al.) Table 2
    share (100 clients, 10% participation, batch 50, K = 50, 300 rounds, Dir-0.1, cosine):
    ``cifar100_resnet18`` and ``cifar100_vit``, for a baseline that joins their tables."""
    every = fedpac_presets(optim, options, c4=False)
    return {name: every[name] for name in ("cifar100_resnet18", "cifar100_vit")}


def fedmuon_liu_presets(
    optim_by_model: Mapping[str, Mapping[str, Any]], options: Mapping[str, Any] | None = None
) -> dict[str, Preset]:
    """FedMuon (Liu et al.)'s CIFAR-100 settings: ``fedmuon_liu_cifar100_{resnet18,vit}_dir{0.6,0.1,
    0.05}`` (Table 2), and ``fedmuon_liu_fig4_cifar100_vit_dir0.1``: the ViT-Tiny Dir-0.1 run with
    the condition numbers of Fig. 4 logged (``log_condition_number``).

    Args:
      optim_by_model: the optimizer config for ``"resnet18"`` and for ``"vit_tiny"``.
      options: the algorithm's options.
    """
    out = {}
    for model, short in (("resnet18", "resnet18"), ("vit_tiny", "vit")):
        for alpha in (0.6, 0.1, 0.05):
            out[f"fedmuon_liu_cifar100_{short}_dir{alpha:g}"] = _preset(
                fedmuon_liu_vision(model, alpha), optim_by_model[model], options
            )
    # Fig. 4 (a) reports the condition number on ViT-Tiny / CIFAR-100, without its split: the
    # non-IID setting of its Tables 5-7 (Dir-0.1).
    out["fedmuon_liu_fig4_cifar100_vit_dir0.1"] = variant(
        out["fedmuon_liu_cifar100_vit_dir0.1"], config={"log_condition_number": True}
    )
    return out


def variant(
    preset: Preset,
    *,
    optim: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
) -> Preset:
    """``preset``, then ``optim`` / ``options`` (``fed.options``) / top-level ``config`` keys
    updated: an ablation or a logging variant that changes nothing else."""

    def apply(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        cfg = preset(cfg)
        for section, changes in ((cfg.optim, optim), (cfg.fed.options, options)):
            for key, value in dict(changes or {}).items():
                section[key] = value
        for key, value in dict(config or {}).items():
            cfg[key] = value
        return cfg

    return apply


def fedmuon_lmo_presets(
    optim_by_setting: Mapping[tuple[str, float], Mapping[str, Any]],
    options: Mapping[str, Any] | None = None,
    *,
    options_by_setting: Mapping[tuple[str, float], Mapping[str, Any]] | None = None,
    suffix: str = "",
) -> dict[str, Preset]:
    """FedMuon-LMO's settings: ``fedmuon_lmo_{fmnist_lenet5,cifar10_resnet18}_beta{10,0.1}{suffix}``.

    Args:
      optim_by_setting: optimizer config for each ``(dataset, beta)`` (Appendix G tables).
      options: the algorithm's options (the same in every setting).
      options_by_setting: per-setting options, overriding ``options``.
      suffix: appended to the names (e.g. ``"_adam"`` for the Adam variants of the baselines).
    """
    out = {}
    for (dataset, beta), optim in optim_by_setting.items():
        short = "fmnist_lenet5" if dataset == "fashion_mnist" else "cifar10_resnet18"
        opts = (options_by_setting or {}).get((dataset, beta), options)
        out[f"fedmuon_lmo_{short}_beta{beta:g}{suffix}"] = _preset(
            fedmuon_lmo(dataset, beta), optim, opts
        )
    return out


# FedMuon (Zhang & Gao) Sec. 7 grid-searches every baseline's learning rate and reports none: the
# local SGD of its FedAvg, SCAFFOLD and FedAdam presets is the starting point of its other
# SGD-based baselines (configs/fedavg_m.py: lr 0.05, weight decay 5e-4), not the paper's value.
FEDMUON_ZG_SGD: dict[str, Any] = {"name": "sgd", "learning_rate": 0.05, "weight_decay": 5e-4}


def fedmuon_zg_presets(
    optim: Mapping[str, Any], options: Mapping[str, Any] | None = None
) -> dict[str, Preset]:
    """FedMuon (Zhang & Gao)'s settings: ``fedmuon_zg_{cifar10,cifar100}_{resnet18,vit}_tau{4,16}``,
    ``fedmuon_zg_sentiment140_rnn_tau{4,16}`` (iid) and ``fedmuon_zg_cifar10_resnet18_dir0.5_tau4``."""
    out = {}
    for period in (4, 16):
        for dataset in ("cifar10", "cifar100"):
            for model, short in (("resnet18", "resnet18"), ("vit_zg", "vit")):
                out[f"fedmuon_zg_{dataset}_{short}_tau{period}"] = _preset(
                    fedmuon_zg(dataset, model, period), optim, options
                )
        out[f"fedmuon_zg_sentiment140_rnn_tau{period}"] = _preset(
            fedmuon_zg("sentiment140", "rnn", period), optim, options
        )
    out["fedmuon_zg_cifar10_resnet18_dir0.5_tau4"] = _preset(
        fedmuon_zg("cifar10", "resnet18", 4, alpha=0.5), optim, options
    )
    return out


def fedmuon_liu_finetune_presets(
    optim: Mapping[str, Any], options: Mapping[str, Any] | None = None
) -> dict[str, Preset]:
    """FedMuon (Liu et al.)'s fine-tuning tables with the algorithm's hyperparameters:
    ``swin_t_cifar100``, ``swin_t_tiny_imagenet`` (Table 3) and ``roberta_lora_{cola,rte,sst2,
    qqp,mrpc,qnli,mnli}`` (Table 4)."""
    out = {
        f"swin_t_{dataset}": _preset(fedmuon_liu_swin(dataset), optim, options)
        for dataset in ("cifar100", "tiny_imagenet")
    }
    for task in GLUE_TASKS:
        out[f"roberta_lora_{task}"] = _preset(fedmuon_liu_glue(task), optim, options)
    return out


def fedpac_finetune_presets(
    optim: Mapping[str, Any], options: Mapping[str, Any] | None = None
) -> dict[str, Preset]:
    """FedPAC (Liu et al.) Table 2 with Table 9's hyperparameters: ``vit_base_cifar100``,
    ``vit_base_tiny_imagenet``."""
    return {
        f"vit_base_{dataset}": _preset(fedpac_vit_base(dataset), optim, options)
        for dataset in ("cifar100", "tiny_imagenet")
    }


# ------------------------------------------------------- Reddi et al. 2021's natural-client tasks

# Reddi et al. 2021 ("Adaptive Federated Optimization") tasks: data, model, clients per round,
# batch size, rounds (google-research/federated optimization/docs/hyperparameters.md, "Default
# values"; 1 client epoch), and K, the local steps standing for that epoch (docs/FIDELITY.md).
REDDI_TASKS: dict[str, dict[str, Any]] = {
    "emnist": {
        "data": {"name": "emnist", "num_clients": 3400},
        "model": {"name": "emnist_cnn"},
        "clients_per_round": 10,
        "batch_size": 20,
        "rounds": 1500,
        "local_steps": 10,
    },
    "shakespeare": {
        "data": {"name": "shakespeare", "num_clients": 715},
        "model": {"name": "lstm_lm", "embed_dim": 8, "hidden_sizes": (256, 256), "projection": 0},
        "clients_per_round": 10,
        "batch_size": 4,
        "rounds": 1200,
        "local_steps": 10,
    },
    "stackoverflow": {
        "data": {"name": "stackoverflow", "num_clients": 342477},
        "model": {"name": "lstm_lm", "embed_dim": 96, "hidden_sizes": (670,), "projection": 96},
        "clients_per_round": 50,
        "batch_size": 16,
        "rounds": 1500,
        "local_steps": 25,
    },
    "stackoverflow_tags": {
        "data": {"name": "stackoverflow_tags", "num_clients": 342477},
        "model": {"name": "multilabel_lr"},
        "clients_per_round": 10,
        "batch_size": 100,
        "rounds": 1500,
        "local_steps": 4,
        # The released code's loss sums over the batch (Keras Reduction.SUM) where fedorth's
        # averages: its client rate times the batch size of 100 takes the same local step.
        "client_lr_scale": 100,
    },
}
# Best log10 learning rates (client, server) and log10 epsilon of each server optimizer by task
# (google-research/federated optimization/docs/hyperparameters.md, "Best hyperparameters").
REDDI_RATES: dict[str, dict[str, tuple[float, float, float | None]]] = {
    "emnist": {
        "fedavg": (-1, 0, None),
        "fedavgm": (-1.5, -0.5, None),
        "fedadagrad": (-1.5, -1, -2),
        "fedadam": (-1.5, -2.5, -4),
        "fedyogi": (-1.5, -2.5, -4),
    },
    "shakespeare": {
        "fedavg": (0, 0, None),
        "fedavgm": (0, -0.5, None),
        "fedadagrad": (0, -0.5, -1),
        "fedadam": (0, -2, -3),
        "fedyogi": (0, -2, -3),
    },
    "stackoverflow": {
        "fedavg": (-0.5, 0, None),
        "fedavgm": (-0.5, 0, None),
        "fedadagrad": (-0.5, -1.5, -4),
        "fedadam": (-0.5, -2, -5),
        "fedyogi": (-0.5, -2, -5),
    },
    "stackoverflow_tags": {
        "fedavg": (2, 0, None),
        "fedavgm": (2, 0, None),
        "fedadagrad": (2, 1, -2),
        "fedadam": (2, -0.5, -5),
        "fedyogi": (2, -0.5, -5),
    },
}


def reddi_task(task: str, aggregation: str) -> Preset:
    """Reddi et al. 2021's ``task`` setting (:data:`REDDI_TASKS`) under ``fed.aggregation``
    ``aggregation``: natural clients, constant learning rates, evaluation every 10 rounds."""
    spec = REDDI_TASKS[task]

    def setting(config):
        config.data.name = spec["data"]["name"]
        config.data.partition = "natural"
        config.data.num_clients = spec["data"]["num_clients"]
        config.model = ml_collections.ConfigDict({**spec["model"], "dtype": "float32"})
        config.fed.rounds = spec["rounds"]
        config.fed.clients_per_round = spec["clients_per_round"]
        config.fed.local_steps = spec["local_steps"]
        config.fed.batch_size = spec["batch_size"]
        config.fed.aggregation = aggregation
        config.optim.schedule = "constant"
        config.eval_every = 10
        config.checkpoint_every = 10
        return config

    return setting


def reddi_options(algorithm: str, task: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(optim, fed.options)`` of Reddi et al.'s ``algorithm`` (fedavg, fedavgm, fedadagrad,
    fedadam, fedyogi) on ``task`` at its tuned rates (:data:`REDDI_RATES`): local SGD without
    momentum; FedAvgM's server momentum 0.9; the adaptive servers' betas (0.9, 0.99). The
    client rate is multiplied by the task's ``client_lr_scale`` (1 unless its loss is summed
    over the batch in the released code)."""
    client, server, epsilon = REDDI_RATES[task][algorithm]
    scale = REDDI_TASKS[task].get("client_lr_scale", 1)
    optim = {"name": "sgd", "learning_rate": 10.0**client * scale}
    if algorithm == "fedavg":
        return optim, {}
    if algorithm == "fedavgm":
        return optim, {"server_lr": 10.0**server, "server_momentum": 0.9}
    options = {**REDDI_SERVER, "server_lr": 10.0**server, "server_tau": 10.0**epsilon}
    if algorithm != "fedadam":
        options["server_opt"] = algorithm[len("fed") :]
    if algorithm == "fedadagrad":
        del options["server_b2"]
    return optim, options


def reddi_presets(algorithm: str) -> dict[str, Preset]:
    """``reddi_<task>_examples``: Reddi et al.'s tasks with ``algorithm`` at the tuned rates,
    clients weighted by their example counts (the released code's ``tff.federated_mean`` weighted
    by the examples each client processed)."""
    return {
        f"reddi_{task}_examples": _preset(
            reddi_task(task, "examples"), *reddi_options(algorithm, task)
        )
        for task in REDDI_TASKS
    }


def reddi_uniform_presets() -> dict[str, Preset]:
    """``reddi_<task>_uniform``: Reddi et al.'s tasks with an algorithm's own default optimizer
    and options, clients weighted uniformly as in that algorithm's paper."""
    return {f"reddi_{task}_uniform": reddi_task(task, "uniform") for task in REDDI_TASKS}
