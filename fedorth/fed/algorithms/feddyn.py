"""FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization", Alg. 1).

Client ``k`` in the round's sample ``P_t`` starts from the server's ``w^{t-1}`` and minimizes
its dynamically regularized loss

    ``L_k(w) - <grad L_k(w_k^{t-1}), w> + alpha/2 ||w - w^{t-1}||^2``

then updates its own ``grad L_k(w_k^t) = grad L_k(w_k^{t-1}) - alpha (w_k^t - w^{t-1})``
(Alg. 1's first-order condition; absent clients keep theirs). The server updates
``h^t = h^{t-1} - alpha/m sum_{k in P_t} (w_k^t - w^{t-1})`` and sets
``w^t = mean_{k in P_t} w_k^t - h^t / alpha``; ``h`` and every ``grad L_k`` start at 0.

In fedorth's axes: each client's ``grad L_k`` is its control variate ``c_i`` (kept per client,
as SCAFFOLD's: ``Corrections(control=...)``, :class:`DynamicGradient`), so the server's control
``c <- c + 1/N sum_{k in P_t} (c_k+ - c_k)`` is ``h``; the server step is a ``combine`` reading
``h^{t-1}`` from the round's context (``ctx.server.control``) and ``m = N``, ``|P_t| = S``.

Choices where the paper is silent:

* Alg. 1 writes an exact ``argmin``; the client takes ``K`` steps of the local optimizer (SGD,
  as in the paper's experiments, with the config's weight decay) on the regularized loss, whose
  extra gradient ``alpha (w - w^{t-1}) - grad L_k`` is added to each mini-batch gradient before
  the optimizer (``fedorth.optim.federated.add_dynamic_regularizer``). The ``grad L_k`` update
  is Alg. 1's first-order condition, exact only at the ``argmin``; it is applied as written.
* ``alpha``: Sec. 5 searches {0.1, 0.01, 0.001}; the default 0.01 is that grid's middle value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from fedorth.fed import local, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import ControlVariate, Corrections
from fedorth.optim import federated as fed_optim


@dataclasses.dataclass(frozen=True)
class DynamicGradient(ControlVariate):
    """``grad L_k <- grad L_k - alpha (w_k^t - w^{t-1})`` (Alg. 1), ``delta = w_k^t - w^{t-1}``."""

    alpha: float

    def update(self, ctx, control_i, delta, opt_state):
        del ctx, opt_state
        return jax.tree.map(lambda g, d: g - self.alpha * d, control_i, delta)


def feddyn(optim: Mapping[str, Any], *, alpha: float = 0.01) -> FedAlgorithm:
    """FedDyn (module docstring).

    Args:
      optim: the local optimizer that approximates Alg. 1's ``argmin`` (SGD in the paper).
      alpha: the dynamic regularizer's weight, > 0.
    """
    if fed_optim.is_concrete(alpha) and not alpha > 0:
        raise ValueError(f"fed.options.alpha={alpha} must be > 0 (FedDyn divides by it).")
    opt, weight_decay, hp = local.split_optim(optim)
    tx = local.local_tx(
        local.direction(opt, **hp),
        weight_decay=local.decay_rates(opt, weight_decay, hp),
        pre=(fed_optim.add_dynamic_regularizer(alpha),),
    )

    def combine(ctx, deltas_C, reports_C):
        # w^t - w^{t-1} = mean(dw) - h^t / alpha, h^t = h^{t-1} - alpha (S/N) mean(dw).
        del reports_C
        part = ctx.clients_per_round / ctx.num_clients
        mean = jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas_C)
        return jax.tree.map(
            lambda h, d: d - (h - alpha * part * d) / alpha, ctx.server.control, mean
        )

    return FedAlgorithm(
        name="feddyn",
        local_tx=tx,
        corrections=Corrections(control=DynamicGradient(alpha)),
        server=update.ServerUpdate(combine=combine),
        paper="Acar et al. 2021, Alg. 1 (FedDyn)",
    )
