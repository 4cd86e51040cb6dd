"""FedAvg / Local-X, FedAvgM and FedAdam.

* FedAvg (McMahan et al. 2017) with any local optimizer X (Local SGD, Local AdamW, Local Muon,
  Local SOAP, Local Sophia, Local LMO): the "FedSOA" of FedPAC (Liu et al.) Alg. 1 -- the local
  optimizer state is reset every round (``start.Reset()``) and only parameter updates are
  averaged (``update.Mean()``); or, with ``fed.options.client_state="persistent"``
  (``start.Persistent()``) and ``fed.options.server_rule="partial"`` (``update.Partial()``),
  FedMuon-LMO's Alg. 3/4.
* FedAvgM / FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 2): the averaged
  update ``Delta = mean_i(x_i^K - x^r)`` is a pseudo-gradient ``-Delta`` for a server optimizer
  (SGD with momentum, or Adam with ``tau`` as its epsilon). Alg. 2's Adam has no bias
  correction (``x <- x + eta m / (sqrt(v) + tau)``), nor has Flower's ``FedAdam``; the
  server Adam here is :func:`fedorth.optim.momentum_vr.scale_by_adam_uncorrected`, not
  ``optax.adam``, which corrects: its steps are 0.47-1 times these at b1 = 0.9, b2 = 0.99
  (0.54 in round 5, 0.80 in round 100), so a server lr tuned for Alg. 2 would be off by up
  to 2.1x.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import optax

from fedorth.fed import local, start, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.optim import federated as fed_optim
from fedorth.optim.momentum_vr import scale_by_adam_uncorrected


def fedavg(
    optim: Mapping[str, Any],
    *,
    name: str = "fedavg",
    server_lr: float = 1.0,
    server_momentum: float = 0.0,
    client_state: str = "reset",
    server_rule: str = "mean",
) -> FedAlgorithm:
    """FedAvg / Local-X: average parameters (FedPAC (Liu et al.) Alg. 1 with the defaults).

    Args:
      optim: the local optimizer config.
      name: the registry name.
      server_lr: the server SGD step on the averaged update (1: averaging).
      server_momentum: the server SGD momentum (FedAvgM).
      client_state: ``"reset"`` (a fresh local optimizer state each round, FedPAC Alg. 1) or
        ``"persistent"`` (each client keeps its own state between the rounds it joins:
        ``M_i^(r,0) <- M_i^(r-1,K)`` of FedMuon-LMO (bias-corrected LMO) Alg. 4 line 5,
        LocalMuon; absent clients keep theirs, lines 12-13).
      server_rule: ``"mean"`` (``x <- mean_i x_i``) or ``"partial"``
        (``X <- (n - S)/n X + 1/n sum_{i in S} X_i``: FedMuon-LMO Alg. 3 line 10 and Alg. 4
        line 15, which moves ``S/n`` of the way to the mean).
    """
    if client_state not in ("reset", "persistent"):
        raise ValueError(
            f"fed.options.client_state={client_state!r}; valid for {name}: ('reset', 'persistent')."
        )
    opt, weight_decay, hp = local.split_optim(optim)
    tx = local.local_tx(
        local.direction(opt, **hp), weight_decay=local.decay_rates(opt, weight_decay, hp)
    )
    paper = "McMahan et al. 2017; FedPAC (Liu et al.) Alg. 1 (FedSOA)"
    if client_state == "persistent" or server_rule == "partial":
        paper = "FedMuon-LMO (bias-corrected LMO) Alg. 3 (FedAvg) / Alg. 4 (LocalMuon)"
    return FedAlgorithm(
        name=name,
        local_tx=tx,
        start=start.Persistent() if client_state == "persistent" else start.Reset(),
        server=update.ServerUpdate(
            # A traced momentum (a sweep's value) always keeps the server's trace.
            tx=optax.sgd(
                server_lr,
                momentum=server_momentum
                if not fed_optim.is_concrete(server_momentum)
                else server_momentum or None,
            ),
            rule=update.rule_named(server_rule),
        ),
        paper=paper,
    )


def fedavgm(
    optim: Mapping[str, Any], *, server_lr: float = 1.0, server_momentum: float = 0.9
) -> FedAlgorithm:
    """FedAvgM: FedAvg with server momentum (Hsu et al. 2019; Reddi et al. 2021)."""
    return dataclasses.replace(
        fedavg(optim, name="fedavgm", server_lr=server_lr, server_momentum=server_momentum),
        paper="Hsu et al. 2019 (FedAvgM); Reddi et al. 2021, Alg. 2 with server SGD momentum",
    )


def reddi_adam(lr: float, b1: float, b2: float, tau: float) -> optax.GradientTransformation:
    """The server Adam of Reddi et al. 2021, Alg. 2: ``x <- x - lr m / (sqrt(v) + tau)`` on the
    pseudo-gradient, no bias correction (module docstring)."""
    return optax.chain(scale_by_adam_uncorrected(b1, b2, tau), optax.scale(-lr))


def fedadam(
    optim: Mapping[str, Any],
    *,
    server_lr: float = 0.01,
    server_b1: float = 0.9,
    server_b2: float = 0.99,
    server_tau: float = 1e-3,
) -> FedAlgorithm:
    """FedAdam: Adam on the server's pseudo-gradient (Reddi et al. 2021, Alg. 2, tau = eps),
    without bias correction (:func:`reddi_adam`)."""
    return dataclasses.replace(
        fedavg(optim, name="fedadam"),
        server=update.ServerUpdate(tx=reddi_adam(server_lr, server_b1, server_b2, server_tau)),
        paper="Reddi et al. 2021, Alg. 2 (FedAdam)",
    )
