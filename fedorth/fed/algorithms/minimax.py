r"""Federated minimax: Fed-NSGDA-M, FedMuon-DA and FedSGDA-Clip (Fed minimax (Zhang & Gao)), and
their pieces.

Fed minimax (Zhang & Gao) (docs/PAPERS.md: Zhang & Gao, "Federated Stochastic Minimax
Optimization under Heavy-Tailed Noises") solves ``min_x max_y (1/N) sum_n f_n(x, y)`` with ``f``
nonconvex in ``x`` and PL in ``y``. Both variables live in **one parameter tree**; a leaf is a
*dual* (ascent) variable when a key on its path is one of ``dual_keys`` (default ``("dual",)``,
e.g. ``{"net": ..., "a": ..., "b": ..., "dual": {"alpha": ...}}`` for the AUC loss of Eq. 20),
else *primal* (descent); see :func:`minimax_labels`.

Algorithm 1 (Fed-NSGDA-M), per client ``n`` and local step ``i`` of round ``t``:

* line 5: ``u = beta_x (grad_x f_n + g_x - g_x^(n)) + (1 - beta_x) u_{t-1}`` (and ``v`` for ``y``)
  where ``u_{t-1}`` is the server's global momentum, fixed during the round;
* line 6: ``x <- x - eta_x u / ||u||``, ``y <- y + eta_y v / ||v||``;
* line 8: ``g^(n) = (1/p) sum_i grad f_n(x_i, y_i; xi_i)`` (the raw stochastic gradients);
* line 10: ``g = (1/N) sum_n g^(n)``;
* line 11: ``x <- x + gamma_x / (eta_x N p) sum_n (x^(n)_p - x)`` (``y``: ``gamma_y/eta_y``);
* line 12: ``u_t = beta_x g_x + (1 - beta_x) u_{t-1}``.

FedMuon-DA (Alg. 2/3) replaces line 6 by ``X <- X - eta_x P Q^T`` (``U = P Sigma Q^T``, computed
by Newton-Schulz); FedSGDA-Clip (Sec. 5, Eq. 21) by ``x <- x - eta_x min(1, tau/||u||) u``.

Mapping onto the engine (:class:`fedorth.fed.FedAlgorithm`):

* the local optimizer is ``chain(track_gradient_mean, minimax_momentum, scale_by_minimax_step,
  ascend_dual, scale_by_round_learning_rate)``; the round's learning rate is ``eta_x`` and the
  dual's ``eta_y = dual_lr_ratio * eta_x`` (so schedules act on both);
* ``g^(n)`` are the engine's control variates, kept per client:
  ``Corrections(control=FromState(read))`` with ``read`` the mean of the round's raw gradients
  (:func:`fedorth.optim.minimax.gradient_mean`); the engine passes
  ``control_correction = g - g^(n)`` and keeps ``g <- g + (1/N) sum_{n in S}(g^(n)+ - g^(n))``,
  which is line 10 under full participation;
* the global momentum ``(u, v)`` is ``ServerState.extra["global_momentum"]``
  (``ServerQuantities``), updated from the clients' reported ``g^(n)`` (``ClientReport``; line
  12) and passed to every local step as an extra argument;
* line 11 is ``update.GlobalStep(1.0)`` (``-mean(dx) / (p eta_x)``) through the server optimizer
  :func:`fedorth.optim.minimax.minimax_server_tx`: ``sgd(gamma_x)`` on primal and
  ``sgd(gamma_y / dual_lr_ratio)`` on dual leaves, i.e. ``gamma_y / (p eta_y)`` on the dual
  (``server_lr=None``: ``update.Mean()`` with ``sgd(1)`` on both, plain averaging).

Choices where the paper is silent or ambiguous (stated once here, repeated where they act):

* ``||u||`` is the Euclidean norm of the **whole** primal vector (all primal leaves together; the
  paper's ``x`` is one vector) and ``||v||`` of the whole dual vector (``norm_scope="variable"``);
  ``norm_scope="leaf"`` normalizes each leaf on its own (layer-wise). ``u = 0`` gives a zero step.
* FedMuon-DA orthogonalizes the leaves of Muon's default mask
  (``fedorth.optim.muon.default_muon_mask``, the mask of every Muon-based method: dense and conv
  kernels as ``(prod(shape[:-1]), shape[-1])`` matrices; not lookup tables such as embeddings,
  nor degenerate ``(1, n)`` views; the paper is silent on them), with ``ns_steps`` Newton-Schulz
  steps (default 5, Jordan's coefficients; ``"classic"`` coefficients converge to the exact
  ``P Q^T``); the other leaves, tables included, take the normalized step of Alg. 1 (grouped by
  variable as above).
* ``u_{-1} = v_{-1} = 0`` and ``g_{-1} = g_{-1}^(n) = 0`` (the boxes give no initialization).
* Under partial participation (``S < N``, outside the paper's analysis) ``g`` is the engine's
  SCAFFOLD-style running average over all clients' last ``g^(n)`` and the global momentum uses
  the mean ``g^(n)`` of the clients sampled this round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedorth.fed import update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import Corrections, FromState
from fedorth.fed.quantities import ClientReport, ServerQuantities
from fedorth.optim import federated as fed_optim
from fedorth.optim.minimax import (
    LabelFn,
    _by_label,
    _check_unit,
    ascend_dual,
    gradient_mean,
    make_label_fn,
    minimax_momentum,
    minimax_server_tx,
    scale_by_minimax_step,
    track_gradient_mean,
)

FED_MINIMAX = "Fed minimax (Zhang & Gao, heavy-tailed federated minimax)"


# ------------------------------------------------------------------------ server quantities


def _global_momentum_pieces(label_fn: LabelFn, beta_primal: float, beta_dual: float):
    """Alg. 1 line 12's global momentum: the ``init`` and ``update`` of its
    ``ServerQuantities`` and the ``ClientReport`` function they read (the client's ``g^(n)``)."""

    def init(params):
        return {"global_momentum": jax.tree.map(jnp.zeros_like, params)}

    def report(ctx, client):
        del ctx
        return {"gradient_mean": gradient_mean(client.opt_state[0])}

    def update(ctx, new, reports):
        del new
        old = ctx.server.extra["global_momentum"]
        betas = _by_label(label_fn, old, beta_primal, beta_dual)
        new = jax.tree.map(
            lambda m, g, b: (b * g + (1.0 - b) * m).astype(m.dtype),
            old,
            reports["gradient_mean"],
            betas,
        )
        return {"global_momentum": new}

    return init, report, update


def split_minimax_optim(optim: Mapping[str, Any], name: str, allowed: Mapping[str, tuple]):
    """Checks ``optim`` for a minimax algorithm: its name and the keys it may carry.

    The local step of these algorithms is fixed by their boxes; ``optim`` only provides the
    learning rate (``eta_x``) and, for Muon steps, the Newton-Schulz settings.

    Args:
      optim: the ``optim`` config section.
      name: the algorithm (for messages).
      allowed: optimizer names -> the hyperparameter keys each may carry.

    Returns:
      ``(optimizer name, hyperparameters)`` without ``learning_rate``/``schedule`` keys.
    """
    hp = dict(optim)
    opt = hp.pop("name", None)
    if opt not in allowed:
        raise ValueError(
            f"{name}: optim.name={opt!r}; the local step is fixed by the algorithm's box, "
            f"valid: {sorted(allowed)}."
        )
    for key in ("learning_rate", "schedule", "warmup_rounds", "final_lr_ratio", "step_rounds"):
        hp.pop(key, None)
    if float(hp.pop("weight_decay", 0.0) or 0.0) != 0.0:
        raise ValueError(
            f"{name}: optim.weight_decay must be 0 (Fed minimax (Zhang & Gao)'s boxes have no "
            "weight decay)."
        )
    if hp.get("ns_dtype") in (None, "auto"):  # configs/base.py's default: every step takes it
        hp.pop("ns_dtype", None)
    unknown = sorted(set(hp) - set(allowed[opt]))
    if unknown:
        raise ValueError(
            f"{name}: unknown optim keys {unknown} for optim.name={opt!r}; valid: "
            f"{sorted(allowed[opt])}."
        )
    return opt, hp


# --------------------------------------------------------------------------- the algorithms


def _nsgda_server(
    name: str,
    label_fn: LabelFn,
    server_lr: float | None,
    dual_server_lr: float | None,
    dual_lr_ratio: float,
) -> update.ServerUpdate:
    """Alg. 1 line 11's server step (``server_lr``), or plain averaging when it is ``None``."""
    if server_lr is None:
        if dual_server_lr is not None:
            raise ValueError(f"{name}: fed.options.dual_server_lr needs fed.options.server_lr.")
        # gamma/(eta p) = 1 on both variables: plain averaging, whatever the round's eta.
        rule, gx, gy, ratio_for_server = update.Mean(), 1.0, 1.0, 1.0
    else:
        # gamma_x, gamma_y are the server optimizer's; GlobalStep(1.0) divides by K eta_r.
        rule, gx = update.GlobalStep(1.0), server_lr
        gy = server_lr * dual_lr_ratio if dual_server_lr is None else dual_server_lr
        ratio_for_server = dual_lr_ratio
    return update.ServerUpdate(tx=minimax_server_tx(label_fn, gx, gy, ratio_for_server), rule=rule)


def fed_nsgda_family(
    optim: Mapping[str, Any],
    *,
    name: str,
    step: str,
    beta_x: float = 0.1,
    beta_y: float | None = None,
    dual_lr_ratio: float = 1.0,
    server_lr: float | None = None,
    dual_server_lr: float | None = None,
    norm_scope: str = "variable",
    tau: float = 0.1,
    dual_keys: Sequence[str] = ("dual",),
    ns_steps: int = 5,
    ns_coeffs: Any = "jordan",
) -> FedAlgorithm:
    r"""Fed minimax (Zhang & Gao) Alg. 1 with local step ``step`` (normalize / muon / clip); see
    the module docs.

    Args:
      optim: ``{"name": "sgd"}`` (``"muon"`` for FedMuon-DA, with ``ns_steps``/``ns_coeffs``),
        ``learning_rate`` = ``eta_x``.
      name: registry name.
      step: ``"normalize"`` (Fed-NSGDA-M), ``"muon"`` (FedMuon-DA), ``"clip"`` (FedSGDA-Clip).
      beta_x: momentum weight of the new corrected gradient for ``x`` (line 5), in (0, 1].
        Default 0.1: §5's "beta is fixed at 0.9" read as the usual momentum 0.9 on the old
        average, as for FedMuon (Zhang & Gao) (:mod:`fedorth.fed.algorithms.fedmuon_zg`).
      beta_y: the same for ``y`` (default ``beta_x``).
      dual_lr_ratio: ``eta_y / eta_x``.
      server_lr: ``gamma_x`` of line 11 (``x <- x + gamma_x/(eta_x p) mean(dx)``). ``None``
        (default): ``gamma_x = eta_x p`` and ``gamma_y = eta_y p``, i.e. the server averages
        the clients' models (``x <- x + mean(dx)``), which also follows lr schedules.
      dual_server_lr: ``gamma_y`` (default ``server_lr * dual_lr_ratio``, i.e. the same
        ``gamma/eta`` on both variables); only together with ``server_lr``.
      norm_scope: ``"variable"`` (one norm per variable, the box) or ``"leaf"``.
      tau: clipping threshold of FedSGDA-Clip (Sec. 5: 0.1).
      dual_keys: keys marking dual leaves (see :func:`minimax_labels`).
      ns_steps: Newton-Schulz steps of FedMuon-DA.
      ns_coeffs: Newton-Schulz coefficients of FedMuon-DA.
    """
    allowed = {"sgd": ()} if step != "muon" else {"muon": ("ns_steps", "ns_coeffs", "ns_dtype")}
    _, hp = split_minimax_optim(optim, name, allowed)
    ns_steps = int(hp.get("ns_steps", ns_steps))
    ns_coeffs = hp.get("ns_coeffs", ns_coeffs)
    if isinstance(ns_coeffs, list):
        ns_coeffs = tuple(tuple(c) if isinstance(c, list) else c for c in ns_coeffs)
    beta_y = beta_x if beta_y is None else beta_y
    label_fn = make_label_fn(dual_keys)
    tx = optax.chain(
        track_gradient_mean(),
        minimax_momentum(label_fn, beta_x, beta_y),
        scale_by_minimax_step(
            label_fn,
            step,
            norm_scope=norm_scope,
            tau=tau,
            ns_steps=ns_steps,
            ns_coeffs=ns_coeffs,
            ns_dtype=hp.get("ns_dtype"),
        ),
        ascend_dual(label_fn, dual_lr_ratio),
        fed_optim.scale_by_round_learning_rate(),
    )
    init, report, update_momentum = _global_momentum_pieces(
        label_fn, _check_unit("beta_x", beta_x), _check_unit("beta_y", beta_y)
    )
    server = _nsgda_server(name, label_fn, server_lr, dual_server_lr, dual_lr_ratio)
    return FedAlgorithm(
        name=name,
        local_tx=tx,
        corrections=Corrections(control=FromState(lambda opt_state: gradient_mean(opt_state[0]))),
        server=server,
        paper=f"{FED_MINIMAX} "
        + {"normalize": "Alg. 1", "muon": "Alg. 2/3", "clip": "Eq. 21"}[step],
        quantities=ServerQuantities(init, update_momentum),
        # g^(n) is reported once: it is the uploaded control variate (counted by the engine).
        report=ClientReport(report),
    )


def fed_nsgda_m(optim: Mapping[str, Any], **options) -> FedAlgorithm:
    """Fed-NSGDA-M (Fed minimax (Zhang & Gao) Alg. 1): normalized momentum steps with control
    variates."""
    return fed_nsgda_family(optim, name="fed_nsgda_m", step="normalize", **options)


def fedmuon_da(optim: Mapping[str, Any], **options) -> FedAlgorithm:
    """FedMuon-DA (Fed minimax (Zhang & Gao) Alg. 2/3): Muon's orthogonalized steps on matrix
    leaves of x and y."""
    return fed_nsgda_family(optim, name="fedmuon_da", step="muon", **options)


def fedsgda_clip(optim: Mapping[str, Any], **options) -> FedAlgorithm:
    """FedSGDA-Clip (Fed minimax (Zhang & Gao) Sec. 5, Eq. 21): Alg. 1 with the clipped step, tau =
    0.1."""
    return fed_nsgda_family(optim, name="fedsgda_clip", step="clip", **options)
