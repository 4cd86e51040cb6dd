"""FedNova's local side (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization"): clients that run different numbers of local steps.

:func:`first_steps` runs the local optimizer for the first ``tau_i`` of the round's ``K`` steps
and leaves the parameters and the optimizer's state as they are for the rest: client ``i``'s
``tau_i`` is drawn uniformly from ``{min(min_steps, K), ..., K}`` with its step-0 optimizer key (a
different draw per client and round, the same under every execution strategy), as FedNova's
experiments draw each client's local epochs every round (Sec. 7). :func:`momentum_a_norm` is
``||a_i||_1`` of the paper's Eq. (3)-(4) for momentum SGD.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


class FirstStepsState(NamedTuple):
    """``count``: the steps taken this round; ``steps``: the client's ``tau_i``; ``inner``."""

    count: jax.Array
    steps: jax.Array
    inner: PyTree


def draw_steps(step0_key: jax.Array, min_steps: int, local_steps: int) -> jax.Array:
    """``tau_i``, uniform in ``{min_steps, ..., local_steps}``, from client ``i``'s step-0
    optimizer key."""
    return jax.random.randint(
        jax.random.fold_in(step0_key, 0), (), min_steps, local_steps + 1, dtype=jnp.int32
    )


def first_steps(
    inner: optax.GradientTransformationExtraArgs, min_steps: int
) -> optax.GradientTransformationExtraArgs:
    """``inner`` for the client's first ``tau_i`` steps, then zero updates with ``inner``'s
    state frozen (module docstring). Takes the extra arguments ``key`` and ``round_context``."""

    def init_fn(params):
        zero = jnp.zeros([], jnp.int32)
        return FirstStepsState(count=zero, steps=zero, inner=inner.init(params))

    def update_fn(updates, state, params=None, *, key=None, round_context=None, **extra):
        if key is None or round_context is None:
            raise ValueError("first_steps needs the extra arguments `key` and `round_context`.")
        k = round_context.local_steps
        drawn = draw_steps(key, min(min_steps, k), k)
        steps = jnp.where(state.count == 0, drawn, state.steps)
        new, inner_state = inner.update(
            updates, state.inner, params, key=key, round_context=round_context, **extra
        )
        active = state.count < steps
        out = jax.tree.map(lambda u: jnp.where(active, u, jnp.zeros_like(u)), new)
        inner_state = jax.tree.map(lambda a, b: jnp.where(active, a, b), inner_state, state.inner)
        return out, FirstStepsState(count=state.count + 1, steps=steps, inner=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def momentum_a_norm(steps: jax.Array, momentum: float) -> jax.Array:
    """``||a_i||_1`` for ``tau_i = steps`` heavy-ball steps (``v <- rho v + g``, ``x <- x - eta
    v``): ``a_i = [1 - rho^tau, 1 - rho^(tau-1), ..., 1 - rho] / (1 - rho)`` (Wang et al. 2020,
    Sec. 4 / Eq. (4)), so ``||a_i||_1 = sum_{j=1}^{tau} (1 - rho^j) / (1 - rho)``; ``tau_i``
    for plain SGD (``rho = 0``)."""
    steps = jnp.asarray(steps).astype(jnp.result_type(float))
    if not momentum:
        return steps
    rho = momentum
    # sum_{j=1}^{tau} rho^j = rho (1 - rho^tau) / (1 - rho)
    return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)
