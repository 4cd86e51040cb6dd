r"""SCAFFOLD (Karimireddy et al. 2020, Alg. 1, option II control variates): local steps along
``g - c_i + c``; clients keep ``c_i``, the server keeps ``c``.

    python -m experiments.main --config=configs/scaffold.py --workdir=runs/scaffold
    python -m experiments.main --config=configs/scaffold.py:cifar100_resnet18 --workdir=...

Default preset: embedded digits, final test accuracy 0.97 (seed 42).

Presets (configs/presets.py):
* FedPAC (Liu et al.) Tables 1/3 with Table 8/10's SCAFFOLD row (SGD, lr 0.1, weight decay 0.001):
  ``cifar100_resnet18``, ``cifar100_vit``, ``tiny_imagenet_resnet18``, ``tiny_imagenet_vit``
  (Dir-0.1; ``*_dir0.05``), ``c4_llama{60m,130m,350m}``;
* FedMuon (Liu et al.) Table 2: ``fedmuon_liu_cifar100_{resnet18,vit}_dir{0.6,0.1,0.05}`` (lr 0.1, wd 0.001);
* FedMuon-LMO (bias-corrected LMO) Appendix G: SCAFFOLD with momentum SGD (lr 0.1)
  ``fedmuon_lmo_{fmnist_lenet5,cifar10_resnet18}_beta{10,0.1}``, and "SCAFFOLD (Adam)" (lr 0.001)
  ``fedmuon_lmo_..._beta{10,0.1}_adam``: the correction acts on the gradient before the momentum /
  Adam and ``c_i`` is the round's mean raw gradient (fedorth.fed.algorithms.scaffold explains
  why), the optimizer state is kept per client and the server takes that paper's partial step
  (``presets.FEDMUON_LMO_TABLE_OPTIONS``).

Fine-tuning (docs/FINETUNING.md), SGD lr 0.1, weight decay 0.001 (FedPAC (Liu et al.) Table 9;
FedMuon (Liu et al.) Sec. 7 gives a grid only): FedMuon (Liu et al.) Table 3
``swin_t_{cifar100,tiny_imagenet}`` and Table 4 ``roberta_lora_{cola,rte,sst2,qqp,mrpc,qnli,mnli}``;
FedPAC (Liu et al.) Table 2 ``vit_base_{cifar100,tiny_imagenet}``.

FedMuon (Zhang & Gao) Sec. 7 (SCAFFOLD among its control-variate baselines):
``fedmuon_zg_{cifar10,cifar100}_{resnet18,vit}_tau{4,16}``, ``fedmuon_zg_sentiment140_rnn_tau{4,16}``,
``fedmuon_zg_cifar10_resnet18_dir0.5_tau4``, plain SGD at lr 0.05 with weight decay 5e-4 and server
lr 1 (``presets.FEDMUON_ZG_SGD``: the paper grid-searches and reports no value).
"""

from configs import base, presets

_SETTINGS001 = [(d, b) for d in ("fashion_mnist", "cifar10") for b in (10.0, 0.1)]

PRESETS = {
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["sgd"]),
    **presets.fedmuon_liu_presets(
        {"resnet18": presets.FEDPAC_OPTIM["sgd"], "vit_tiny": presets.FEDPAC_OPTIM["sgd"]}
    ),
    **presets.fedmuon_lmo_presets(
        {s: {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9} for s in _SETTINGS001},
        presets.FEDMUON_LMO_TABLE_OPTIONS,
    ),
    **presets.fedmuon_lmo_presets(
        {s: {"name": "adamw", "learning_rate": 0.001} for s in _SETTINGS001},
        presets.FEDMUON_LMO_TABLE_OPTIONS,
        suffix="_adam",
    ),
    **presets.fedmuon_liu_finetune_presets(presets.FEDMUON_LIU_FINETUNE_OPTIM["sgd"]),
    **presets.fedpac_finetune_presets(presets.FEDPAC_FINETUNE_OPTIM["sgd"]),
    **presets.fedmuon_zg_presets(presets.FEDMUON_ZG_SGD),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "scaffold"
    config.fed.options.server_lr = 1.0  # eta_g
    config.optim.name = "sgd"
    config.optim.learning_rate = 0.1  # eta_l (base: 0.05)
    return presets.select(config, arg, PRESETS, "scaffold")
