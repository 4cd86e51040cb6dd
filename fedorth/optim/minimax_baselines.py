r"""Optax transforms of the federated minimax baselines of Fed minimax (Zhang & Gao) Sec. 5.

Per-variable momentum (LocalSGDAM, Sharma et al. 2022), the STORM estimator of FedSGDA-M (Wu et
al. 2023), SAGDA's sampled control variate (Yang et al. 2022a) and FESS-GDA's smoothing toward
the server's anchor (Shen et al. 2024). :mod:`fedorth.fed.algorithms.minimax_baselines` builds
the algorithms from them and says what is read from each paper and which choices are ours.
Primal and dual leaves are told apart as in :mod:`fedorth.optim.minimax`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedorth.optim import federated as fed_optim
from fedorth.optim.minimax import _by_label, _check_unit

PyTree = Any


class MomentumState(NamedTuple):
    """State of :func:`variable_momentum`."""

    count: jax.Array  # shape=(), int32: shared schedule counter (steps since the start)
    momentum: PyTree


def variable_momentum(
    label_fn, beta_primal: float, beta_dual: float
) -> optax.GradientTransformationExtraArgs:
    r"""Per-variable momentum ``d <- (1 - beta) d + beta g`` with ``d_0 = g_0``.

    Sharma et al. 2022's momentum Local SGDA: ``beta_x`` on primal, ``beta_y`` on dual leaves
    (weights of the new stochastic gradient, Fed minimax (Zhang & Gao)'s convention for ``beta``).
    """
    bx = _check_unit("beta_x", beta_primal)
    by = _check_unit("beta_y", beta_dual)

    def init_fn(params):
        return MomentumState(
            count=jnp.zeros([], jnp.int32), momentum=jax.tree.map(jnp.zeros_like, params)
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        betas = _by_label(label_fn, updates, bx, by)
        first = state.count == 0
        new = jax.tree.map(
            lambda d, g, b: jnp.where(first, g, (1.0 - b) * d + b * g).astype(g.dtype),
            state.momentum,
            updates,
            betas,
        )
        return new, MomentumState(count=optax.safe_increment(state.count), momentum=new)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class StormState(NamedTuple):
    """State of :func:`storm_estimator`."""

    count: jax.Array  # shape=(), int32: shared counter of all local steps (aggregated)
    local_count: jax.Array  # shape=(), int32: local steps this round (restarted each round)
    estimate: PyTree  # the STORM estimator v (aggregated)
    previous: PyTree  # the iterate of the previous local step (restarted: round start)


def storm_estimator(label_fn, alpha_primal: float, alpha_dual: float):
    r"""STORM gradient estimator (Cutkosky & Orabona 2019) of FedSGDA-M (Wu et al. 2023).

    .. math:: v_k = \nabla f(x_k; \xi_k) + (1 - \alpha)(v_{k-1} - \nabla f(x_{k-1}; \xi_k))

    ``grad f(x_{k-1}; xi_k)`` is the gradient of the engine's ``obj_fn`` (this step's batch) at
    the stored previous iterate. At the first step of a round the (server-averaged) estimator is
    used as it is; at the very first step ``v_0 = grad f(x_0; xi_0)``. ``alpha`` in (0, 1] is the
    weight of the new gradient (``alpha = 1``: SGD).
    """
    ax = _check_unit("alpha_x", alpha_primal)
    ay = _check_unit("alpha_y", alpha_dual)

    def init_fn(params):
        return StormState(
            count=jnp.zeros([], jnp.int32),
            local_count=jnp.zeros([], jnp.int32),
            estimate=jax.tree.map(jnp.zeros_like, params),
            previous=jax.tree.map(jnp.copy, params),
        )

    def update_fn(updates, state, params=None, *, obj_fn=None, **extra_args):
        del extra_args
        if obj_fn is None or params is None:
            raise ValueError("storm_estimator needs params and the extra argument `obj_fn`.")
        previous_grads = jax.grad(obj_fn)(state.previous)
        alphas = _by_label(label_fn, updates, ax, ay)
        first_ever = state.count == 0
        round_start = state.local_count == 0

        def one(v, g, g_prev, a):
            storm = g + (1.0 - a) * (v - g_prev.astype(g.dtype))
            return jnp.where(first_ever, g, jnp.where(round_start, v, storm)).astype(g.dtype)

        estimate = jax.tree.map(one, state.estimate, updates, previous_grads, alphas)
        new_state = StormState(
            count=optax.safe_increment(state.count),
            local_count=optax.safe_increment(state.local_count),
            estimate=estimate,
            previous=jax.tree.map(jnp.copy, params),
        )
        return estimate, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


SAMPLED_GRADIENT = "sampled_gradient"


def sampled_control_variate(name: str = SAMPLED_GRADIENT) -> optax.GradientTransformationExtraArgs:
    r"""SAGDA's local direction: the gradient corrected by the round's sampled gradients.

    .. math:: d = \nabla f_i(x, y; \xi) - q_i + v, \qquad
              v = \frac{1}{|S_t|} \sum_{j \in S_t} q_j

    ``q_i`` is client ``i``'s stochastic gradient at the server point (extra argument ``name``,
    from the engine's pre-pass, ``fedorth.fed.corrections.Prepass``) and ``v`` its mean over the
    round's sampled clients (extra argument ``name + "_mean"``); Yang et al. 2022a (SAGDA), as
    :mod:`fedorth.fed.algorithms.minimax_baselines` describes it.
    """

    def update_fn(updates, state, params=None, **extra_args):
        del params
        own, mean = extra_args.get(name), extra_args.get(f"{name}_mean")
        if own is None or mean is None:
            raise ValueError(
                f"sampled_control_variate needs the extra arguments `{name}` and `{name}_mean` "
                "(fedorth.fed.corrections.Prepass)."
            )
        out = jax.tree.map(
            lambda g, q, v: (g - q.astype(g.dtype) + v.astype(g.dtype)).astype(g.dtype),
            updates,
            own,
            mean,
        )
        return out, state

    return optax.GradientTransformationExtraArgs(lambda p: fed_optim.EmptyState(), update_fn)


def smooth_toward_anchor(label_fn, penalty: float) -> optax.GradientTransformationExtraArgs:
    r"""Adds the smoothing gradient ``p (x - z)`` on primal leaves (dual leaves unchanged).

    .. math:: g_x \leftarrow g_x + p (x - z)

    ``z`` is the server's anchor (extra argument ``smoothing_anchor``), the gradient of the
    Smoothed-AGDA surrogate ``f + (p/2)||x - z||^2`` (FESS-GDA, Shen et al. 2024).
    """
    if not penalty >= 0:
        raise ValueError(f"fed.options.penalty={penalty} must be >= 0.")

    def update_fn(updates, state, params=None, *, smoothing_anchor=None, **extra_args):
        del extra_args
        if smoothing_anchor is None or params is None:
            raise ValueError("smooth_toward_anchor needs params and `smoothing_anchor`.")
        on = _by_label(label_fn, updates, float(penalty), 0.0)
        out = jax.tree.map(
            lambda g, x, z, p: (g + p * (x - z.astype(x.dtype))).astype(g.dtype),
            updates,
            params,
            smoothing_anchor,
            on,
        )
        return out, state

    return optax.GradientTransformationExtraArgs(lambda p: fed_optim.EmptyState(), update_fn)


class _CountState(NamedTuple):
    count: jax.Array  # shape=(), int32: local steps of the round


def _count_steps() -> optax.GradientTransformation:
    """Passes updates through; counts the round's local steps (state reset every round)."""
    return optax.GradientTransformation(
        lambda params: _CountState(count=jnp.zeros([], jnp.int32)),
        lambda updates, state, params=None: (updates, _CountState(state.count + 1)),
    )
