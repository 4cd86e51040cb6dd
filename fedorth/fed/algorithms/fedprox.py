"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks", Alg. 2).

Each sampled client runs ``K`` local steps of its optimizer on

    h_i(w) = f_i(w) + mu/2 ||w - x^r||^2,

the proximal term keeping it near the round's model ``x^r`` (read from the round's context,
:class:`fedorth.fed.RoundContext`), and the server averages the clients' models:
``x^{r+1} = mean_{i in S} x_i^K``.

Choices (what the box leaves open):

* Alg. 2 asks each client for a ``gamma``-inexact minimizer of ``h_i``; as in the paper's
  experiments (Sec. 5.1: "we use SGD as a local solver"), the client runs ``K`` steps of the local
  optimizer on ``h_i``, the proximal gradient ``mu (w - x^r)`` added to each mini-batch gradient
  before the optimizer's direction (``fedorth.optim.federated.add_proximal_term``). With another
  optimizer (``optim.name``), the term enters that optimizer's direction the same way.
* The paper's server step is the plain average of the sampled clients' models (its Alg. 2 line
  8), here ``update.ServerUpdate()`` with ``server_lr = 1``; ``server_lr`` scales the averaged
  update as in FedAvg's server step.
* ``mu = 0.01`` by default, the middle of the paper's grid ``{0.001, 0.01, 0.1, 1}`` (Sec. 5.3);
  ``mu = 0`` is FedAvg.
* Decoupled weight decay (``optim.weight_decay``) is applied after the direction, as for every
  local optimizer; it is not part of ``h_i``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from fedorth.fed import local, start, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.optim import federated as fed_optim


def fedprox(optim: Mapping[str, Any], *, mu: float = 0.01, server_lr: float = 1.0) -> FedAlgorithm:
    """FedProx with proximal weight ``mu`` (0: FedAvg) and the server's step ``server_lr``."""
    if fed_optim.is_concrete(mu) and not mu >= 0.0:  # else a sweep's traced value
        raise ValueError(f"fed.options.mu={mu} must be >= 0.")
    opt, weight_decay, hp = local.split_optim(optim)
    tx = local.local_tx(
        local.direction(opt, **hp),
        weight_decay=local.decay_rates(opt, weight_decay, hp),
        pre=(fed_optim.add_proximal_term(mu),),
    )
    return FedAlgorithm(
        name="fedprox",
        local_tx=tx,
        start=start.Reset(),
        server=update.ServerUpdate(tx=optax.sgd(server_lr)),
        paper="Li et al. 2020, Alg. 2",
    )
