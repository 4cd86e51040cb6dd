"""The shared battery every fedorth optimizer passes (STYLE.md item 9).

Each `check_*` helper takes a transform (or a factory) and small inputs, and asserts one property
with a message saying what broke. Used by test_muon.py; SOAP/Sophia tests reuse it. Transforms
whose `update` needs extra keyword arguments (Sophia's `obj_fn`) pass `extra_args_fn`, a callable
`loss_fn -> dict` of those arguments (the loss the gradients come from).

Test problems (matrix-shaped, so that Muon's orthogonalization is exercised):
- `matrix_quadratic`: f(W) = ½‖W − W*‖_F², minimum 0 at W*.
- `matrix_rosenbrock`: the chained Rosenbrock function along each row of W,
  f(W) = Σ_ij [(1 − W_ij)² + 100 (W_{i,j+1} − W_ij²)²], minimum 0 at W = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import fast_jit

ExtraArgsFn = Callable[[Callable], dict] | None


def _extra(extra_args_fn: ExtraArgsFn, loss_fn: Callable | None) -> dict:
    return {} if extra_args_fn is None else extra_args_fn(loss_fn)


def _assert_trees_close(actual, expected, *, rtol, atol, what):
    actual_leaves, actual_def = jax.tree.flatten(actual)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert actual_def == expected_def, (
        f"{what}: tree structures differ: {actual_def} vs {expected_def}"
    )
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves, strict=True)):
        np.testing.assert_allclose(
            np.asarray(a, np.float64),
            np.asarray(e, np.float64),
            rtol=rtol,
            atol=atol,
            err_msg=f"{what}: leaf {i} differs",
        )


def matrix_quadratic(key: jax.Array, shapes: dict[str, tuple[int, ...]]):
    """f(params) = ½ Σ_leaves ‖W − W*‖_F²; returns (loss_fn, params0 = 0, optimum W*)."""
    keys = jax.random.split(key, len(shapes))
    target = {
        name: jax.random.normal(k, shape)
        for (name, shape), k in zip(shapes.items(), keys, strict=True)
    }

    def loss_fn(params):
        return 0.5 * sum(jnp.sum(jnp.square(params[n] - target[n])) for n in target)

    params0 = {n: jnp.zeros(s) for n, s in shapes.items()}
    return loss_fn, params0, target


def matrix_rosenbrock(shape: tuple[int, int], start: float = -0.5):
    """Row-wise chained Rosenbrock on an (m, n) matrix; returns (loss_fn, params0 = start)."""

    def loss_fn(params):
        w = params["w"]
        return jnp.sum(jnp.square(1.0 - w)) + 100.0 * jnp.sum(
            jnp.square(w[:, 1:] - jnp.square(w[:, :-1]))
        )

    return loss_fn, {"w": jnp.full(shape, start, jnp.float32)}


def run_steps(
    tx: optax.GradientTransformation,
    loss_fn: Callable,
    params: Any,
    steps: int,
    *,
    extra_args_fn: ExtraArgsFn = None,
):
    """Runs `steps` jitted optimizer steps in a `lax.scan`; returns (params, losses [steps])."""
    extra = _extra(extra_args_fn, loss_fn)

    def body(carry, _):
        p, s = carry
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = tx.update(g, s, p, **extra)
        return (optax.apply_updates(p, u), s), loss

    @fast_jit
    def run(p):
        (p, _), losses = jax.lax.scan(body, (p, tx.init(p)), None, length=steps)
        return p, losses

    return run(params)


def check_converges(
    tx, loss_fn, params, *, steps: int, threshold: float, extra_args_fn: ExtraArgsFn = None
) -> float:
    """Asserts the final loss after `steps` steps is finite and below `threshold`; returns it."""
    params, losses = run_steps(tx, loss_fn, params, steps, extra_args_fn=extra_args_fn)
    final = float(loss_fn(params))
    assert np.all(np.isfinite(np.asarray(losses))), "loss became non-finite"
    assert final < threshold, (
        f"did not converge: loss {float(losses[0]):.4g} -> {final:.4g} after {steps} steps, "
        f"threshold {threshold}"
    )
    return final


class JitUpdate:
    """``fast_jit(tx.update)`` (with the extra arguments), counting its traces: the battery's
    checks share one compiled update instead of compiling the same program once each."""

    def __init__(self, tx, extra: dict):
        self.traces = 0

        def update(g, s, p):
            self.traces += 1
            return tx.update(g, s, p, **extra)

        self.fn = fast_jit(update)

    def __call__(self, g, s, p):
        return self.fn(g, s, p)


def _update_jit(tx, extra, update_jit: JitUpdate | None) -> JitUpdate:
    return JitUpdate(tx, extra) if update_jit is None else update_jit


def check_jit(
    tx,
    params,
    grads_seq: Sequence[Any],
    *,
    extra_args_fn=None,
    loss_fn=None,
    rtol=1e-5,
    atol=1e-6,
    update_jit: JitUpdate | None = None,
):
    """jit(update) runs, is finite, and equals the eager update over `grads_seq`."""
    extra = _extra(extra_args_fn, loss_fn)
    update_jit = _update_jit(tx, extra, update_jit)
    s_eager = s_jit = tx.init(params)
    for t, g in enumerate(grads_seq):
        u_eager, s_eager = tx.update(g, s_eager, params, **extra)
        u_jit, s_jit = update_jit(g, s_jit, params)
        for leaf in jax.tree.leaves(u_jit):
            assert np.all(np.isfinite(np.asarray(leaf, np.float64))), (
                f"non-finite update at step {t}"
            )
        _assert_trees_close(u_jit, u_eager, rtol=rtol, atol=atol, what=f"jit vs eager step {t}")


def check_shapes_dtypes(
    tx, params, grads_seq, *, extra_args_fn=None, loss_fn=None, update_jit: JitUpdate | None = None
):
    """Updates keep each gradient leaf's shape and dtype; the state keeps structure/shape/dtype."""
    extra = _extra(extra_args_fn, loss_fn)
    state = tx.init(params)
    spec = lambda tree: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)
    state_spec = spec(state)
    update_jit = _update_jit(tx, extra, update_jit)
    for t, g in enumerate(grads_seq):
        u, state = update_jit(g, state, params)
        assert spec(u) == spec(g), f"step {t}: update shapes/dtypes {spec(u)} != grads {spec(g)}"
        assert spec(state) == state_spec, (
            f"step {t}: state changed shape/dtype (breaks lax.scan carries): "
            f"{spec(state)} != {state_spec}"
        )


def check_no_recompile(
    tx, params, grads_seq, *, extra_args_fn=None, loss_fn=None, update_jit: JitUpdate | None = None
):
    """A jitted update traces once: later calls, fed the previous state, hit the cache. With a
    shared ``update_jit``, once over all the calls it served (all fed these shapes)."""
    extra = _extra(extra_args_fn, loss_fn)
    update_jit = _update_jit(tx, extra, update_jit)
    state = tx.init(params)
    for g in grads_seq:
        _, state = update_jit(g, state, params)
    assert len(grads_seq) >= 2, "give at least two gradients"
    assert update_jit.traces == 1, (
        f"update was traced {update_jit.traces} times for {len(grads_seq)} calls (retracing)"
    )


def _state_axes(state):
    # Scalar integer leaves are schedule counters, shared across clients (docs/CONTRACTS.md).
    return jax.tree.map(
        lambda x: (
            None if (jnp.ndim(x) == 0 and jnp.issubdtype(jnp.result_type(x), jnp.integer)) else 0
        ),
        state,
    )


def check_vmap_matches_loop(
    tx,
    params_C,
    grads_seq_C: Sequence[Any],
    *,
    shared_counters: bool = False,
    extra_args_fn=None,
    loss_fn=None,
    rtol=1e-5,
    atol=1e-6,
    update_jit: JitUpdate | None = None,
):
    """`jax.vmap(tx.init)`/`jax.vmap(tx.update)` over a leading client axis equals a loop.

    With `shared_counters=True` the scalar integer state leaves are vmapped with
    `in_axes=None`/`out_axes=None`, as the federated engine does; this also asserts they are
    computed from counters only (an update that made them depend on gradients would fail).
    """
    extra = _extra(extra_args_fn, loss_fn)
    num_clients = jax.tree.leaves(params_C)[0].shape[0]
    client = lambda tree, c: jax.tree.map(lambda x: x[c], tree)

    # The loop runs one client at a time through a jitted (unbatched) update.
    update_one = _update_jit(tx, extra, update_jit)
    looped = []
    for c in range(num_clients):
        p = client(params_C, c)
        s = tx.init(p)
        us = []
        for g_C in grads_seq_C:
            u, s = update_one(client(g_C, c), s, p)
            p = optax.apply_updates(p, u)
            us.append(u)
        looped.append((us, p))

    if shared_counters:
        axes = _state_axes(tx.init(client(params_C, 0)))
        init = jax.vmap(tx.init, out_axes=axes)
        update = jax.vmap(
            lambda g, s, p: tx.update(g, s, p, **extra), in_axes=(0, axes, 0), out_axes=(0, axes)
        )
    else:
        init = jax.vmap(tx.init)
        update = jax.vmap(lambda g, s, p: tx.update(g, s, p, **extra))
    init, update = fast_jit(init), fast_jit(update)
    p_C = params_C
    s_C = init(p_C)
    for t, g_C in enumerate(grads_seq_C):
        u_C, s_C = update(g_C, s_C, p_C)
        p_C = optax.apply_updates(p_C, u_C)
        for c in range(num_clients):
            _assert_trees_close(
                client(u_C, c),
                looped[c][0][t],
                rtol=rtol,
                atol=atol,
                what=f"vmap vs loop, client {c} step {t}",
            )


def check_clip_chain(
    tx,
    params,
    grads_seq,
    *,
    max_norm=0.5,
    extra_args_fn=None,
    loss_fn=None,
    rtol=1e-5,
    atol=1e-6,
    update_jit: JitUpdate | None = None,
):
    """`chain(clip_by_global_norm(c), tx)` equals `tx` fed the clipped gradients.

    The chain runs eagerly (op by op: the ops of `tx` are those `check_jit` already ran at these
    shapes, so no new program of the whole update is compiled) against the jitted `tx`; jit ==
    eager is `check_jit`'s assertion."""
    extra = _extra(extra_args_fn, loss_fn)
    chained = optax.chain(optax.clip_by_global_norm(max_norm), tx)
    s_chain, s_ref = chained.init(params), tx.init(params)
    update_ref = _update_jit(tx, extra, update_jit)
    for t, g in enumerate(grads_seq):
        norm = np.sqrt(
            sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(g))
        )
        scale = np.float32(min(1.0, max_norm / norm))
        clipped = jax.tree.map(lambda x: (np.asarray(x) * scale).astype(x.dtype), g)
        u_chain, s_chain = chained.update(g, s_chain, params, **extra)
        u_ref, s_ref = update_ref(clipped, s_ref, params)
        _assert_trees_close(u_chain, u_ref, rtol=rtol, atol=atol, what=f"clip chain step {t}")


def check_inject_hyperparams(
    factory: Callable[..., optax.GradientTransformation],
    kwargs: dict,
    params,
    grads_seq,
    *,
    static_args: Sequence[str] = (),
    extra_args_fn=None,
    loss_fn=None,
    rtol=1e-5,
    atol=1e-6,
):
    """`optax.inject_hyperparams(factory)(**kwargs)` equals `factory(**kwargs)`, and doubling the
    injected `learning_rate` doubles the first update (every fedorth optimizer ends with
    `scale_by_learning_rate`). Integer hyperparameters that fix the program (e.g. `ns_steps`)
    must be listed in `static_args`. The plain transform runs eagerly (op by op, the ops
    `check_jit` runs at these shapes; jit == eager is its assertion): one compiled program, the
    injected update."""
    extra = _extra(extra_args_fn, loss_fn)
    plain = factory(**kwargs)
    injected = optax.inject_hyperparams(factory, static_args=static_args)(**kwargs)
    update_inj = fast_jit(lambda g, s, p: injected.update(g, s, p, **extra))
    update_plain = lambda g, s, p: plain.update(g, s, p, **extra)  # noqa: E731
    s_plain, s_inj = plain.init(params), injected.init(params)
    assert "learning_rate" in s_inj.hyperparams, "learning_rate was not injected"
    first_state = s_inj
    for t, g in enumerate(grads_seq):
        u_plain, s_plain = update_plain(g, s_plain, params)
        u_inj, s_inj = update_inj(g, s_inj, params)
        _assert_trees_close(
            u_inj, u_plain, rtol=rtol, atol=atol, what=f"inject_hyperparams step {t}"
        )
        if t == 0:
            u_first = u_inj
    hyper = dict(first_state.hyperparams)
    hyper["learning_rate"] = 2.0 * jnp.asarray(hyper["learning_rate"])
    u_double, _ = update_inj(grads_seq[0], first_state._replace(hyperparams=hyper), params)
    _assert_trees_close(
        u_double,
        jax.tree.map(lambda u: 2.0 * u, u_first),
        rtol=rtol,
        atol=atol,
        what="2x learning_rate",
    )


def run_battery(
    tx,
    params,
    grads_seq,
    params_C,
    grads_seq_C,
    *,
    shared_counters: bool = True,
    extra_args_fn=None,
    loss_fn=None,
    rtol=1e-5,
    atol=1e-6,
):
    """jit, shapes/dtypes, no recompilation, vmap == loop (both counter modes), clip chain.

    The checks share one compiled unbatched update (``JitUpdate``), so "no recompilation" covers
    every call made with ``params``' shapes: give ``params_C`` a client axis over those shapes."""
    kw = dict(extra_args_fn=extra_args_fn, loss_fn=loss_fn)
    update_jit = JitUpdate(tx, _extra(extra_args_fn, loss_fn))
    kw_jit = dict(kw, update_jit=update_jit)
    check_jit(tx, params, grads_seq, rtol=rtol, atol=atol, **kw_jit)
    check_shapes_dtypes(tx, params, grads_seq, **kw_jit)
    check_no_recompile(tx, params, grads_seq, **kw_jit)
    check_vmap_matches_loop(tx, params_C, grads_seq_C, rtol=rtol, atol=atol, **kw_jit)
    if shared_counters:
        check_vmap_matches_loop(
            tx, params_C, grads_seq_C, shared_counters=True, rtol=rtol, atol=atol, **kw_jit
        )
    check_clip_chain(tx, params, grads_seq, rtol=rtol, atol=atol, **kw_jit)
