"""FedMuon (Zhang & Gao)'s local step: step with ``dir(M)``, then update ``M`` at the new point.

Zhang & Gao, "On Provable Benefits of Muon in Federated Learning", Alg. 1, lines 3-5: the
momentum ``M`` is updated with the gradient at the point just reached, so :func:`zg_muon_step`
takes that gradient itself (``jax.grad(obj_fn)``) on the step's mini-batch.
:mod:`fedorth.fed.algorithms.fedmuon_zg` builds the algorithm from it and gives the reasons for
its choices (the reading of ``beta``, the mask, weight decay).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedorth.optim import federated as fed_optim


def zg_muon_step(
    beta: float, direction: optax.GradientTransformation, *, weight_decay: float = 0.0
) -> optax.GradientTransformationExtraArgs:
    r"""One iteration of FedMuon (Zhang & Gao) Alg. 1, lines 3-5, with the learning rate.

    .. math::
        X_{k+1} = X_k - \eta_r (\mathrm{dir}(M_k) + \lambda X_k), \qquad
        M_{k+1} = (1 - \beta) M_k + \beta \nabla f(X_{k+1}; \xi_k)

    with ``M_0 = g`` (the incoming gradient at ``X_0``) on the state's first update.

    Args:
      beta: weight of the new gradient, in (0, 1].
      direction: a transform giving ``dir(M)`` from a fresh state (``UV^T`` on Muon's matrices,
        ``m / ||m||_F`` on the other leaves).
      weight_decay: decoupled ``lambda >= 0``.

    Returns:
      A transform whose ``update`` takes the extra arguments ``obj_fn`` (the loss on the step's
      mini-batch) and ``learning_rate``; its state is :class:`fedorth.optim.federated.EmaState`
      (``mu`` = ``M``; ``count`` = updates so far, a shared counter).
    """
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"fed.options.beta={beta} must lie in (0, 1].")

    def init_fn(params):
        return fed_optim.EmaState(
            count=jnp.zeros([], jnp.int32), mu=jax.tree.map(jnp.zeros_like, params)
        )

    def update_fn(updates, state, params=None, *, obj_fn=None, learning_rate=None, **extra):
        del extra
        if obj_fn is None or learning_rate is None or params is None:
            raise ValueError("zg_muon_step needs params and the extra args obj_fn, learning_rate.")
        # Line 1 on the run's first step; afterwards M already holds the gradient at X_k. The
        # gradient for M_0 is recomputed inside the branch so that the engine's gradient is
        # otherwise unused.
        momentum = jax.lax.cond(
            state.count == 0,
            lambda: jax.tree.map(
                lambda g, m: g.astype(m.dtype), jax.grad(obj_fn)(params), state.mu
            ),
            lambda: state.mu,
        )
        d, _ = direction.update(momentum, direction.init(params))
        step = jax.tree.map(
            lambda u, p: (-learning_rate * (u + weight_decay * p)).astype(p.dtype), d, params
        )
        new_grad = jax.grad(obj_fn)(optax.apply_updates(params, step))
        mu = jax.tree.map(
            lambda m, g: ((1.0 - beta) * m + beta * g).astype(m.dtype), momentum, new_grad
        )
        del updates
        return step, fed_optim.EmaState(count=optax.safe_increment(state.count), mu=mu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
