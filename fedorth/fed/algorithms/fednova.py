"""FedNova (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", Sec. 4, Eq. (3)-(4)): normalized averaging.

Client ``i`` runs ``tau_i`` local steps of SGD with momentum ``rho``; its update is ``x_i - x =
-eta G_i a_i`` with ``a_i = [1 - rho^tau_i, ..., 1 - rho] / (1 - rho)`` (``a_i = 1`` for
plain SGD) weighting its ``tau_i`` gradients. The server normalizes each update by
``||a_i||_1`` and rescales by ``tau_eff = sum_i p_i ||a_i||_1``:

    ``x <- x + tau_eff sum_i p_i (x_i - x) / ||a_i||_1``

(FedNova's ``x <- x - tau_eff sum_i p_i eta d_i`` with ``d_i = G_i a_i / ||a_i||_1``). Each
client reports ``||a_i||_1`` (one number); the server step is a ``combine`` of the stacked
updates and reports.

**When it is FedAvg.** If every client runs the same ``K`` steps of the same optimizer, all
``||a_i||_1`` are equal, ``tau_eff`` is that value and FedNova's step is FedAvg's mean update,
whatever ``rho``. That is fedorth's default (``min_local_steps=None``: every client runs ``K``).
``fed.options.min_local_steps=m`` gives clients different step counts, as FedNova's experiments
do (Sec. 7: local epochs drawn per client and round): client ``i`` runs the first ``tau_i`` of
the ``K`` steps, ``tau_i`` uniform in ``{m, ..., K}`` per client and round
(``fedorth.optim.fednova.first_steps``), and its remaining steps change nothing.

Choices where the paper is silent or fedorth differs:

* ``p_i``: FedNova weights clients by their data sizes ``n_i / n``; fedorth averages the ``S``
  sampled clients uniformly, as its FedAvg does, so ``p_i = 1/S``.
* Weight decay (``optim.weight_decay``) is decoupled (added to the step, not to the gradient
  before the momentum), so ``a_i`` is that of the momentum alone; with weight decay 0 (the
  test's) the normalization is exact.
* The local optimizer is SGD (with heavy-ball momentum): ``a_i`` is written for it; Nesterov
  momentum and other optimizers are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from fedorth.fed import local, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.quantities import ClientReport
from fedorth.optim import fednova as fednova_optim


def fednova(optim: Mapping[str, Any], *, min_local_steps: int | None = None) -> FedAlgorithm:
    """FedNova (module docstring).

    Args:
      optim: SGD (``optim.name="sgd"``), with ``optim.momentum`` ``rho``.
      min_local_steps: None (every client runs ``K`` steps: FedAvg's update), or the least
        ``tau_i``: each client runs ``tau_i`` uniform in ``{min_local_steps, ..., K}`` (all
        ``K`` when ``min_local_steps >= K``).
    """
    opt, weight_decay, hp = local.split_optim(optim)
    if opt != "sgd" or hp.get("nesterov"):
        raise ValueError(
            f"fednova normalizes SGD's updates (heavy-ball momentum); got optim.name={opt!r}"
            f"{' with optim.nesterov' if hp.get('nesterov') else ''} (use optim.name='sgd')."
        )
    if min_local_steps is not None and not (
        isinstance(min_local_steps, int) and min_local_steps >= 1
    ):
        raise ValueError(
            f"fed.options.min_local_steps={min_local_steps!r} must be an integer >= 1 (or None)."
        )
    momentum = hp.get("momentum", 0.0)
    tx = local.local_tx(
        local.direction(opt, **hp), weight_decay=local.decay_rates(opt, weight_decay, hp)
    )
    if min_local_steps is not None:
        tx = fednova_optim.first_steps(tx, min_local_steps)

    def report_a_norm(ctx, client):
        steps = ctx.local_steps if min_local_steps is None else client.opt_state.steps
        return {"a_norm": fednova_optim.momentum_a_norm(steps, momentum)}

    def normalized_average(ctx, deltas_C, reports_C):
        a = reports_C["a_norm"]  # [S]
        tau_eff = jnp.mean(a)  # p_i = 1/S

        def normalized(d):
            return tau_eff * jnp.mean(d / a.reshape((-1,) + (1,) * (d.ndim - 1)).astype(d.dtype), 0)

        return jax.tree.map(normalized, deltas_C)

    return FedAlgorithm(
        name="fednova",
        local_tx=tx,
        report=ClientReport(report_a_norm),
        server=update.ServerUpdate(combine=normalized_average),
        paper="Wang et al. 2020 (FedNova), Sec. 4, Eq. (3)-(4)",
    )
