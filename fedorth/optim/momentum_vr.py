"""Client estimators of the momentum and variance-reduced FL baselines of FedMuon (Zhang & Gao).

The baselines of FedMuon (Zhang & Gao) (docs/PAPERS.md, Sec. 7: FedAvg-M/-VR and
SCAFFOLD-M/-VR of Cheng et al. 2024, PAdaMFed/-VR of Yan et al. 2025) move each client along a
mix of its stochastic gradient, a server-held momentum ``d`` and, for the SCAFFOLD family, the
control-variate correction ``c - c_i``:

* :func:`global_momentum` -- the client direction, with or without the STORM-type correction
  against the previous global model (the "-VR" variants);
* :func:`running_mean` -- the mean of the raw stochastic gradients of the round, kept in the
  optimizer state, from which the engine reads the new control variate
  ``c_i <- (1/K) sum_k grad F(x_i^{r,k}; xi)`` (Cheng et al. 2024, SCAFFOLD-M);
* :func:`normalize_by_global_norm` -- PAdaMFed's normalized local step ``v / ||v||``.

Server quantities arrive as keyword extra arguments (``GradientTransformationExtraArgs``): the
momentum ``d`` under the name given by ``direction`` (the engine's ``global_direction`` or an
algorithm's ``ServerState.extra`` entry), ``control_correction = c - c_i``, the previous global
model under the name given by ``anchor`` and ``obj_fn`` (the loss on the current mini-batch, so
that ``jax.grad(obj_fn)(anchor)`` is the gradient at the anchor on the same sample).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedorth.optim.federated import EmptyState

PyTree = Any


def _require(extra: dict, name: str, who: str) -> Any:
    value = extra.get(name)
    if value is None:
        raise ValueError(f"{who} needs the extra argument `{name}`.")
    return value


def global_momentum(
    beta: float,
    *,
    variance_reduction: bool = False,
    control_variate: bool = False,
    direction: str = "global_direction",
    anchor: str = "prev_params",
) -> optax.GradientTransformationExtraArgs:
    r"""Momentum against a server direction ``d``, optionally variance-reduced (FedMuon (Zhang &
    Gao) baselines).

    Without variance reduction (FedAvg-M, SCAFFOLD-M of Cheng et al. 2024; PAdaMFed):

    .. math:: u \leftarrow \beta (g + \kappa (c - c_i)) + (1 - \beta) d

    with variance reduction (FedAvg-VR, SCAFFOLD-VR; PAdaMFed-VR), a STORM-type recursion whose
    previous iterate is the previous global model ``x^{r-1}``:

    .. math:: u \leftarrow g - (1 - \beta) \nabla F(x^{r-1}; \xi) + (1 - \beta) d
              + \beta \kappa (c - c_i)

    where ``g = grad F(x; xi)`` is the incoming update (the stochastic gradient), ``kappa`` is 1
    with ``control_variate`` and 0 otherwise. With ``beta = 1`` both reduce to ``g`` (plus the
    SCAFFOLD correction).

    Args:
      beta: weight of the new stochastic gradient, in (0, 1].
      variance_reduction: use the STORM-type correction (needs ``obj_fn`` and the anchor).
      control_variate: add ``c - c_i`` (the extra argument ``control_correction``).
      direction: name of the extra argument holding ``d`` (``"global_direction"``: the
        engine's ``g_G = -mean_i(dx_i)/(K eta)``, Cheng et al.'s ``g^r``).
      anchor: name of the extra argument holding the previous global model ``x^{r-1}``.

    Returns:
      A stateless ``optax.GradientTransformationExtraArgs``.

    References:
      Cheng, Huang, Wu, Yuan, "Momentum Benefits Non-IID Federated Learning Simply and Provably",
      ICLR 2024 (arXiv:2306.16504); Yan, Zhang, Wang, Cao, "Problem-Parameter-Free Federated
      Learning", ICLR 2025; both baselines of FedMuon (Zhang & Gao) Sec. 7.
    """
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"global_momentum: beta={beta} must lie in (0, 1].")
    who = "global_momentum"

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params
        d = _require(extra, direction, who)
        if control_variate:
            cc = _require(extra, "control_correction", who)
        else:
            cc = jax.tree.map(jnp.zeros_like, updates)
        if variance_reduction:
            obj_fn = _require(extra, "obj_fn", who)
            x_prev = _require(extra, anchor, who)
            g_prev = jax.grad(obj_fn)(x_prev)
            out = jax.tree.map(
                lambda g, gp, dd, c: g - (1.0 - beta) * gp + (1.0 - beta) * dd + beta * c,
                updates,
                g_prev,
                d,
                cc,
            )
        else:
            out = jax.tree.map(lambda g, dd, c: beta * (g + c) + (1.0 - beta) * dd, updates, d, cc)
        out = jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates)
        return out, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class RunningMeanState(NamedTuple):
    """State of :func:`running_mean`."""

    count: jax.Array  # shape=(), int32: shared schedule counter (docs/CONTRACTS.md)
    mean: PyTree  # mean of the updates seen since init


def running_mean() -> optax.GradientTransformationExtraArgs:
    r"""Passes updates through unchanged and keeps their running mean in the state.

    .. math:: \bar g_k = \bar g_{k-1} + (g_k - \bar g_{k-1}) / k

    Placed first in a client's chain with a ``Reset()`` start, ``mean`` after the round is
    ``(1/K) sum_k grad F(x_i^{r,k}; xi)``, the new control variate ``c_i^{r+1}`` of SCAFFOLD-M
    (Cheng et al. 2024) and PAdaMFed; the engine reads it with
    ``Corrections(control=FromState(running_mean_of))`` (``fedorth.fed.corrections``).

    Returns:
      A transform with state :class:`RunningMeanState`.
    """

    def init_fn(params):
        return RunningMeanState(
            count=jnp.zeros([], jnp.int32), mean=jax.tree.map(jnp.zeros_like, params)
        )

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        count = optax.safe_increment(state.count)
        weight = 1.0 / count.astype(jnp.result_type(float))
        mean = jax.tree.map(
            lambda m, g: m + weight.astype(m.dtype) * (g.astype(m.dtype) - m),
            state.mean,
            updates,
        )
        return updates, RunningMeanState(count=count, mean=mean)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class RoundMeanState(NamedTuple):
    """State of :func:`round_mean`."""

    count: jax.Array  # shape=(), int32: updates seen in the current round
    mean: PyTree  # mean of the updates seen in the current round
    round: jax.Array  # shape=(), int32: the round ``mean`` belongs to


def round_mean(round_key: str) -> optax.GradientTransformationExtraArgs:
    r"""Passes updates through unchanged; keeps their mean over the current round.

    Like :func:`running_mean`, but the mean restarts whenever the extra argument ``round_key``
    (a round counter the server sends down) differs from the round the state last saw, so that
    it is the mean of *this* round's updates even inside a state the client keeps between
    rounds (a ``Persistent()`` start: a client's momentum persists, its gradient mean must
    not). Used by SCAFFOLD with a stateful local optimizer
    (:func:`fedorth.fed.algorithms.scaffold.scaffold`).

    Args:
      round_key: name of the extra argument holding the round counter (an int32 scalar).

    Returns:
      A transform with state :class:`RoundMeanState`.
    """
    who = "round_mean"

    def init_fn(params):
        return RoundMeanState(
            count=jnp.zeros([], jnp.int32),
            mean=jax.tree.map(jnp.zeros_like, params),
            round=jnp.full([], -1, jnp.int32),
        )

    def update_fn(updates, state, params=None, **extra):
        del params
        now = jnp.asarray(_require(extra, round_key, who), jnp.int32)
        fresh = state.round != now
        count = jnp.where(fresh, 1, state.count + 1).astype(jnp.int32)
        weight = 1.0 / count.astype(jnp.result_type(float))
        mean = jax.tree.map(
            lambda m, g: jnp.where(
                fresh, g.astype(m.dtype), m + weight.astype(m.dtype) * (g.astype(m.dtype) - m)
            ),
            state.mean,
            updates,
        )
        return updates, RoundMeanState(count=count, mean=mean, round=now)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def normalize_by_global_norm(eps: float = 1e-12) -> optax.GradientTransformationExtraArgs:
    r"""Normalizes the updates by their global Euclidean norm: ``u <- u / max(||u||_2, eps)``.

    PAdaMFed's local step ``x <- x - eta v / ||v||`` (Yan et al. 2025, Alg. 1 line 8); the norm
    is over all leaves together (the whole parameter vector). ``eps`` only guards ``u = 0``.

    Args:
      eps: floor of the norm, > 0.

    Returns:
      A stateless transform.
    """
    if not eps > 0:
        raise ValueError(f"normalize_by_global_norm: eps={eps} must be > 0.")

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        norm = optax.global_norm(updates)
        scale = 1.0 / jnp.maximum(norm, eps)
        return jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_adam_uncorrected(
    b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3
) -> optax.GradientTransformation:
    r"""Adam's direction without bias correction: ``m / (sqrt(v) + eps)``.

    .. math::
        m \leftarrow b_1 m + (1 - b_1) g, \quad v \leftarrow b_2 v + (1 - b_2) g^2, \quad
        u = m / (\sqrt{v} + \epsilon)

    with ``m = v = 0`` at ``init``. This is the server Adam of FedAdam (Reddi et al. 2021,
    "Adaptive Federated Optimization", Alg. 2, with ``eps = tau``), which writes no bias
    correction, as Flower's ``FedAdam`` strategy does (adap/flower,
    ``src/py/flwr/server/strategy/fedadam.py``); and FedLADA's local Adam in the FedMuon
    (Liu et al.) authors' released code, where PyTorch's Adam starts each round at step
    10^6, so that both correction factors are 1 (junkangLiu0/FedAdamW, ``main_FedAdamW.py``,
    ``update_FedLADA``). ``optax.scale_by_adam`` divides ``m`` by ``1 - b1^t`` and ``v`` by
    ``1 - b2^t``, which multiplies the step by ``sqrt(1 - b2^t) / (1 - b1^t)``: with b1 = 0.9,
    b2 = 0.99 that is 1 at t = 1, 0.54 at t = 5, 0.47 at t = 13 and 0.80 at t = 100, so the
    uncorrected step is up to 2.1 times the corrected one (for ``eps`` small against
    ``sqrt(v)``).

    The state is ``optax.ScaleByAdamState`` (``count`` counts the updates), so masks written for
    optax's Adam (FedLADA's ``adam_second_moment_mask``) apply unchanged.

    Args:
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to ``sqrt(v)``, > 0 (FedAdam's ``tau``).

    Returns:
      An ``optax.GradientTransformation``.
    """
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"scale_by_adam_uncorrected: b1={b1}, b2={b2} must lie in [0, 1).")
    if not eps > 0:
        raise ValueError(f"scale_by_adam_uncorrected: eps={eps} must be > 0.")
    return _uncorrected_moments(lambda v, g: b2 * v + (1.0 - b2) * g * g, b1, eps)


def _uncorrected_moments(second_moment, b1: float, eps: float) -> optax.GradientTransformation:
    """``m / (sqrt(v) + eps)`` with ``m <- b1 m + (1 - b1) g``, ``v <- second_moment(v, g)``,
    ``m = v = 0`` at ``init``, no bias correction; the state an ``optax.ScaleByAdamState``."""

    def init_fn(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

    def update_fn(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, updates)
        nu = jax.tree.map(second_moment, state.nu, updates)
        out = jax.tree.map(
            lambda m, v, g: (m / (jnp.sqrt(v) + eps)).astype(g.dtype), mu, nu, updates
        )
        return out, optax.ScaleByAdamState(count=optax.safe_increment(state.count), mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_reddi_adaptive(
    second_moment: str, b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3
) -> optax.GradientTransformation:
    r"""The server direction of FedAdagrad and FedYogi (Reddi et al. 2021, "Adaptive Federated
    Optimization", Alg. 2), without bias correction: ``m / (sqrt(v) + eps)`` with

    .. math::
        m \leftarrow b_1 m + (1 - b_1) g, \quad
        v \leftarrow v + g^2 \ \text{(Adagrad)}, \quad
        v \leftarrow v - (1 - b_2) g^2 \operatorname{sign}(v - g^2) \ \text{(Yogi)}

    Alg. 2 writes the first moment ``m`` for all three server optimizers and ``Delta`` where
    fedorth has the pseudo-gradient ``g = -Delta``; ``m`` changes sign with ``g`` and ``v``
    does not, so ``x <- x - lr m / (sqrt(v) + eps)`` here is Alg. 2's ``x <- x + lr m_Delta /
    (sqrt(v) + tau)``. Alg. 2 initializes ``v_{-1} >= tau^2``; ``v = 0`` here, as in
    :func:`scale_by_adam_uncorrected` (FedAdam) and Flower's strategies: Yogi's first ``v`` is
    then ``(1 - b2) g^2`` (``sign(0 - g^2) = -1``), Adam's. ``optax.scale_by_yogi`` corrects the
    bias and starts ``m`` and ``v`` at 1e-6, so it is not Alg. 2's.

    Args:
      second_moment: ``"adagrad"`` or ``"yogi"`` (Adam's is :func:`scale_by_adam_uncorrected`).
      b1: decay of the first moment, in [0, 1).
      b2: Yogi's decay of the second moment, in [0, 1) (Adagrad has none).
      eps: added to ``sqrt(v)``, > 0 (Alg. 2's ``tau``).

    Returns:
      An ``optax.GradientTransformation`` whose state is an ``optax.ScaleByAdamState``.
    """
    rules = {
        "adagrad": lambda v, g: v + g * g,
        "yogi": lambda v, g: v - (1.0 - b2) * (g * g) * jnp.sign(v - g * g),
    }
    if second_moment not in rules:
        raise ValueError(
            f"scale_by_reddi_adaptive: second_moment={second_moment!r}; valid: {tuple(rules)}."
        )
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"scale_by_reddi_adaptive: b1={b1}, b2={b2} must lie in [0, 1).")
    if not eps > 0:
        raise ValueError(f"scale_by_reddi_adaptive: eps={eps} must be > 0.")
    return _uncorrected_moments(rules[second_moment], b1, eps)
