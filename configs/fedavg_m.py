r"""FedAvg-M (Cheng et al. 2024, Alg. 1), a baseline of FedMuon (Zhang & Gao) Sec. 7: local steps along
``beta g + (1 - beta) g^r`` with the server momentum ``g^r``, server step ``gamma``.

    python -m experiments.main --config=configs/fedavg_m.py --workdir=runs/fedavg_m
    python -m experiments.main --config=configs/fedavg_m.py:fedmuon_zg_cifar10_resnet18_tau4 --workdir=...

Default preset: embedded digits, final test accuracy 0.96 (seed 42, 60 rounds).

Presets: (default) embedded digits on 2 CPU cores; FedMuon (Zhang & Gao)'s settings (configs/presets.py:
8 workers, full participation, batch 64, K = tau, cosine): ``fedmuon_zg_{cifar10,cifar100}_
{resnet18,vit}_tau{4,16}``, ``fedmuon_zg_sentiment140_rnn_tau{4,16}`` and
``fedmuon_zg_cifar10_resnet18_dir0.5_tau4`` (Figure 4).

FedMuon (Zhang & Gao) grid-searches every baseline's learning rate without reporting the chosen values and
fixes "the momentum hyperparameters beta for all methods at 0.9": in the convention of Cheng et
al. (``beta`` weighs the *new* gradient) that is ``beta = 0.1``. The learning rates of the
FedMuon (Zhang & Gao) presets of this and the other baselines' configs (fedavg_vr, scaffold_m,
scaffold_vr, padamfed, padamfed_vr, fafed, adam_biclip) are our starting points, not the
paper's.
"""

from configs import base, presets

PRESETS = presets.fedmuon_zg_presets(
    {"name": "sgd", "learning_rate": 0.05, "weight_decay": 5e-4}, {"beta": 0.1, "server_lr": None}
)


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedavg_m"
    config.fed.options.beta = 0.1  # weight of the new gradient (momentum 0.9)
    config.fed.options.server_lr = None  # gamma; None: K * eta (the server averages models)
    config.optim.name = "sgd"  # the momentum is the algorithm's, on the plain gradient
    config.optim.learning_rate = 0.1
    return presets.select(config, arg, PRESETS, "fedavg_m")
