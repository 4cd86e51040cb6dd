r"""FedAvg / Local SGD (McMahan et al. 2017; FedPAC (Liu et al.) Alg. 1 "FedSOA" with SGD): local SGD from
the global model each round, the server averages the parameter updates.

    python -m experiments.main --config=configs/fedavg.py --workdir=runs/fedavg
    python -m experiments.main --config=configs/fedavg.py:cifar100_resnet18 --workdir=runs/fedavg_c100

Default preset: embedded digits (20 clients, Dir-0.3, 5 per round, K = 10, 60 rounds); final test
accuracy 0.95 (seed 42).

Presets (configs/presets.py describes each setting):
* FedPAC (Liu et al.) Tables 1/3 with Table 8/10's SGD row (lr 0.1, weight decay 0.001):
  ``cifar100_resnet18``, ``cifar100_vit``, ``tiny_imagenet_resnet18``, ``tiny_imagenet_vit``
  (Dir-0.1; ``*_dir0.05``), ``c4_llama60m``, ``c4_llama130m``, ``c4_llama350m``;
* FedMuon (Liu et al.) Table 2: ``fedmuon_liu_cifar100_{resnet18,vit}_dir{0.6,0.1,0.05}`` (lr 0.1 from its grid,
  the value FedPAC (Liu et al.)'s authors report as best; weight decay 0.001);
* FedMuon-LMO (bias-corrected LMO) Appendix G Tables 2-3 (FedAvg with momentum SGD, lr 0.1):
  ``fedmuon_lmo_{fmnist_lenet5,cifar10_resnet18}_beta{10,0.1}``, with its Alg. 3 server step
  ``X <- (n-S)/n X + 1/n sum_i X_i`` and the momentum kept per client as in its Alg. 4
  (``presets.FEDMUON_LMO_TABLE_OPTIONS``);
* fine-tuning (docs/FINETUNING.md), SGD lr 0.1, weight decay 0.001 (FedPAC (Liu et al.) Table 9;
  FedMuon (Liu et al.) Sec. 7 gives only the grid {1e-2, 3e-2, 5e-2, 1e-1, 3e-1}, wd 0.001):
  FedMuon (Liu et al.) Table 3 ``swin_t_{cifar100,tiny_imagenet}``, Table 4
  ``roberta_lora_{cola,rte,sst2,qqp,mrpc,qnli,mnli}``; FedPAC (Liu et al.) Table 2
  ``vit_base_{cifar100,tiny_imagenet}``;
* FedMuon (Zhang & Gao) Sec. 7 ("the classical method, FedAvg"): ``fedmuon_zg_{cifar10,cifar100}_
  {resnet18,vit}_tau{4,16}``, ``fedmuon_zg_sentiment140_rnn_tau{4,16}``,
  ``fedmuon_zg_cifar10_resnet18_dir0.5_tau4``, plain SGD at lr 0.05 with weight decay 5e-4
  (``presets.FEDMUON_ZG_SGD``: the paper grid-searches and reports no value).

Reddi et al. 2021's natural-client tasks at its tuned client and server rates, clients
weighted by their examples: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_examples``
(docs/FIDELITY.md, "Reddi et al.'s natural-client tasks").
"""

from configs import base, presets

_FEDMUON_LMO_MOMENTUM_SGD = {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9}

PRESETS = {
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["sgd"]),
    **presets.fedmuon_liu_presets(
        {"resnet18": presets.FEDPAC_OPTIM["sgd"], "vit_tiny": presets.FEDPAC_OPTIM["sgd"]}
    ),
    **presets.fedmuon_lmo_presets(
        {
            (dataset, beta): _FEDMUON_LMO_MOMENTUM_SGD
            for dataset in ("fashion_mnist", "cifar10")
            for beta in (10.0, 0.1)
        },
        presets.FEDMUON_LMO_TABLE_OPTIONS,  # momentum kept per client, partial server step
    ),
    **presets.fedmuon_liu_finetune_presets(presets.FEDMUON_LIU_FINETUNE_OPTIM["sgd"]),
    **presets.fedpac_finetune_presets(presets.FEDPAC_FINETUNE_OPTIM["sgd"]),
    **presets.fedmuon_zg_presets(presets.FEDMUON_ZG_SGD),
    **presets.reddi_presets("fedavg"),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedavg"
    config.optim.name = "sgd"
    config.optim.learning_rate = 0.1  # base: 0.05; 0.1 reaches 0.95 on digits in 60 rounds
    return presets.select(config, arg, PRESETS, "fedavg")
