r"""FedPAC_SOAP_light (FedPAC (Liu et al.) Table 6 / Table 11): FedPAC_SOAP whose clients upload the
preconditioner state Theta low-rank (truncated SVD keeping 10% of each matrix's rank).

    python -m experiments.main --config=configs/fedpac_soap_light.py --workdir=runs/fedpac_soap_light
    python -m experiments.main --config=configs/fedpac_soap_light.py:cifar100_vit_dir0.05 --workdir=...

Default preset: the FedPAC_SOAP default (configs/fedpac_soap.py), 30 rounds, final test accuracy
0.96 (seed 42; 0.9639, 0.9611 before each round started with SOAP's update-free step as Local
SOAP's rounds do). Only L and R are truncated (Theta, FedPAC (Liu et al.) Alg. 2); with
``fed.options.aligned="state"`` the moments are too, a non-negative one projected back to >= 0
(``fedorth.optim.compress.compress_leaf``).

Presets: those of configs/fedpac_soap.py (FedPAC (Liu et al.) Tables 1/3/12/13, Table 8/10 values);
Table 6's light-variant experiment is ``cifar100_vit_dir0.05``.

Reddi et al. 2021's natural-client tasks with this config's default optimizer and options,
clients weighted uniformly: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_uniform``.
"""

from configs import fedpac_soap, presets

PRESETS = {
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["soap"], {"beta": 0.5, "aligned": "theta"}),
    **presets.reddi_uniform_presets(),
}


def get_config(arg: str | None = None):
    config = fedpac_soap.get_config()
    config.fed.algorithm = "fedpac_soap_light"  # fedpac_soap + light_ratio 0.1
    return presets.select(config, arg, PRESETS, "fedpac_soap_light")
