r"""FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 2): local SGD; the server
runs Adam on the pseudo-gradient ``-Delta`` (``tau`` is Adam's epsilon).

    python -m experiments.main --config=configs/fedadam.py --workdir=runs/fedadam
    python -m experiments.main --config=configs/fedadam.py:cifar100_resnet18 --workdir=...

Default preset: embedded digits, final test accuracy 0.97 (seed 42; uncorrected server Adam).

FedAdam is a baseline of FedMuon (Zhang & Gao), which reports no tuned values. Its presets run FedPAC (Liu et al.)'s
settings (Tables 1/3) with FedAvg's local hyperparameters (Table 8/10 SGD row: lr 0.1, weight
decay 0.001) and Reddi et al.'s server defaults (server lr 0.01, betas (0.9, 0.99), tau 1e-3;
the server Adam is Alg. 2's, without bias correction, the form these values were tuned for):
``cifar100_resnet18``, ``cifar100_vit``, ``tiny_imagenet_resnet18``, ``tiny_imagenet_vit``
(Dir-0.1; ``*_dir0.05``), ``c4_llama{60m,130m,350m}``. In FedMuon (Zhang & Gao)'s own settings
(Sec. 7, an adaptive baseline): ``fedmuon_zg_{cifar10,cifar100}_{resnet18,vit}_tau{4,16}``,
``fedmuon_zg_sentiment140_rnn_tau{4,16}``, ``fedmuon_zg_cifar10_resnet18_dir0.5_tau4``, local SGD
at lr 0.05 with weight decay 5e-4 (``presets.FEDMUON_ZG_SGD``, the starting point of that paper's
other SGD baselines) and the same server Adam.

Reddi et al. 2021's natural-client tasks at its tuned client and server rates, clients
weighted by their examples: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_examples``
(docs/FIDELITY.md, "Reddi et al.'s natural-client tasks").
"""

from configs import base, presets

_SERVER = {"server_lr": 0.01, "server_b1": 0.9, "server_b2": 0.99, "server_tau": 1e-3}

PRESETS = {
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["sgd"], _SERVER),
    **presets.fedmuon_zg_presets(presets.FEDMUON_ZG_SGD, _SERVER),
    **presets.reddi_presets("fedadam"),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedadam"
    config.fed.options.server_lr = 0.03  # server Adam step (Reddi et al. default 0.01)
    config.fed.options.server_b1 = 0.9
    config.fed.options.server_b2 = 0.99
    config.fed.options.server_tau = 1e-3  # Adam's epsilon on the server
    config.optim.name = "sgd"
    config.optim.learning_rate = 0.1  # base: 0.05
    return presets.select(config, arg, PRESETS, "fedadam")
