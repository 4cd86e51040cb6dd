"""One federated round as one compiled call: the pipeline.

A round samples ``S`` of ``N`` clients without replacement (:func:`sample_clients`), runs an
algorithm's pre-pass over them if it has one, runs ``K`` local steps on each (``fed.client``)
with the execution strategy of ``RoundConfig.strategy`` (``fed.execution``; ``"auto"`` on one
accelerator is measured, ``fed.autotune``), aggregates what they upload (summaries streamed as
clients finish, ``fed.reduce``; preconditioner drift, ``fed.drift``) and updates the server
(``fed.server``). :func:`round_body` is that pipeline as a plain function of
``(server, data)``; :func:`make_round_fn` jits it (``fed.compiled``).

The round's :class:`~fedorth.fed.context.RoundContext` (``fed.context.begin_round``: the
server state it starts from, the sampled ids, ``N``, ``S``, ``K``, the learning rate, the round
key ``fold_in(server.key, round)``) is built once and passed to every spec method of the
algorithm. The clients' and local steps' keys derive from the round key by client id
(``fed.client``), so every strategy sees the same randomness.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fedorth.fed import autotune, client, drift, execution, privacy, reduce
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.autotune import MeasuredRoundFn
from fedorth.fed.client import BatchFn, LossFn
from fedorth.fed.compiled import RoundFn
from fedorth.fed.config import RoundConfig
from fedorth.fed.context import begin_round
from fedorth.fed.execution import client_conv_trace_mode, resolve_strategy  # noqa: F401
from fedorth.fed.server import sample_clients, server_quantities, server_step  # noqa: F401
from fedorth.fed.start import compress_state as _compress_state  # noqa: F401
from fedorth.fed.state import ServerState, gather_clients

PyTree = Any


def round_body(
    algorithm: FedAlgorithm, loss_fn: LossFn, batch_fn: BatchFn, config: RoundConfig
) -> Callable[[ServerState, PyTree], tuple[ServerState, dict]]:
    """``round_fn(server, data) -> (server, metrics)``, not jitted (``config.strategy`` fixed).

    A caller may ``jax.jit`` or ``jax.vmap`` it itself; :func:`make_round_fn` jits it.
    """
    s = config.clients_per_round
    client_fn = client.make_client_fn(algorithm, loss_fn, batch_fn, config)
    prepass_fn = client.make_prepass_fn(algorithm, loss_fn, batch_fn, config)

    def round_fn(server: ServerState, data: PyTree):
        ctx = begin_round(server, config)
        ids = ctx.client_ids
        persistent = server.clients
        if persistent is not None and not config.client_rows:
            persistent = gather_clients(server.clients, ids)
        plan = drift.plan(algorithm, config, server)
        if config.privacy is not None:
            privacy.check_round(algorithm, plan, server)
        per_client = client.per_client_outputs(
            algorithm,
            client_fn,
            plan,
            server.clients is not None,
            config.privacy,
            config.aggregation,
        )
        prepass_mean, prepass = {}, {}
        if algorithm.corrections.prepass is not None:
            # The pass over the sampled clients at the server point, before their local steps:
            # the server averages the results; each client keeps its own unless the algorithm
            # needs the means only (Prepass.per_client).
            def per_client_prepass(shared, client_id):
                out = prepass_fn(*shared, client_id)
                return out, (out if algorithm.corrections.prepass.per_client else {})

            prepass_stats, prepass = execution.run_clients(
                per_client_prepass, (ctx, data), ids, config, {}, None
            )
            prepass_mean = prepass_stats["mean"]
        stats, stacked = execution.run_clients(
            per_client,
            (ctx, data, prepass_mean),
            client.ClientInputs(ids, persistent, prepass),
            config,
            plan.spread,
            "delta",
        )
        dp_metrics = {}
        if config.privacy is not None:
            stats, privacy_state, dp_metrics = privacy.privatize(config.privacy, ctx, stats)
        new, mean_delta = server_step(algorithm, ctx, stats, stacked)
        metrics = {"train_loss": stats["mean"]["loss"], "learning_rate": ctx.learning_rate}
        metrics.update(reduce.drift(stats, "delta", s))
        new, drift_metrics = drift.server_opt_state(algorithm, plan, new, stats, stacked, s)
        metrics.update(drift_metrics)
        new = server_quantities(
            algorithm, ctx, new, stats["mean"], mean_delta, stacked, rows=config.client_rows
        )
        if config.privacy is not None:
            new = new.replace(privacy=privacy_state)
            metrics.update(dp_metrics)
        return new, metrics

    return round_fn


def make_round_fn(
    algorithm: FedAlgorithm,
    loss_fn: LossFn,
    batch_fn: BatchFn,
    config: RoundConfig,
    *,
    timer: Callable[[], float] = time.perf_counter,
    params: PyTree = None,
) -> RoundFn | MeasuredRoundFn:
    """Builds ``round_fn(server, data) -> (server, metrics)``, one jitted call per round.

    Args:
      algorithm: the federated algorithm.
      loss_fn: ``loss_fn(params, model_state, batch, key) -> (loss, (model_state, metrics))``;
        a bound ``Model.loss_fn`` also tells ``"auto"`` whether the model is convolutional.
      batch_fn: ``batch_fn(data, client_id, key) -> batch`` draws a local mini-batch on device.
      config: the round's static settings; ``"auto"`` is resolved here
        (``fed.execution.resolve_strategy``), or on one accelerator by timing the candidates on
        the first round (``fed.autotune.MeasuredRoundFn``; with the convolution, for a
        convolutional model whose ``conv_impl`` is ``"auto"``).
      timer: the clock of that measurement (tests pass a fake).
      params: the model's parameters (arrays or shapes), optional: on CPU, ``"auto"`` keeps a
        round whose local state factorizes large matrices on the host on one device
        (``fed.execution.resolve_strategy``); without them it cannot weigh that work.

    Returns:
      The round function (``RoundFn``, or ``MeasuredRoundFn`` for a measured ``"auto"``).
      ``data`` is any pytree the ``batch_fn`` reads (it stays on device; ``round_fn.place(data)``
      puts it once where the round reads it); the server state is donated.
    """
    convolutional = bool(getattr(getattr(loss_fn, "__self__", None), "convolutional", False))
    if not autotune.measures(config, convolutional):
        config = execution.fixed_strategy(algorithm, loss_fn, config, params)
        return RoundFn(round_body(algorithm, loss_fn, batch_fn, config), config)
    candidates = {}
    pairs = autotune.candidates(config, autotune.conv_impl_choice(loss_fn))
    for label, (strategy, conv_impl) in pairs.items():
        fixed = dataclasses.replace(config, strategy=strategy)
        fixed = execution.fixed_strategy(algorithm, loss_fn, fixed, params)
        body = round_body(algorithm, loss_fn, batch_fn, fixed)
        candidates[label] = RoundFn(body, fixed, conv_impl=conv_impl)
    return MeasuredRoundFn(candidates, config, timer=timer)
