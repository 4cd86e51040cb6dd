"""PAdaMFed and PAdaMFed-VR (Yan et al. 2025; baselines of FedMuon (Zhang & Gao)).

Yan, Zhang, Wang, Cao, "Problem-Parameter-Free Federated Learning", ICLR 2025, Alg. 1 (and its
VR variant); FedMuon (Zhang & Gao) (docs/PAPERS.md) compares against both in
Sec. 7. SCAFFOLD-type control variates with a server momentum, and *normalized* local steps,
so that the step sizes need no problem constants (only ``S``, ``K``, ``T``):

* client ``i`` of round ``r`` starts at ``x^r``; with ``d = beta c + (1 - beta) g`` from the
  server, each local step is ``x <- x - eta v / ||v||`` with
  ``v = beta (grad F(x; xi) - c_i) + d`` (PAdaMFed) or
  ``v = grad F(x; xi) - (1 - beta) grad F(x^{r-1}; xi) + d - beta c_i`` (PAdaMFed-VR);
* the client uploads ``x_i^K`` and ``c_i^+ = (1/K) sum_k grad F(x_i^{r,k}; xi)``;
* the server sets ``x^{r+1} = x^r - gamma mean_i (x^r - x_i^K) / (K eta)``,
  ``g^+ = beta (c + mean_{i in S} (c_i^+ - c_i)) + (1 - beta) g`` and
  ``c^+ = c + (1/N) sum_{i in S} (c_i^+ - c_i)``.

Engine mapping: ``c``/``c_i`` are the control variates
``Corrections(control=FromState(read))``, ``read`` taking the mean of the round's raw gradients
kept by :func:`fedorth.optim.momentum_vr.running_mean`; ``g`` is
``ServerState.extra["padamfed_momentum"]``, a ``ServerQuantities`` updated from the clients'
``c_i^+ - c_i`` (a ``ClientReport`` the server can form from the uploaded ``c_i^+``, so it costs
no extra upload); ``gamma`` is ``update.GlobalStep(gamma)`` (``server_lr``; ``None``:
``update.Mean()``, i.e. ``gamma = K eta_r``, plain averaging); the VR anchor ``x^{r-1}`` is
``extra["prev_params"]``.

Choices where the source leaves room: ``c = c_i = g = 0`` and ``x^{-1} = x^0`` at the start;
the VR anchor is the previous global model (the round in which ``g`` and ``c`` were formed
started there); the server momentum of the VR variant is updated as in PAdaMFed; the norm is
over all parameters together, floored at ``eps``. The paper's theory-given ``eta``, ``gamma``,
``beta`` (functions of ``S``, ``K``, ``T``) are set in the configs, not derived here. Sending
``d`` instead of ``c`` and ``g`` would save one model per round; like the paper we count both.

Sources. Yan et al.'s Alg. 1 box and code could not be read (the paper's abstract and
its public OpenReview reviews only: "line 8" of Alg. 1 is the normalized step, and the clients use
``c^{t-1}``, ``g^{t-1}`` only through ``beta c^{t-1} + (1 - beta) g^{t-1}``). One third-party
reimplementation was found, in an unnamed repository (an
mmdetection3d project: a server function ``PAdaMFed_VR`` and a client hook
``PAdaMFedVRFp16OptimizerHook``). It writes the round as ``theta^{t+1} = theta^t - gamma
g_model^t`` with ``g_model^t = mean_i (theta^t - theta_i^K) / (eta K)``, ``c^t = c^{t-1} + (1/N)
sum_S (c_i^+ - c_i)``, ``g^t = beta (c^{t-1} + mean_S (c_i^+ - c_i)) + (1 - beta) g^{t-1}``,
broadcasts ``d = beta c^t + (1 - beta) g^t``, uploads ``c_i^+ = (1/K) sum_k grad``, and steps
along ``(grad + d - beta c_i - (1 - beta) grad(anchor)) / ||.||`` (norm over all parameters):
all as here. It differs at the start (one FedAvg round, then ``c`` and ``g`` bootstrapped from
the first uploads, where we start from zeros) and in the VR anchor: its clients load the model
the round starts from (``theta^{t+1}`` as just saved), although the file is named "previous
global" and its notation makes ``theta^{t-1}`` the previous round's start, which is what
fedorth uses. Which one Yan et al. mean stays unconfirmed (docs/FIDELITY.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedorth.fed import local, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.algorithms.baselines_momentum_vr import (
    check_beta,
    running_mean_of,
    sgd_weight_decay,
)
from fedorth.fed.corrections import Corrections, FromState
from fedorth.fed.quantities import ClientReport, ServerQuantities
from fedorth.optim import momentum_vr

PAPER = (
    "Yan et al. 2025 (ICLR), 'Problem-Parameter-Free FL', Alg. 1; "
    "FedMuon (Zhang & Gao) Sec. 7 baselines"
)
MOMENTUM = "padamfed_momentum"


def padamfed(
    optim: Mapping[str, Any],
    *,
    beta: float = 0.1,
    server_lr: float | None = None,
    variance_reduction: bool = False,
    eps: float = 1e-12,
    name: str = "padamfed",
) -> FedAlgorithm:
    """PAdaMFed (``variance_reduction=False``) or PAdaMFed-VR (module docstring).

    Args:
      optim: ``name="sgd"`` (no momentum), ``learning_rate`` (eta, the length of each local
        step), ``weight_decay`` (added after the normalization; 0 in the paper).
      beta: momentum weight in (0, 1] (of the new gradient and of the new control variate).
      server_lr: ``gamma``; ``None``: ``K eta_r`` (the server averages the client models).
      variance_reduction: the VR variant.
      eps: floor of ``||v||``.
      name: registry name.
    """
    check_beta(beta)
    weight_decay = sgd_weight_decay(optim, name)
    direction = optax.chain(
        momentum_vr.running_mean(),
        momentum_vr.global_momentum(
            beta,
            variance_reduction=variance_reduction,
            control_variate=True,
            direction=MOMENTUM,
        ),
        momentum_vr.normalize_by_global_norm(eps),
    )

    def init_quantities(params):
        extra = {MOMENTUM: jax.tree.map(jnp.zeros_like, params)}
        if variance_reduction:
            extra["prev_params"] = jax.tree.map(jnp.copy, params)
        return extra

    def report_control_change(ctx, client):
        del ctx
        new_c = running_mean_of(client.opt_state)
        return {"dc": jax.tree.map(lambda a, b: a - b, new_c, client.persistent.control)}

    def update_quantities(ctx, new, reports):
        del new
        server = ctx.server
        momentum = jax.tree.map(
            lambda c, dc, g: beta * (c + dc) + (1.0 - beta) * g,
            server.control,
            reports["dc"],
            server.extra[MOMENTUM],
        )
        extra = {MOMENTUM: momentum}
        if variance_reduction:
            extra["prev_params"] = server.params
        return extra

    return FedAlgorithm(
        name=name,
        local_tx=local.local_tx(direction, weight_decay=weight_decay),
        corrections=Corrections(control=FromState(running_mean_of)),
        server=update.ServerUpdate(rule=update.global_step_or_mean(server_lr)),
        quantities=ServerQuantities(init_quantities, update_quantities),
        # c_i^+ - c_i is formed by the server from the uploaded c_i^+: no floats of its own.
        report=ClientReport(report_control_change),
        paper=PAPER,
    )


def padamfed_vr(optim: Mapping[str, Any], **options) -> FedAlgorithm:
    """PAdaMFed-VR (module docstring); options as :func:`padamfed`."""
    return padamfed(optim, variance_reduction=True, name="padamfed_vr", **options)
