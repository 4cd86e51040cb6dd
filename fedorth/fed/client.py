"""One client's round: the start of its optimizer state, its ``K`` local steps, what it uploads.

Keys: client ``i``'s key is ``fold_in(round_key, i)`` (by client id, so every strategy sees the
same randomness) and local step ``k``'s is ``fold_in(client_key, k)``, split into batch, model
(dropout) and optimizer (Hessian probe) keys. The pre-pass draws with step index ``K``.

Schedule counters (integer scalars in optimizer states) are never batched over clients: a reset
or warm-started state is built from unbatched server values, so ``lax.cond`` on a counter stays a
real branch under ``vmap`` (docs/CONTRACTS.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.config import RoundConfig
from fedorth.fed.server import persistent_mask
from fedorth.fed.state import ServerState, masked_leaves, with_masked_leaves
from fedorth.models import layers
from fedorth.optim import federated as fed_optim

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PyTree, jax.Array], tuple[jax.Array, tuple[PyTree, dict]]]
BatchFn = Callable[[PyTree, jax.Array, jax.Array], PyTree]


def compress_state(state: PyTree, ratio: float, aggregate_mask=None) -> PyTree:
    """The uploaded leaves low-rank, in Muon's matrix view (``fedorth.optim.compress``): those
    of ``fed_optim.upload_mask`` that ``aggregate_mask`` keeps (FedPAC: Θ only)."""
    from fedorth.optim.compress import compress_tree

    mask = fed_optim.upload_mask(state)
    if aggregate_mask is not None:
        mask = jax.tree.map(lambda a, b: bool(a and b), mask, aggregate_mask(state))
    return compress_tree(state, mask, ratio)


def make_prepass_fn(
    algorithm: FedAlgorithm, loss_fn: LossFn, batch_fn: BatchFn, config: RoundConfig
) -> Callable:
    """``prepass_fn(server, data, lr, round_key, client_id)``: ``algorithm.client_prepass`` of
    one sampled client at the server point."""
    k = config.local_steps

    def prepass_fn(server: ServerState, data: PyTree, lr: jax.Array, round_key, client_id):
        # Step index K: the local steps draw with 0..K-1.
        batch_key, model_key = jax.random.split(
            jax.random.fold_in(jax.random.fold_in(round_key, client_id), k)
        )
        batch = batch_fn(data, client_id, batch_key)

        def grad_fn(params):
            return jax.grad(lambda p: loss_fn(p, server.model_state, batch, model_key)[0])(params)

        ctx = {"params": server.params, "server": server, "learning_rate": lr, "batch": batch}
        return algorithm.client_prepass({**ctx, "grad_fn": grad_fn})

    return prepass_fn


def local_steps(
    tx: optax.GradientTransformationExtraArgs,
    loss_fn: LossFn,
    batch_fn: BatchFn,
    config: RoundConfig,
    start: tuple[PyTree, PyTree, PyTree],
    data: PyTree,
    client_id: jax.Array,
    client_key: jax.Array,
    extras: dict[str, Any],
):
    """The ``K`` local steps (a ``lax.scan``) from ``start = (params, model_state, opt_state)``;
    returns the final triple and the step losses."""

    def step(carry, step_index):
        params, model_state, opt_state = carry
        batch_key, model_key, opt_key = jax.random.split(
            jax.random.fold_in(client_key, step_index), 3
        )
        batch = batch_fn(data, client_id, batch_key)
        (loss, (new_model_state, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, model_state, batch, model_key
        )

        def obj_fn(p):
            # The local optimizer may take forward-mode derivatives of the objective
            # (Sophia's Hessian-vector products are forward-over-reverse): no custom-VJP
            # convolutions in its trace (layers.conv_trace_mode).
            with layers.conv_trace_mode("forward"):
                return loss_fn(p, model_state, batch, model_key)[0]

        updates, opt_state = tx.update(
            grads, opt_state, params, obj_fn=obj_fn, key=opt_key, **extras
        )
        params = optax.apply_updates(params, updates)
        return (params, new_model_state, opt_state), loss

    return jax.lax.scan(step, start, jnp.arange(config.local_steps), unroll=config.unroll)


def start_state(algorithm: FedAlgorithm, server: ServerState, persistent) -> PyTree:
    """The local optimizer's state when the client's round starts."""
    tx = algorithm.local_tx
    mode = algorithm.client_state
    if mode == "reset":
        return tx.init(server.params)
    if mode == "persistent":
        return persistent.opt_state
    opt_state = server.opt_state
    if algorithm.aggregate_mask is not None:
        fresh = tx.init(server.params)
        opt_state = jax.tree.map(
            lambda keep, g, f: g if keep else f,
            algorithm.aggregate_mask(fresh),
            opt_state,
            fresh,
        )
    if algorithm.persistent_mask is not None:
        # The leaves each client keeps (FAFED's previous iterate), next to the averaged.
        kept = persistent_mask(algorithm, opt_state)
        opt_state = with_masked_leaves(opt_state, kept, persistent.opt_state)
    return opt_state


def local_extras(algorithm, server, lr, persistent, prepass_mean, prepass) -> dict[str, Any]:
    """The local optimizer's extra arguments: server quantities, corrections, pre-pass."""
    extras: dict[str, Any] = {**server.extra, "learning_rate": lr}
    if algorithm.uses_global_direction:
        extras["global_direction"] = server.global_direction
    if algorithm.control_variates:
        extras["control_correction"] = jax.tree.map(
            lambda c, ci: c - ci, server.control, persistent.control
        )
    for name, mean in prepass_mean.items():
        extras[f"{name}_mean"] = mean
        if name in prepass:
            extras[name] = prepass[name]
    return extras


def make_client_fn(
    algorithm: FedAlgorithm, loss_fn: LossFn, batch_fn: BatchFn, config: RoundConfig
) -> Callable:
    """``client_fn(server, data, lr, round_key, prepass_mean, xs) -> (out, new_persistent)``
    with ``xs = (client_id, persistent, prepass)``: one client's round."""
    tx = algorithm.local_tx
    k = config.local_steps

    def client_fn(server: ServerState, data: PyTree, lr: jax.Array, round_key, prepass_mean, xs):
        client_id, persistent, prepass = xs
        client_key = jax.random.fold_in(round_key, client_id)
        params0 = server.params
        opt_state = start_state(algorithm, server, persistent)
        extras = local_extras(algorithm, server, lr, persistent, prepass_mean, prepass)
        start = (params0, server.model_state, opt_state)
        (params, model_state, opt_state), losses = local_steps(
            tx, loss_fn, batch_fn, config, start, data, client_id, client_key, extras
        )
        delta = jax.tree.map(lambda a, b: a - b, params, params0)
        out = {"delta": delta, "model_state": model_state, "loss": jnp.mean(losses)}
        new_persistent = finish(algorithm, out, params, opt_state, persistent, server, lr, k)
        return out, new_persistent

    return client_fn


def finish(algorithm, out, params, opt_state, persistent, server, lr, k):
    """Fills ``out`` with what the client uploads; returns what it keeps (``ClientState``)."""
    delta = out["delta"]
    new_persistent = persistent
    if algorithm.persistent_mask is not None:
        kept = masked_leaves(opt_state, persistent_mask(algorithm, opt_state))
        new_persistent = new_persistent.replace(opt_state=kept)
    if algorithm.aggregate_opt_state and algorithm.state_compression is not None:
        opt_state = compress_state(opt_state, algorithm.state_compression, algorithm.aggregate_mask)
    # The final state: uploaded when aggregated; else its Θ only enters the drift metric.
    out["opt_state"] = opt_state
    if algorithm.client_report is not None:
        out["report"] = algorithm.client_report(
            {
                "params0": server.params,
                "params": params,
                "opt_state": opt_state,
                "persistent": persistent,
                "server": server,
                "learning_rate": lr,
            }
        )
    if algorithm.client_state == "persistent":
        new_persistent = new_persistent.replace(opt_state=opt_state)
    if algorithm.control_variates == "scaffold":
        # Option II of Karimireddy et al. (2020), Eq. (4): c_i+ = c_i - c + (x - y_i)/(K eta).
        new_control = jax.tree.map(
            lambda ci, c, d: ci - c - d / (k * lr),
            persistent.control,
            server.control,
            delta,
        )
        new_persistent = new_persistent.replace(control=new_control)
    elif algorithm.control_variates == "momentum":
        # FedMuon-LMO Alg. 1 line 11: C_i^(r+1) <- M_i^(r,K).
        new_persistent = new_persistent.replace(control=algorithm.momentum_fn(opt_state))
    return new_persistent


def per_client_outputs(algorithm: FedAlgorithm, client_fn: Callable, drift, has_clients: bool):
    """``per_client(shared, xs) -> (averaged, stacked)`` for ``execution.run_clients``: what the
    server averages over the clients (summarized as they finish) and what it needs per client."""
    from fedorth.fed import drift as drift_lib

    def per_client(shared, xs):
        out, new_persistent = client_fn(*shared, xs)
        averaged = {k: out[k] for k in ("delta", "model_state", "loss")}
        stacked: dict[str, Any] = {}
        if has_clients:
            stacked["persistent"] = new_persistent
        if algorithm.control_variates:
            averaged["control_diff"] = jax.tree.map(
                jnp.subtract, new_persistent.control, xs[1].control
            )
        drift_lib.client_outputs(algorithm, drift, out["opt_state"], averaged, stacked)
        if "report" in out:
            averaged["report"] = out["report"]
        if algorithm.aggregate_delta is not None:
            stacked["delta"] = out["delta"]
            stacked["report"] = out.get("report", {})
        return averaged, stacked

    return per_client
