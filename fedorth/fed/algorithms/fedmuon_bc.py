"""FedMuon with bias-corrected LMOs and control variates (FedMuon-LMO).

FedMuon-LMO (docs/PAPERS.md: "FedMuon: Federated Learning with
Bias-Corrected LMO-based Optimization"), Alg. 1:

* each client keeps its momentum ``M_i`` between the rounds it joins (line 6) --
  ``start.Persistent()``;
* local step ``M_i <- (1 - alpha) M_i + alpha grad`` (line 8) and
  ``X_i <- X_i + eta lmo(M_i - C_i + C)`` (line 9), with the LMO of the spectral (T Newton-Schulz
  steps, classic coefficients; T = 0 is ``M / ||M||_F``), Frobenius or sign norm;
* ``C_i <- M_i^{(r,K)}`` (line 11), ``C <- C + (1/n) sum_{i in S} (C_i+ - C_i)`` (line 17) --
  ``Corrections(control=FromState(read))`` with ``read`` the EMA's momentum;
* ``X <- (n - S)/n X + (1/n) sum_{i in S} X_i`` (line 18) -- ``update.Partial()``;
* absent clients keep ``M_i`` and ``C_i`` unchanged (lines 14-15).

Choices: ``M_i``, ``C_i`` and ``C`` start at zero. Non-matrix parameters (biases, norms) use
momentum SGD with its own learning rate (Sec. 7: ``other_lr_ratio`` = that lr / eta), sharing the
same momentum and control-variate correction, so that ``C_i = M_i`` holds for every leaf; their
decoupled weight decay is at that rate too, ``other_lr_ratio * lambda`` (each group at its own
rate, as Local Muon's fallback).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from fedorth.fed import local, start, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import Corrections, FromState
from fedorth.optim import federated as fed_optim


def fedmuon_bc(
    optim: Mapping[str, Any],
    *,
    alpha: float = 0.1,
    other_lr_ratio: float = 1.0,
) -> FedAlgorithm:
    """FedMuon of FedMuon-LMO Alg. 1.

    Args:
      optim: ``name="lmo"`` with ``norm`` ("spectral" | "frobenius" | "sign"), ``ns_steps`` (T)
        and ``ns_coeffs`` (default "classic", FedMuon-LMO's (15/8, -5/4, 3/8)); ``weight_decay``.
      alpha: momentum weight on the new gradient, in (0, 1] (line 8).
      other_lr_ratio: learning rate of non-matrix leaves divided by ``eta``.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"fed.options.alpha={alpha} must lie in (0, 1].")
    opt, weight_decay, hp = local.split_optim(optim)
    if opt != "lmo":
        raise ValueError(f"fedmuon_bc uses an LMO local step: set optim.name='lmo', got {opt!r}.")
    hp.pop("momentum", None)
    from fedorth.optim.muon import scale_by_lmo

    direction = optax.chain(
        fed_optim.ema(1.0 - alpha),
        fed_optim.add_control_variate(),
        optax.partition(
            {"matrix": scale_by_lmo(**hp), "other": optax.scale(other_lr_ratio)},
            local.matrix_labels,
        ),
    )
    return FedAlgorithm(
        name="fedmuon_bc",
        # Each group decays at its own rate (fedorth.fed.local.decay_rates): the non-matrix
        # leaves step at other_lr_ratio * eta, so they decay with other_lr_ratio * lambda.
        local_tx=local.local_tx(
            direction,
            weight_decay=(
                {"matrix": weight_decay, "other": other_lr_ratio * weight_decay}
                if weight_decay and other_lr_ratio != 1.0
                else weight_decay
            ),
        ),
        start=start.Persistent(),
        # Line 11: C_i <- M_i^(r,K), the EMA's momentum.
        corrections=Corrections(control=FromState(lambda opt_state: opt_state[0][0].mu)),
        server=update.ServerUpdate(rule=update.Partial()),
        paper="FedMuon-LMO Alg. 1",
    )
