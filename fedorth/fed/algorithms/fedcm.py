"""FedCM (Xu et al. 2021, "FedCM: Federated Learning with Client-level Momentum", Alg. 1).

Clients step along ``v = alpha g + (1 - alpha) Delta`` where ``Delta = -mean_i(dx_i) / (K eta)``
is the server's global momentum from the previous round: global-direction mixing with weight
``beta = 1 - alpha`` on ``g_G`` (``Delta_0 = 0``). The server averages parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from fedorth.fed import local, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import Corrections
from fedorth.optim import federated as fed_optim


def fedcm(optim: Mapping[str, Any], *, alpha: float = 0.1, server_lr: float = 1.0) -> FedAlgorithm:
    """FedCM with client-level momentum weight ``alpha`` on the local gradient."""
    if fed_optim.is_concrete(alpha) and not 0.0 <= alpha <= 1.0:  # else a sweep's traced value
        raise ValueError(f"fed.options.alpha={alpha} must lie in [0, 1].")
    opt, weight_decay, hp = local.split_optim(optim)
    tx = local.local_tx(
        local.direction(opt, **hp),
        weight_decay=local.decay_rates(opt, weight_decay, hp),
        mix_beta=1.0 - alpha,
    )
    return FedAlgorithm(
        name="fedcm",
        local_tx=tx,
        corrections=Corrections(global_direction=True),
        server=update.ServerUpdate(tx=optax.sgd(server_lr)),
        paper="Xu et al. 2021, Alg. 1",
    )
