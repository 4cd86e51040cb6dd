r"""FedMuon with bias-corrected LMOs (the bias-corrected-LMO paper, Alg. 1): persistent client
momentum ``M_i``, control variates, ``X_i <- X_i + eta lmo(M_i - C_i + C)``, partial-participation
server rule.

    python -m experiments.main --config=configs/fedmuon_bc.py --workdir=runs/fedmuon_bc
    python -m experiments.main --config=configs/fedmuon_bc.py:fedmuon_lmo_fmnist_lenet5_beta0.1 \
        --workdir=...

Default preset: embedded digits, spectral LMO with T = 5 classic Newton-Schulz steps, final test
accuracy 0.97 (seed 42).

Presets: Sec. 7.1 / Appendix G, ``fedmuon_lmo_{fmnist_lenet5,cifar10_resnet18}_beta{10,0.1}``: Muon
step size 0.001, momentum SGD step size 0.01 for non-matrix leaves (``other_lr_ratio`` = 10),
momentum weight alpha = 0.1. The spectral LMO is the one of its LocalMuon preset
(``presets.FEDMUON_LMO_ORTHOGONALIZATION``): Sec. 7.1 says FedMuon's step was scaled per layer
"following Liu et al. (2025a)", i.e. 0.2 sqrt(max(m, n)) (``shape_scaling="moonlight"``), with
Liu et al.'s (Jordan's) quintic coefficients, 5 steps; ``*_ns_classic``: Theorem 3's (15/8,
-5/4, 3/8) on both sides. Appendix G's CIFAR-10 table lacks its FedMuon row in our copy of the
paper: we use the FashionMNIST values there too.

Reddi et al. 2021's natural-client tasks with this config's default optimizer and options,
clients weighted uniformly: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_uniform``.
"""

from configs import base, presets

_LMO = {
    "name": "lmo",
    "learning_rate": 0.001,
    "norm": "spectral",
    **presets.FEDMUON_LMO_ORTHOGONALIZATION,
}
_OPTIONS = {"alpha": 0.1, "other_lr_ratio": 10.0}
_SETTINGS = [(d, b) for d in ("fashion_mnist", "cifar10") for b in (10.0, 0.1)]

PRESETS = {
    **presets.fedmuon_lmo_presets({s: _LMO for s in _SETTINGS}, _OPTIONS),
    **presets.fedmuon_lmo_presets(
        {s: {**_LMO, **presets.FEDMUON_LMO_ORTHOGONALIZATION_CLASSIC} for s in _SETTINGS},
        _OPTIONS,
        suffix="_ns_classic",
    ),
    **presets.reddi_uniform_presets(),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedmuon_bc"
    config.fed.options.alpha = 0.1  # M_i <- (1 - alpha) M_i + alpha grad
    config.fed.options.other_lr_ratio = 1.0  # lr of biases / eta
    config.optim.name = "lmo"
    config.optim.learning_rate = 0.05  # base: 0.05 (kept)
    config.optim.norm = "spectral"  # spectral (Muon) | frobenius | sign
    config.optim.ns_steps = 5  # T Newton-Schulz steps ("classic" coefficients)
    return presets.select(config, arg, PRESETS, "fedmuon_bc")
