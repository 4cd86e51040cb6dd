r"""Local Muon (FedPAC (Liu et al.) Alg. 6; FedMuon (Liu et al.)'s "Local Muon"; the
bias-corrected-LMO paper's LocalMuon, Alg. 4): Muon local steps, the server averages the updates.

    python -m experiments.main --config=configs/local_muon.py --workdir=runs/local_muon
    python -m experiments.main --config=configs/local_muon.py:cifar100_resnet18 --workdir=...

Muon acts on matrix leaves; biases and norms use Adam scaled by ``fallback_lr_ratio``
(fedorth.fed.local). Default preset: embedded digits with FedPAC (Liu et al.) Alg. 6's Muon at
lr 0.05 (EMA momentum 0.9, no Nesterov, no shape factor, weight decay 0.01, AdamW at the default
AdamW rate 0.003 on biases and norms: ``presets.default_muon``), final test accuracy 0.9750 (seed
42). ``muon_reference``: the same run with the Muon reference form the default had before
(Nesterov momentum 0.95, Jordan's shape factor, Adam at the Muon rate, no weight decay), 0.9639.

Presets (configs/presets.py, "Muon-based methods": each paper's Local Muon gets the Muon of the
method it is compared with):
* FedPAC (Liu et al.) Tables 1/3/12/13 with Table 8/10's Local Muon row (lr 3e-2, EMA momentum
  0.9 (Alg. 6 line 7), no Nesterov, no shape factor, Jordan's quintic, weight decay 0.01):
  ``cifar100_resnet18``, ``cifar100_vit``, ``tiny_imagenet_resnet18``, ``tiny_imagenet_vit``
  (Dir-0.1; ``*_dir0.05``, ``*_dir0.5``, ``*_iid``), ``c4_llama{60m,130m,350m}``;
* FedMuon (Liu et al.) Sec. 7: ``fedmuon_liu_cifar100_{resnet18,vit}_dir{0.6,0.1,0.05}``, FedMuon's
  Muon (``presets.fedmuon_liu_muon``: Alg. 2's ``M = 0.98 M + G``, lr 3e-2 (ResNet-18) / 2e-2
  (ViT-Tiny) -- its list "3e-2, 2e-2, 3e-3" read in the order of its models --, weight decay
  0.01), ``*_exactsvd`` (Alg. 2 line 8's exact SVD), ``fedmuon_liu_fig4_cifar100_vit_dir0.1``
  (Fig. 4's condition numbers);
* the bias-corrected-LMO paper, Appendix G, LocalMuon:
  ``fedmuon_lmo_{fmnist_lenet5,cifar10_resnet18}_beta{10,0.1}``, Muon lr 0.001 with Liu et al.
  (2025a)'s per-layer scale 0.2 sqrt(max(m, n)) and the Newton-Schulz coefficients of its FedMuon
  preset (``presets.FEDMUON_LMO_ORTHOGONALIZATION``; ``*_ns_classic``: Theorem 3's (15/8, -5/4,
  3/8) on both sides), momentum as an EMA with weight 0.1 on the gradient, kept per client and
  with Alg. 4's server step ``X <- (n-S)/n X + 1/n sum_i X_i`` (``presets.FEDMUON_LMO_TABLE_OPTIONS``,
  as FedMuon's Alg. 1 does). Non-matrix leaves: momentum SGD with the same EMA momentum
  (``fallback="momentum_sgd"``), as Appendix G runs them for LocalMuon and FedMuon alike, at
  its Tables 2-3 "Stepsize of Momentum SGD" for LocalMuon: 0.1 (FashionMNIST; for beta = 10 its
  two seeds chose 0.1 and 0.01, we take the first) and 0.01 (CIFAR-10).

Non-matrix leaves in the FedPAC and FedMuon (Liu et al.) presets: AdamW at the paper's AdamW
rate 3e-4 with FedPAC Table 8's Muon (beta1, beta2) = (0.9, 0.95) (``presets.muon_fallback``), the
rule of every Muon-based method.

Fine-tuning (docs/FINETUNING.md): FedMuon (Liu et al.) Table 3 ``swin_t_{cifar100,tiny_imagenet}``
and Table 4 ``roberta_lora_{cola,rte,sst2,qqp,mrpc,qnli,mnli}`` with FedMuon's Muon at lr 3e-3 (Sec.
7's third rate); FedPAC (Liu et al.) Table 2 ``vit_base_{cifar100,tiny_imagenet}`` with Table 9's
Muon row (lr 1e-2, EMA 0.9, wd 0.01). Non-matrix leaves there: AdamW at the tables' AdamW rate 1e-4.
"""

from configs import base, presets

_MUON = presets.FEDPAC_OPTIM["muon"]

_FEDMUON_LMO_SETTINGS = [(d, b) for d in ("fashion_mnist", "cifar10") for b in (10.0, 0.1)]
# Appendix G Tables 2-3, LocalMuon: (Muon step size, momentum SGD step size) per setting.
_FEDMUON_LMO_LRS = {
    ("fashion_mnist", 10.0): (0.001, 0.1),
    ("fashion_mnist", 0.1): (0.001, 0.1),
    ("cifar10", 10.0): (0.001, 0.01),
    ("cifar10", 0.1): (0.001, 0.01),
}
_FEDMUON_LMO = {
    setting: {
        "name": "muon",
        "learning_rate": muon_lr,
        "beta": 0.9,
        "ema": True,
        "nesterov": False,
        **presets.FEDMUON_LMO_ORTHOGONALIZATION,
        "fallback": "momentum_sgd",  # the same EMA momentum, unorthogonalized
        "fallback_lr_ratio": sgd_lr / muon_lr,
    }
    for setting, (muon_lr, sgd_lr) in _FEDMUON_LMO_LRS.items()
}

_FEDMUON_LIU = presets.fedmuon_liu_presets(
    {"resnet18": presets.fedmuon_liu_muon(3e-2), "vit_tiny": presets.fedmuon_liu_muon(2e-2)}
)

PRESETS = {
    "muon_reference": presets.muon_reference(0.95),
    **presets.fedpac_presets(_MUON),
    **_FEDMUON_LIU,
    **{  # FedMuon (Liu et al.) Alg. 2 line 8: UV^T of an exact SVD
        f"{name}_exactsvd": presets.variant(preset, optim={"orthogonalizer": "svd"})
        for name, preset in _FEDMUON_LIU.items()
        if "_fig4_" not in name
    },
    **presets.fedmuon_lmo_presets(_FEDMUON_LMO, presets.FEDMUON_LMO_TABLE_OPTIONS),
    **presets.fedmuon_lmo_presets(
        {
            s: {**_FEDMUON_LMO[s], **presets.FEDMUON_LMO_ORTHOGONALIZATION_CLASSIC}
            for s in _FEDMUON_LMO_SETTINGS
        },
        presets.FEDMUON_LMO_TABLE_OPTIONS,
        suffix="_ns_classic",
    ),
    # Fine-tuning: FedMuon (Liu et al.)'s Muon at Sec. 7's 3e-3 (Tables 3-4), FedPAC (Liu et
    # al.)'s at Table 9's 1e-2; non-matrix leaves AdamW at the tables' AdamW rate 1e-4.
    **presets.fedmuon_liu_finetune_presets(
        presets.fedmuon_liu_muon(
            presets.FEDMUON_LIU_FINETUNE_MUON_LR, presets.FEDMUON_LIU_FINETUNE_ADAMW_LR
        )
    ),
    **presets.fedpac_finetune_presets(presets.FEDPAC_FINETUNE_OPTIM["muon"]),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "local_muon"
    # FedPAC (Liu et al.) Alg. 6 at lr 0.05 (base: 0.05, kept): EMA momentum 0.9, no Nesterov,
    # no shape factor, weight decay 0.01, AdamW at the default AdamW rate on biases and norms.
    presets.set_optim(config, presets.default_muon("fedpac", 0.05))
    # One batched Newton–Schulz per group of equal-shape matrices (fedorth.optim.muon.
    # orthogonalize_tree): same directions; slower on CPU, for accelerators (docs/PERFORMANCE.md).
    config.optim.group_shapes = False
    return presets.select(config, arg, PRESETS, "local_muon")
