r"""FedAvg-VR (Cheng et al. 2024), a baseline of FedMuon (Zhang & Gao) Sec. 7: the STORM-type direction
``g + (1 - beta)(g^r - grad F(x^{r-1}; xi))`` against the previous global model.

    python -m experiments.main --config=configs/fedavg_vr.py --workdir=runs/fedavg_vr
    python -m experiments.main --config=configs/fedavg_vr.py:fedmuon_zg_cifar10_resnet18_tau4 --workdir=...

Default preset: embedded digits, final test accuracy 0.96 (seed 42, 60 rounds).

Presets: (default) embedded digits on 2 CPU cores; FedMuon (Zhang & Gao)'s settings
(``fedmuon_zg_*``: configs/presets.py; hyperparameter notes in configs/fedavg_m.py).

The recursion feeds ``(1 - beta) g^r`` back every round and compares gradients a whole round
apart, so small ``beta`` needs a small ``K eta``: on the digits default ``beta = 0.1`` with
``eta = 0.1`` diverges, ``beta = 0.5`` learns. The FedMuon (Zhang & Gao) presets keep that paper's momentum
(``beta = 0.1``) with a smaller ``eta`` (our choice; the paper does not report its grid's pick).
"""

from configs import base, presets

PRESETS = presets.fedmuon_zg_presets(
    {"name": "sgd", "learning_rate": 0.01, "weight_decay": 5e-4}, {"beta": 0.1, "server_lr": None}
)


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedavg_vr"
    config.fed.options.beta = (
        0.5  # weight of the new gradient (1 - beta weighs g^r - grad(x^{r-1}))
    )
    config.fed.options.server_lr = None  # gamma; None: K * eta (the server averages models)
    config.optim.name = "sgd"
    config.optim.learning_rate = 0.1
    return presets.select(config, arg, PRESETS, "fedavg_vr")
