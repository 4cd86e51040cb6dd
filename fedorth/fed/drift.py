"""Preconditioner drift: which optimizer-state leaves the round summarizes, and the metrics.

FedPAC (Liu et al.) Def. 1 / Eq. 7: ``(1/S) sum_i ||Theta_i - Theta-bar||^2`` over the clients'
final preconditioner states ``Theta`` (``fedorth.optim.federated.theta_mask``: SOAP ``{L, R}``,
Sophia ``{h}``, Muon ``{m}``). An algorithm that averages the optimizer state measures it over
the averaged part of ``Theta`` (``fedorth.fed.start.Global.mask``); Local-X (state reset or
kept per client, never averaged) still logs the drift of its ``Theta`` when its optimizer
declares one (Fig. 3/5): the clients' ``Theta`` leaves are then summarized (or stacked for the
spectral variant), nothing is uploaded or averaged.

What is averaged is summarized while clients run (``fed.reduce``); the optimizer states are
stacked over the clients instead when the spectral drift is asked for or when the state has a
custom average rule (SOAP's bases, ``federated.register_average``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from fedorth.fed import metrics as fed_metrics
from fedorth.fed import reduce
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.config import RoundConfig
from fedorth.fed.state import ServerState
from fedorth.optim import federated as fed_optim

PyTree = Any


def _drift_mask(algorithm: FedAlgorithm, opt_shape: PyTree, server: ServerState) -> PyTree:
    """Leaves of the optimizer state that enter the preconditioner drift: its Θ
    (``fed_optim.theta_mask``: FedPAC (Liu et al.) §3.2), restricted to the averaged part."""
    mask = fed_optim.theta_mask(opt_shape)
    aligned = algorithm.start.aligned_mask(server.opt_state)
    if aligned is None:
        return mask
    return jax.tree.map(
        lambda keep, sub: jax.tree.map(lambda m: bool(m and keep), sub), aligned, mask
    )


@dataclasses.dataclass(frozen=True)
class DriftPlan:
    """What a round summarizes of the clients' optimizer states.

    Attributes:
      spread: ``fed.reduce`` group name -> mask of the leaves whose spread is kept.
      stream_opt: the averaged optimizer state is summarized as clients finish (else stacked).
      drift_mask: the aligned ``Theta`` leaves (``None`` without aggregation).
      theta_drift: the state is not averaged, but its ``Theta`` enters the drift metric.
      theta_mask: ``Theta``'s leaves for ``theta_drift``.
      spectral: ``RoundConfig.spectral_drift``.
    """

    spread: dict[str, Any]
    stream_opt: bool
    drift_mask: PyTree
    theta_drift: bool
    theta_mask: PyTree
    spectral: bool


def plan(algorithm: FedAlgorithm, config: RoundConfig, server: ServerState) -> DriftPlan:
    """The :class:`DriftPlan` of a round of ``algorithm`` from ``server``."""
    opt_shape = jax.eval_shape(algorithm.local_tx.init, server.params)
    stream_opt = (
        algorithm.start.averaged
        and not config.spectral_drift
        and not fed_optim.has_average_rule(opt_shape)
    )
    spread: dict[str, Any] = {"delta": None}
    drift_mask = theta_mask = None
    if algorithm.start.averaged:
        drift_mask = _drift_mask(algorithm, opt_shape, server)
    if stream_opt:
        spread["opt_state"] = drift_mask
    theta_drift = not algorithm.start.averaged and fed_optim.declares_theta(opt_shape)
    if theta_drift:
        theta_mask = fed_optim.theta_mask(opt_shape)
        if not config.spectral_drift:
            spread["theta"] = None
    return DriftPlan(spread, stream_opt, drift_mask, theta_drift, theta_mask, config.spectral_drift)


def client_outputs(
    algorithm: FedAlgorithm, drift: DriftPlan, opt_state: PyTree, averaged: dict, stacked: dict
) -> None:
    """Puts a client's final optimizer state (or its ``Theta``) where the round needs it."""
    if algorithm.start.averaged:
        (averaged if drift.stream_opt else stacked)["opt_state"] = opt_state
    if drift.theta_drift:
        theta = reduce.masked_leaves(opt_state, drift.theta_mask)
        (stacked if drift.spectral else averaged)["theta"] = theta


def server_opt_state(
    algorithm: FedAlgorithm, drift: DriftPlan, new: ServerState, stats, stacked, s: int
):
    """The server's new averaged optimizer state (if any) and the drift metrics."""
    metrics = {}
    mean = stats["mean"]
    if drift.stream_opt:
        new = new.replace(opt_state=mean["opt_state"])
        if any(jax.tree.leaves(drift.drift_mask)):
            # FedPAC (Liu et al.) Eq. (7): (1/S) sum_i ||Theta_i - Theta-bar||^2 over uploaded
            # leaves.
            metrics["precond_drift"] = stats["m2"]["opt_state"] / s
    elif algorithm.start.averaged:
        states = stacked["opt_state"]
        average = fed_optim.average_states(states, algorithm.start.read_mask(states))
        new = new.replace(opt_state=average)
        metrics.update(
            fed_metrics.preconditioner_drift(states, mask=drift.drift_mask, spectral=drift.spectral)
        )
    if drift.theta_drift and drift.spectral:
        metrics.update(fed_metrics.preconditioner_drift(stacked["theta"], spectral=True))
    elif drift.theta_drift:
        metrics["precond_drift"] = stats["m2"]["theta"] / s
    return new, metrics
