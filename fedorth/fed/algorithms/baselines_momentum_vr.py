"""FedAvg-M, FedAvg-VR, SCAFFOLD-M and SCAFFOLD-VR (Cheng et al. 2024; baselines of FedMuon (Zhang
& Gao)).

Cheng, Huang, Wu, Yuan, "Momentum Benefits Non-IID Federated Learning Simply and Provably",
ICLR 2024 (arXiv:2306.16504); FedMuon (Zhang & Gao) (docs/PAPERS.md) compares
against all four in Sec. 7. Round ``r`` starts at ``x^r`` with the server momentum ``g^r``;
sampled client ``i`` runs ``K`` steps ``x <- x - eta u`` with the direction

* FedAvg-M:     ``u = beta grad F(x; xi) + (1 - beta) g^r``
* SCAFFOLD-M:   ``u = beta (grad F(x; xi) - c_i + c) + (1 - beta) g^r``
* FedAvg-VR:    ``u = grad F(x; xi) + (1 - beta)(g^r - grad F(x^{r-1}; xi))``
* SCAFFOLD-VR:  the FedAvg-VR direction ``+ beta (c - c_i)``

(both gradients of a VR step on the same sample ``xi``); then the server sets
``g^{r+1} = mean_i (x^r - x_i^K) / (K eta)`` (the mean local direction), ``x^{r+1} = x^r -
gamma g^{r+1}`` and, for SCAFFOLD, ``c_i <- (1/K) sum_k grad F(x_i^{r,k}; xi)`` for the sampled
clients and ``c <- c + (1/N) sum_{i in S} (c_i^+ - c_i)``.

Engine mapping: ``g^r`` is the engine's ``global_direction`` (``g_G``,
``Corrections(global_direction=True)``), ``gamma`` the rule ``update.GlobalStep(gamma)``
(``server_lr``; ``None`` gives ``update.Mean()``, i.e. ``gamma = K eta_r``, plain averaging), the
new ``c_i`` of the SCAFFOLD variants the :func:`fedorth.optim.momentum_vr.running_mean` of the
round's raw gradients, read by ``Corrections(control=FromState(running_mean_of))``, and the VR
anchor ``x^{r-1}`` a ``ServerQuantities`` in ``ServerState.extra["prev_params"]`` (sent down: one
more model per round).

Choices where the source leaves room: ``g^0 = 0``, ``c = c_i = 0`` and ``x^{-1} = x^0``
(the first round of a VR method is then a FedAvg-M-like round); the VR anchor is the previous
*global* model ``x^{r-1}`` (the point at which ``g^r``'s round started); the SCAFFOLD-VR
control variate is, as in SCAFFOLD-M, the mean raw gradient. FedAvg-M with ``server_lr=None``
is FedCM (Xu et al. 2021) with ``alpha = beta``.

Sources. Cheng et al.'s algorithm boxes and code could not be read: only the paper's abstract
and introduction are public, and no code by the authors was found, so
``g^0 = 0``, the VR anchor and the SCAFFOLD-VR control variate stay unconfirmed. One third-party
reimplementation of FedAvg-M was found (NPCLEI/fedtorch, ``fedtorchPRO/ultra/avgM/client.py``
and ``server.py``, commit ad16901, headed with the paper's title). It agrees on the direction
``u = beta g + (1 - beta) G`` (``beta`` = 0.1, the weight of the fresh gradient, by default) and
on ``G = 0`` at the start; its ``G`` is the mean model difference ``mean_i (x^r - x_i^K)``
itself, ``K eta`` times our ``g^{r+1}`` (the two coincide when ``K eta = 1``). Its server
averages the models (``server_lr=None`` here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedorth.fed import local, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import Corrections, FromState
from fedorth.fed.quantities import ServerQuantities
from fedorth.optim import momentum_vr

PAPER = (
    "Cheng et al. 2024 (ICLR), 'Momentum benefits non-IID FL'; "
    "FedMuon (Zhang & Gao) Sec. 7 baselines"
)


def running_mean_of(opt_state: Any) -> Any:
    """The ``mean`` of the one :class:`~fedorth.optim.momentum_vr.RunningMeanState` (or
    ``RoundMeanState``) in a state."""
    kinds = (momentum_vr.RunningMeanState, momentum_vr.RoundMeanState)
    is_node = lambda n: isinstance(n, kinds)  # noqa: E731
    nodes = [n for n in jax.tree.leaves(opt_state, is_leaf=is_node) if is_node(n)]
    if len(nodes) != 1:
        raise ValueError(f"expected one running_mean state in the optimizer state, got {nodes}.")
    return nodes[0].mean


def sgd_weight_decay(optim: Mapping[str, Any], name: str) -> float:
    """The weight decay of a plain-SGD ``optim`` config; errors for other local optimizers."""
    opt, weight_decay, hp = local.split_optim(optim)
    if opt != "sgd" or hp.get("momentum", 0.0):
        raise ValueError(
            f"{name} builds its own momentum on the stochastic gradient: set optim.name='sgd' "
            f"without optim.momentum, got optim.name={opt!r} with {sorted(hp)}."
        )
    return weight_decay


def prev_params_quantities(*, variance_reduction: bool) -> ServerQuantities | None:
    """The previous global model ``x^{r-1}`` kept in ``extra`` (None without VR)."""
    if not variance_reduction:
        return None
    return ServerQuantities(
        # A copy: the round donates the server state, so no two leaves may share a buffer.
        init=lambda params: {"prev_params": jax.tree.map(jnp.copy, params)},
        # x^{r-1} of the next round: this round's start.
        update=lambda ctx, new, reports: {**ctx.server.extra, "prev_params": ctx.params},
    )


def check_beta(beta: float) -> None:
    if not 0.0 < beta <= 1.0:
        raise ValueError(
            f"fed.options.beta={beta} must lie in (0, 1] (weight of the new gradient)."
        )


def _momentum_family(
    optim: Mapping[str, Any],
    *,
    name: str,
    beta: float,
    server_lr: float | None,
    variance_reduction: bool,
    control_variate: bool,
) -> FedAlgorithm:
    check_beta(beta)
    weight_decay = sgd_weight_decay(optim, name)
    parts = [momentum_vr.running_mean()] if control_variate else []
    parts.append(
        momentum_vr.global_momentum(
            beta, variance_reduction=variance_reduction, control_variate=control_variate
        )
    )
    tx = local.local_tx(optax.chain(*parts), weight_decay=weight_decay)
    return FedAlgorithm(
        name=name,
        local_tx=tx,
        corrections=Corrections(
            global_direction=True,
            control=FromState(running_mean_of) if control_variate else None,
        ),
        server=update.ServerUpdate(rule=update.global_step_or_mean(server_lr)),
        quantities=prev_params_quantities(variance_reduction=variance_reduction),
        paper=PAPER,
    )


def fedavg_m(
    optim: Mapping[str, Any], *, beta: float = 0.1, server_lr: float | None = None
) -> FedAlgorithm:
    """FedAvg-M: ``u = beta g + (1 - beta) g^r`` (Cheng et al. 2024, Alg. 1).

    Args:
      optim: ``name="sgd"`` (no momentum), ``learning_rate`` (eta), ``weight_decay``.
      beta: weight of the new stochastic gradient, in (0, 1].
      server_lr: ``gamma`` of ``x^{r+1} = x^r - gamma g^{r+1}``; ``None``: ``K eta_r``.
    """
    return _momentum_family(
        optim,
        name="fedavg_m",
        beta=beta,
        server_lr=server_lr,
        variance_reduction=False,
        control_variate=False,
    )


def fedavg_vr(
    optim: Mapping[str, Any], *, beta: float = 0.1, server_lr: float | None = None
) -> FedAlgorithm:
    """FedAvg-VR: ``u = g + (1 - beta)(g^r - grad F(x^{r-1}; xi))`` (Cheng et al. 2024).

    Args: as :func:`fedavg_m`.
    """
    return _momentum_family(
        optim,
        name="fedavg_vr",
        beta=beta,
        server_lr=server_lr,
        variance_reduction=True,
        control_variate=False,
    )


def scaffold_m(
    optim: Mapping[str, Any], *, beta: float = 0.1, server_lr: float | None = None
) -> FedAlgorithm:
    """SCAFFOLD-M: ``u = beta (g - c_i + c) + (1 - beta) g^r`` (Cheng et al. 2024, Alg. 2).

    Args: as :func:`fedavg_m`.
    """
    return _momentum_family(
        optim,
        name="scaffold_m",
        beta=beta,
        server_lr=server_lr,
        variance_reduction=False,
        control_variate=True,
    )


def scaffold_vr(
    optim: Mapping[str, Any], *, beta: float = 0.1, server_lr: float | None = None
) -> FedAlgorithm:
    """SCAFFOLD-VR: the FedAvg-VR direction ``+ beta (c - c_i)`` (Cheng et al. 2024).

    Args: as :func:`fedavg_m`.
    """
    return _momentum_family(
        optim,
        name="scaffold_vr",
        beta=beta,
        server_lr=server_lr,
        variance_reduction=True,
        control_variate=True,
    )
