"""One client's round: the start of its optimizer state, its ``K`` local steps, what it uploads.

Keys: client ``i``'s key is ``fold_in(round_key, i)`` (by client id, so every strategy sees the
same randomness) and local step ``k``'s is ``fold_in(client_key, k)``, split into batch, model
(dropout) and optimizer (Hessian probe) keys. The pre-pass draws with step index ``K``.

Schedule counters (integer scalars in optimizer states) are never batched over clients: a reset
or warm-started state is built from unbatched server values, so ``lax.cond`` on a counter stays a
real branch under ``vmap`` (docs/CONTRACTS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedorth.fed import aggregation as aggregation_lib
from fedorth.fed import privacy
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.config import RoundConfig
from fedorth.fed.context import ClientResult, PrepassInput, RoundContext
from fedorth.fed.corrections import control_diff
from fedorth.fed.state import ClientState
from fedorth.models import layers

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PyTree, jax.Array], tuple[jax.Array, tuple[PyTree, dict]]]
BatchFn = Callable[[PyTree, jax.Array, jax.Array], PyTree]


class ClientInputs(NamedTuple):
    """What a round hands each sampled client, stacked over the client axis."""

    client_id: jax.Array
    persistent: ClientState | None  # its kept state (``ServerState.clients`` row), or None
    prepass: dict  # its own pre-pass results (``Prepass.per_client``), or {}


def make_prepass_fn(
    algorithm: FedAlgorithm, loss_fn: LossFn, batch_fn: BatchFn, config: RoundConfig
) -> Callable:
    """``prepass_fn(ctx, data, client_id)``: the algorithm's pre-pass
    (``fedorth.fed.corrections.Prepass``) of one sampled client at the server point."""
    k = config.local_steps

    def prepass_fn(ctx: RoundContext, data: PyTree, client_id):
        # Step index K: the local steps draw with 0..K-1.
        batch_key, model_key = jax.random.split(jax.random.fold_in(ctx.client_key(client_id), k))
        batch = batch_fn(data, client_id, batch_key)
        model_state = ctx.server.model_state

        def grad_fn(params):
            return jax.grad(lambda p: loss_fn(p, model_state, batch, model_key)[0])(params)

        return algorithm.corrections.prepass.fn(ctx, PrepassInput(client_id, batch, grad_fn))

    return prepass_fn


def local_step(
    tx: optax.GradientTransformationExtraArgs,
    loss_fn: LossFn,
    batch_fn: BatchFn,
    data: PyTree,
    client_id: jax.Array,
    client_key: jax.Array,
    extras: dict[str, Any],
    carry: tuple[PyTree, PyTree, PyTree],
    step_index: jax.Array,
):
    """One local step of a client: ``(params, model_state, opt_state) -> (new triple, loss)``.

    The step's keys are ``client_key`` folded with ``step_index``, split into the batch, model
    (dropout) and optimizer keys; the local optimizer gets the objective ``obj_fn`` and the
    round's ``extras`` as extra arguments. :func:`local_steps` scans it; the benchmark's
    Python-loop peer (experiments/bench/jax_loop.py) calls it step by step.
    """
    params, model_state, opt_state = carry
    batch_key, model_key, opt_key = jax.random.split(jax.random.fold_in(client_key, step_index), 3)
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

    updates, opt_state = tx.update(grads, opt_state, params, obj_fn=obj_fn, key=opt_key, **extras)
    params = optax.apply_updates(params, updates)
    return (params, new_model_state, opt_state), loss


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
    """The ``K`` local steps (a ``lax.scan`` of :func:`local_step`) from ``start = (params,
    model_state, opt_state)``; returns the final triple and the step losses."""
    step = functools.partial(local_step, tx, loss_fn, batch_fn, data, client_id, client_key, extras)
    return jax.lax.scan(step, start, jnp.arange(config.local_steps), unroll=config.unroll)


def make_client_fn(
    algorithm: FedAlgorithm, loss_fn: LossFn, batch_fn: BatchFn, config: RoundConfig
) -> Callable:
    """``client_fn(ctx, data, prepass_mean, xs) -> (out, new_persistent)`` with ``xs`` a
    :class:`ClientInputs`: one client's round.

    ``out`` holds the update ``delta = x_i^K - x^r``, the model state, the mean loss, the
    uploaded optimizer state and the report; ``new_persistent`` what the client keeps
    (``ClientState``, or None).
    """
    tx, start, corrections = algorithm.local_tx, algorithm.start, algorithm.corrections

    def client_fn(ctx: RoundContext, data: PyTree, prepass_mean, xs: ClientInputs):
        client_id, persistent, prepass = xs
        server = ctx.server
        params0 = server.params
        kept = control_i = None
        if persistent is not None:
            kept, control_i = persistent.opt_state, persistent.control
        opt_state = start.client_start(tx, ctx, kept)
        extras: dict[str, Any] = {
            **server.extra,
            "learning_rate": ctx.learning_rate,
            "round_context": ctx,
        }
        extras.update(corrections.client_args(ctx, control_i, prepass_mean, prepass))
        (params, model_state, opt_state), losses = local_steps(
            tx,
            loss_fn,
            batch_fn,
            config,
            (params0, server.model_state, opt_state),
            data,
            client_id,
            ctx.client_key(client_id),
            extras,
        )
        delta = jax.tree.map(lambda a, b: a - b, params, params0)
        out = {"delta": delta, "model_state": model_state, "loss": jnp.mean(losses)}
        # The final state: uploaded when averaged; else its Θ only enters the drift metric.
        out["opt_state"], kept = start.client_end(opt_state)
        if algorithm.report is not None:
            result = ClientResult(client_id, params, delta, out["opt_state"], persistent)
            out["report"] = algorithm.report.fn(ctx, result)
        control = corrections.client_control(ctx, control_i, delta, out["opt_state"])
        if persistent is None:
            return out, None
        return out, ClientState(opt_state=kept, control=control)

    return client_fn


def per_client_outputs(
    algorithm: FedAlgorithm,
    client_fn: Callable,
    drift,
    has_clients: bool,
    dp=None,
    aggregation: str = "uniform",
):
    """``per_client(shared, xs) -> (averaged, stacked)`` for ``execution.run_clients``: what the
    server averages over the clients (summarized as they finish) and what it needs per client.

    With client-level differential privacy (``dp``, a ``fedorth.fed.privacy.ClientDP``) the
    upload is clipped here, client by client, before anything is summarized. With
    ``aggregation="examples"`` the uploads are weighted here by the clients' example counts
    (``fedorth.fed.aggregation``)."""
    from fedorth.fed import drift as drift_lib

    def per_client(shared, xs):
        out, new_persistent = client_fn(*shared, xs)
        averaged = {k: out[k] for k in ("delta", "model_state", "loss")}
        stacked: dict[str, Any] = {}
        if has_clients:
            stacked["persistent"] = new_persistent
        if algorithm.corrections.control:
            averaged["control_diff"] = control_diff(new_persistent.control, xs.persistent.control)
        drift_lib.client_outputs(algorithm, drift, out["opt_state"], averaged, stacked)
        if "report" in out:
            averaged["report"] = out["report"]
        if algorithm.server.combine is not None:
            stacked["delta"] = out["delta"]
            stacked["report"] = out.get("report", {})
        if aggregation == "examples":
            ctx, data = shared[0], shared[1]
            weight = aggregation_lib.client_weight(ctx, data, xs.client_id)
            averaged = aggregation_lib.weigh(averaged, weight)
        if dp is not None:
            ctx = shared[0]
            averaged = privacy.clip_upload(dp, ctx, averaged, xs.client_id)
            if has_clients and dp.sampling == "poisson":
                # A client Poisson sampling leaves out keeps what it had.
                joined = privacy.participates(dp, ctx, xs.client_id)
                stacked["persistent"] = jax.tree.map(
                    lambda new, old: jnp.where(joined, new, old.astype(new.dtype)),
                    new_persistent,
                    xs.persistent,
                )
        return averaged, stacked

    return per_client
