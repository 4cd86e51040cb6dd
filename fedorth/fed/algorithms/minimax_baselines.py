r"""Federated minimax baselines of Fed minimax (Zhang & Gao) Sec. 5: Local SGDA(M), FedSGDA-M,
F-SAGDA, FESS-GDA.

All share Fed minimax (Zhang & Gao)'s conventions (:mod:`fedorth.fed.algorithms.minimax`): primal
and dual leaves
of one parameter tree (``dual_keys``), descent with the round's ``eta_x`` on ``x`` and ascent with
``eta_y = dual_lr_ratio * eta_x`` on ``y``, and a server step ``x <- x + gamma_x mean(dx)``,
``y <- y + gamma_y mean(dy)`` (``server_lr``, ``dual_server_lr``; 1 = averaging): the rule
``update.Mean()`` through the server optimizer :func:`fedorth.optim.minimax.minimax_server_tx`.

The cited papers' algorithm boxes could not be consulted from this project's sources; each
docstring says what is implemented, what is read from the paper's abstract/Fed minimax (Zhang &
Gao)'s description,
and which choices are ours.

* ``local_sgda``: Local SGDA (Deng & Mahdavi 2021, "Local stochastic gradient descent ascent:
  convergence analysis and communication efficiency"): plain SGDA steps, models averaged. The
  "unclipped, unnormalized" baseline of the heavy-tailed comparison.
* ``local_sgdam``: Momentum Local SGDA, "LocalSGDAM" (Sharma et al. 2022, "Federated minimax
  optimization: improved convergence analyses and algorithms", ICML, the momentum-based local
  algorithm): ``d <- (1 - beta) d + beta grad`` on each variable, ``x <- x - eta_x d_x``,
  ``y <- y + eta_y d_y``; at synchronization both the models and the momenta are averaged
  (``start.Global()``). ``d_0`` is the first stochastic gradient. Sources:
  neither Sharma et al.'s box nor code could be found; all of this is unconfirmed.
* ``fedsgda_m``: FedSGDA-M (Wu et al. 2023, "Solving a class of non-convex minimax optimization in
  federated learning", NeurIPS): local STORM estimators (Cutkosky & Orabona 2019; Fed minimax
  (Zhang & Gao) Sec. 2.3)
  ``v_{k+1} = grad f(x_{k+1}; xi) + (1 - alpha)(v_k - grad f(x_k; xi))`` with the same sample at
  both points, averaged with the models at synchronization; the first step of a round uses the
  averaged estimator, the very first step ``v_0 = grad f(x_0; xi_0)``
  (``start.Global(mask=storm_aggregate_mask)``: the estimator and the step count are averaged,
  the rest restarts each round). Sources: the
  first author's repository for this paper,
  xidongwu/Federated-Minimax-and-Conditional-Stochastic-Optimization (``Fair
  Classification/FSGDA.py``, commit ad55f9a), holds FedSGDA without an estimator (SGD on ``x``;
  projected ascent on ``y`` at a snapshot of ``x`` renewed every ``otLoop`` rounds) and its
  two-level step ``x <- x_r + glr (mean_i x_i - x_r)``, which is the ``server_lr`` step here.
  The STORM variant is not in it and the box could not be read, so the estimator's round
  boundaries (averaged ``v`` used as is, ``v_0``) are unconfirmed.
* ``f_sagda``: F-SAGDA (Yang, Liu, Zhang & Liu 2022a, "SAGDA: achieving O(eps^-2) communication
  complexity in federated min-max learning", NeurIPS; arXiv 2210.00611), which "assembles
  stochastic gradient estimators from randomly sampled clients as control variates and leverages
  two learning rates on both server and client sides" (abstract). Each round, every sampled
  client ``i`` first computes a stochastic gradient ``q_i`` at the server point ``(x_t, y_t)`` on
  a fresh mini-batch of the usual size and sends it (the engine's pre-pass,
  ``Corrections(prepass=Prepass(fn, floats=1.0))``); the
  server averages them, ``v = mean_{i in S_t} q_i``, and sends ``v`` back; then client ``i`` runs
  ``K`` local steps along ``grad f_i(x, y; xi) - q_i + v`` (descent with ``eta_x`` on ``x``,
  ascent with ``eta_y`` on ``y``) and the server steps ``x <- x + gamma_x mean(dx)``,
  ``y <- y + gamma_y mean(dy)``. Nothing is kept per client between rounds. SAGDA's Alg. 1 box
  could not be read from this project's sources (only the abstract); the two-stage round above
  is the abstract's description made concrete, with our choices: the same client set for ``v``
  and for the local steps, ``q_i`` (the very gradient sent) as the client's own control variate,
  the local batch size for ``q_i`` (docs/FIDELITY.md).
* ``fess_gda``: FESS-GDA (Shen et al. 2024, "Stochastic smoothed gradient descent ascent for
  federated minimax optimization", AISTATS): local SGDA on the smoothed surrogate
  ``f(x, y) + (p/2)||x - z||^2`` (Smoothed-AGDA of Yang et al. 2022c) with the server's anchor
  ``z`` fixed during the round, global steps, then ``z <- z + beta_z (x+ - z)`` (``z_0 = x_0``).
  Choice: the smoothing gradient ``p (x - z)`` is applied at every local step (default,
  ``smoothing="local"``); ``smoothing="server"`` applies it once in the server step,
  ``x+ = x + gamma_x (mean(dx) - eta_x K p (x - z))``, as a secondary transcription of the paper
  writes it (junaidaliop/zij ``docs/math/fessgda.md``, commit 74a271e). Neither is confirmed
  against Shen et al.'s Alg. 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedorth.fed import start, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.algorithms import minimax as mm
from fedorth.fed.corrections import Corrections, Prepass
from fedorth.fed.quantities import ClientReport, ServerQuantities
from fedorth.optim import federated as fed_optim
from fedorth.optim import minimax as om
from fedorth.optim.minimax_baselines import (
    SAMPLED_GRADIENT,
    StormState,
    _count_steps,
    sampled_control_variate,
    smooth_toward_anchor,
    storm_estimator,
    variable_momentum,
)

PyTree = Any

_SGD_ONLY = {"sgd": ()}


def _server(label_fn, server_lr: float, dual_server_lr: float | None) -> update.ServerUpdate:
    dual = server_lr if dual_server_lr is None else dual_server_lr
    return update.ServerUpdate(tx=om.minimax_server_tx(label_fn, server_lr, dual, 1.0))


def _local_tx(label_fn, dual_lr_ratio: float, *parts) -> optax.GradientTransformationExtraArgs:
    return optax.chain(
        *parts, om.ascend_dual(label_fn, dual_lr_ratio), fed_optim.scale_by_round_learning_rate()
    )


# ------------------------------------------------------------------------------ Local SGDA


def local_sgda(
    optim: Mapping[str, Any],
    *,
    dual_lr_ratio: float = 1.0,
    server_lr: float = 1.0,
    dual_server_lr: float | None = None,
    dual_keys: Sequence[str] = ("dual",),
) -> FedAlgorithm:
    """Local SGDA (Deng & Mahdavi 2021): ``x -= eta_x grad_x f``, ``y += eta_y grad_y f``, average.

    Args:
      optim: ``{"name": "sgd", "learning_rate": eta_x}``.
      dual_lr_ratio: ``eta_y / eta_x``.
      server_lr: ``gamma_x`` in ``x <- x + gamma_x mean(dx)``.
      dual_server_lr: ``gamma_y`` (default ``gamma_x``).
      dual_keys: keys marking dual leaves.
    """
    mm.split_minimax_optim(optim, "local_sgda", _SGD_ONLY)
    label_fn = om.make_label_fn(dual_keys)
    return FedAlgorithm(
        name="local_sgda",
        local_tx=_local_tx(label_fn, dual_lr_ratio),
        server=_server(label_fn, server_lr, dual_server_lr),
        paper="Deng & Mahdavi 2021 (Local SGDA)",
    )


# -------------------------------------------------------------------- LocalSGDAM (Sharma)


def local_sgdam(
    optim: Mapping[str, Any],
    *,
    beta_x: float = 0.1,
    beta_y: float | None = None,
    dual_lr_ratio: float = 1.0,
    server_lr: float = 1.0,
    dual_server_lr: float | None = None,
    dual_keys: Sequence[str] = ("dual",),
) -> FedAlgorithm:
    """LocalSGDAM (Sharma et al. 2022): local momentum SGDA, models and momenta averaged.

    Args:
      optim: ``{"name": "sgd", "learning_rate": eta_x}``.
      beta_x: weight of the new gradient in the primal momentum: 0.1 reads Fed minimax (Zhang
        & Gao) §5's "beta is fixed at 0.9" as the usual momentum 0.9 (``fedmuon_zg`` module).
      beta_y: the same for the dual (default ``beta_x``).
      dual_lr_ratio: ``eta_y / eta_x``.
      server_lr: ``gamma_x``.
      dual_server_lr: ``gamma_y`` (default ``gamma_x``).
      dual_keys: keys marking dual leaves.
    """
    mm.split_minimax_optim(optim, "local_sgdam", _SGD_ONLY)
    label_fn = om.make_label_fn(dual_keys)
    beta_y = beta_x if beta_y is None else beta_y
    return FedAlgorithm(
        name="local_sgdam",
        local_tx=_local_tx(label_fn, dual_lr_ratio, variable_momentum(label_fn, beta_x, beta_y)),
        start=start.Global(),
        server=_server(label_fn, server_lr, dual_server_lr),
        paper="Sharma et al. 2022 (Momentum Local SGDA)",
    )


# -------------------------------------------------------------------------- FedSGDA-M (Wu)


def storm_aggregate_mask(opt_state):
    """Aggregate (and warm-start) the estimator and the step counter; restart the rest."""

    def go(node):
        if isinstance(node, StormState):
            return StormState(
                count=True,
                local_count=False,
                estimate=jax.tree.map(lambda _: True, node.estimate),
                previous=jax.tree.map(lambda _: False, node.previous),
            )
        return jax.tree.map(lambda _: True, node)

    return jax.tree.map(go, opt_state, is_leaf=lambda n: isinstance(n, StormState))


def fedsgda_m(
    optim: Mapping[str, Any],
    *,
    alpha_x: float = 0.1,
    alpha_y: float | None = None,
    dual_lr_ratio: float = 1.0,
    server_lr: float = 1.0,
    dual_server_lr: float | None = None,
    dual_keys: Sequence[str] = ("dual",),
) -> FedAlgorithm:
    """FedSGDA-M (Wu et al. 2023): local STORM estimators, averaged with the models.

    Args:
      optim: ``{"name": "sgd", "learning_rate": eta_x}``.
      alpha_x: STORM weight of the new gradient on ``x``: 0.1 reads Fed minimax (Zhang & Gao)
        §5's "beta is fixed at 0.9" as the usual momentum 0.9 (``fedmuon_zg`` module).
      alpha_y: the same on ``y`` (default ``alpha_x``).
      dual_lr_ratio: ``eta_y / eta_x``.
      server_lr: ``gamma_x``.
      dual_server_lr: ``gamma_y`` (default ``gamma_x``).
      dual_keys: keys marking dual leaves.
    """
    mm.split_minimax_optim(optim, "fedsgda_m", _SGD_ONLY)
    label_fn = om.make_label_fn(dual_keys)
    alpha_y = alpha_x if alpha_y is None else alpha_y
    return FedAlgorithm(
        name="fedsgda_m",
        local_tx=_local_tx(label_fn, dual_lr_ratio, storm_estimator(label_fn, alpha_x, alpha_y)),
        start=start.Global(mask=storm_aggregate_mask),
        server=_server(label_fn, server_lr, dual_server_lr),
        paper="Wu et al. 2023 (FedSGDA-M)",
    )


# ----------------------------------------------------------------------- F-SAGDA (Yang)


def _sampled_gradient(ctx, client) -> dict:
    """The pre-pass of SAGDA: the client's stochastic gradient at the server point."""
    return {SAMPLED_GRADIENT: client.grad_fn(ctx.params)}


def f_sagda(
    optim: Mapping[str, Any],
    *,
    dual_lr_ratio: float = 1.0,
    server_lr: float = 1.0,
    dual_server_lr: float | None = None,
    dual_keys: Sequence[str] = ("dual",),
) -> FedAlgorithm:
    """F-SAGDA (Yang et al. 2022a, SAGDA): control variates from the round's sampled clients.

    Per round: each sampled client sends ``q_i``, its stochastic gradient at ``(x_t, y_t)``; the
    server returns ``v = mean_i q_i``; each runs ``K`` steps ``x -= eta_x (g_x - q_x,i + v_x)``,
    ``y += eta_y (g_y - q_y,i + v_y)``; the server steps ``x += gamma_x mean(dx)``,
    ``y += gamma_y mean(dy)``. Communication per client: ``q_i`` up and ``v`` down besides the
    model. The abstract of arXiv 2210.00611 is the source; Alg. 1's box was out of reach (module
    docstring: what is ours).

    Args:
      optim: ``{"name": "sgd", "learning_rate": eta_x}`` (the client step).
      dual_lr_ratio: ``eta_y / eta_x``.
      server_lr: ``gamma_x``, the server step.
      dual_server_lr: ``gamma_y`` (default ``gamma_x``).
      dual_keys: keys marking dual leaves.
    """
    mm.split_minimax_optim(optim, "f_sagda", _SGD_ONLY)
    label_fn = om.make_label_fn(dual_keys)
    return FedAlgorithm(
        name="f_sagda",
        local_tx=_local_tx(label_fn, dual_lr_ratio, sampled_control_variate()),
        server=_server(label_fn, server_lr, dual_server_lr),
        paper="Yang et al. 2022a (SAGDA)",
        # q_i up, v down: one pytree like the params each way.
        corrections=Corrections(prepass=Prepass(_sampled_gradient, floats=1.0)),
    )


# ------------------------------------------------------------------------ FESS-GDA (Shen)


def _fess_server_pieces(label_fn, penalty: float, rate: float, gx: float, on_server: bool):
    """FESS-GDA's server side: the anchor ``z`` (init, update), the clients' report and, with
    ``smoothing="server"``, the aggregate ``mean(dx) - eta_x K p (x - z)``."""

    def init(params):
        return {"smoothing_anchor": jax.tree.map(jnp.copy, params)}

    def report(ctx, client):
        out = {"delta": jax.tree.map(lambda a, b: a - b, client.params, ctx.params)}
        if on_server:  # eta_x K of the server's smoothing term
            out["smooth_scale"] = ctx.learning_rate * client.opt_state[0].count
        return out

    def smoothed(server, delta, scale):
        """``mean(dx) - eta_x K p (x - z)`` on primal leaves (``"server"``), else ``mean(dx)``."""
        if not on_server:
            return delta
        on = om._by_label(label_fn, server.params, float(penalty), 0.0)
        return jax.tree.map(
            lambda d, x, z, p: (d - scale * p * (x - z.astype(x.dtype))).astype(d.dtype),
            delta,
            server.params,
            server.extra["smoothing_anchor"],
            on,
        )

    def aggregate(ctx, deltas_c, reports_c):
        mean = jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas_c)
        return smoothed(ctx.server, mean, jnp.mean(reports_c["smooth_scale"]))

    def update_anchor(ctx, new, reports):
        # x+ is recomputed from the pre-round state, in the rounding of the box's own step.
        del new
        server = ctx.server
        delta = smoothed(server, reports["delta"], reports.get("smooth_scale", 0.0))
        # The server's primal step x+ = x + gamma_x mean(dx) (the "mean" rule with sgd(gamma_x)).
        on = om._by_label(label_fn, server.params, rate, 0.0)
        anchor = jax.tree.map(
            lambda z, x, d, r: (z + r * (x + gx * d - z)).astype(z.dtype),
            server.extra["smoothing_anchor"],
            server.params,
            delta,
            on,
        )
        return {"smoothing_anchor": anchor}

    return init, report, aggregate, update_anchor


def fess_gda(
    optim: Mapping[str, Any],
    *,
    penalty: float = 1.0,
    anchor_rate: float = 0.5,
    dual_lr_ratio: float = 1.0,
    server_lr: float = 1.0,
    dual_server_lr: float | None = None,
    dual_keys: Sequence[str] = ("dual",),
    smoothing: str = "local",
) -> FedAlgorithm:
    """FESS-GDA (Shen et al. 2024): local SGDA on ``f + (p/2)||x - z||^2``, ``z`` tracks ``x``.

    Args:
      optim: ``{"name": "sgd", "learning_rate": eta_x}``.
      penalty: ``p`` (the paper's choice is ``2 L``; smoothness ``L`` is unknown here).
      anchor_rate: ``beta_z`` in ``z <- z + beta_z (x+ - z)``, in [0, 1].
      dual_lr_ratio: ``eta_y / eta_x``.
      server_lr: ``gamma_x``.
      dual_server_lr: ``gamma_y`` (default ``gamma_x``).
      dual_keys: keys marking dual leaves.
      smoothing: ``"local"``: ``p (x - z)`` is added to every local primal gradient;
        ``"server"``: plain local SGDA and one server term,
        ``x+ = x + gamma_x (mean(dx) - eta_x K p (x - z))``, as a secondary transcription of the
        paper writes it (junaidaliop/zij ``docs/math/fessgda.md``; docs/FIDELITY.md). The two
        agree to first order in ``eta``; which one Shen et al.'s Alg. 1 has is unconfirmed.
    """
    if smoothing not in ("local", "server"):
        raise ValueError(f"fed.options.smoothing={smoothing!r}; valid: ('local', 'server').")
    mm.split_minimax_optim(optim, "fess_gda", _SGD_ONLY)
    rate = om._check_unit("anchor_rate", anchor_rate, closed_low=True)
    label_fn = om.make_label_fn(dual_keys)
    gx = om._check_positive("server_lr", server_lr)
    on_server = smoothing == "server"
    if on_server and not penalty >= 0:
        raise ValueError(f"fed.options.penalty={penalty} must be >= 0.")

    init, report, aggregate, update_anchor = _fess_server_pieces(
        label_fn, penalty, rate, gx, on_server
    )

    if on_server:
        local_tx = _local_tx(label_fn, dual_lr_ratio, _count_steps())
    else:
        local_tx = _local_tx(label_fn, dual_lr_ratio, smooth_toward_anchor(label_fn, penalty))
    return FedAlgorithm(
        name="fess_gda",
        local_tx=local_tx,
        server=dataclasses.replace(
            _server(label_fn, gx, dual_server_lr), combine=aggregate if on_server else None
        ),
        paper="Shen et al. 2024 (FESS-GDA)",
        quantities=ServerQuantities(init, update_anchor),
        report=ClientReport(report),  # the update dx, which the engine already counts
    )
