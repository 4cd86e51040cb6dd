"""One compilation for a run's set-up that computes, bit for bit, what op-by-op dispatch computes.

A run's set-up (its keys, the model's initial parameters, the server state) is many small
operations. Dispatched one by one, each compiles on its own: about 45 compilations before the
first round of the main job, 1.5 s on 2 CPU cores. One ``jax.jit`` of the whole set-up compiles
once, but XLA then simplifies across operations, which changes the last bits of some initial
parameters: ``normal(key) * 0.02`` (a ViT's class token) is ``erf_inv(u) * sqrt(2) * 0.02``,
whose two constant factors XLA folds into one product, rounded differently. A run would then not
reproduce the runs made before with the same seed.

:func:`jit_op_by_op` compiles the whole function once while keeping every operation's floating
point results apart from the next (``lax.optimization_barrier``), so that XLA can neither fuse
nor reassociate across them: each operation computes what its own compilation computes. A
nested ``jit`` (``jax.random.normal``'s, say) stays whole inside, as it is dispatched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core


def _apart(values: list[Any]) -> list[Any]:
    """``values`` with their floating-point arrays behind one optimization barrier."""
    floats = [i for i, v in enumerate(values) if jnp.issubdtype(v.dtype, jnp.floating)]
    if not floats:
        return values
    kept = jax.lax.optimization_barrier([values[i] for i in floats])
    values = list(values)
    for i, value in zip(floats, kept, strict=True):
        values[i] = value
    return values


def _evaluate(jaxpr, consts, args) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v):
        if isinstance(v, jax_core.Literal):  # a value dispatch passes in, not a constant to fold
            return _apart([jnp.asarray(v.val, v.aval.dtype)])[0]
        return env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        with eqn.ctx.manager:
            out = eqn.primitive.bind(
                *map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params)
            )
        out = _apart(list(out) if eqn.primitive.multiple_results else [out])
        env.update(zip(eqn.outvars, out, strict=True))
    return [read(v) for v in jaxpr.outvars]


def jit_op_by_op(fn: Callable) -> Callable:
    """``fn`` compiled as one program that computes what ``fn`` computes op by op, bit for bit.

    For set-up code that runs once: the program is traced and compiled at each call.

    Args:
      fn: a function of arrays (or Python scalars) returning a pytree of arrays.

    Returns:
      A function with ``fn``'s arguments and results.
    """

    def call(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)

        def program(consts, leaves):
            return _evaluate(closed.jaxpr, consts, leaves)

        program.__name__ = getattr(fn, "__name__", "program")  # the name compilation logs show
        flat = jax.jit(program)(closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return call
