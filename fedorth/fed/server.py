"""The server: its state before round 0, the clients a round samples, its update after them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.context import RoundContext, sample_clients  # noqa: F401  (the round's)
from fedorth.fed.privacy import ClientDP
from fedorth.fed.privacy import init_state as init_privacy
from fedorth.fed.state import (
    ClientState,
    ServerState,
    scatter_clients,
    stack_clients,
)
from fedorth.optim import federated as fed_optim

PyTree = Any


def _check_model_state(model_state: PyTree, algorithm: FedAlgorithm) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(model_state):
        if not fed_optim.is_float(leaf):
            raise ValueError(
                f"{algorithm.name}: model state leaf {jax.tree_util.keystr(path)} has dtype "
                f"{leaf.dtype}; the server averages model state (e.g. BatchNorm statistics) "
                "like parameters, so every leaf must be floating point."
            )


def init_server(
    algorithm: FedAlgorithm,
    params: PyTree,
    model_state: PyTree,
    *,
    num_clients: int,
    key: jax.Array,
    privacy: ClientDP | None = None,
    stacked: bool = True,
) -> ServerState:
    """The server state before round 0 (``g_G = 0``, control variates ``0``, ``M_i = 0``; with
    client-level differential privacy, ``privacy``, its initial clip norm).

    ``stacked=False``: ``clients`` is one client's initial state, not ``N`` of them (the
    template of a client-state store, ``fedorth.fed.client_store``)."""
    _check_model_state(model_state, algorithm)
    # The round donates the server state: copy so the caller's arrays stay valid.
    params = jax.tree.map(jnp.copy, params)
    model_state = jax.tree.map(jnp.copy, model_state)
    opt_state, client_opt = algorithm.start.init_server(algorithm.local_tx, params)
    corrections = algorithm.corrections.init_server(params)
    clients = None
    if client_opt is not None or corrections["control"] is not None:
        client = ClientState(opt_state=client_opt, control=corrections["control"])
        clients = stack_clients(client, num_clients) if stacked else client
    quantities = algorithm.quantities
    return ServerState(
        round=jnp.zeros([], jnp.int32),
        params=params,
        model_state=model_state,
        opt_state=opt_state,
        server_opt_state=algorithm.server.init_server(params),
        clients=clients,
        key=key,
        extra=quantities.init(params) if quantities is not None else {},
        privacy=init_privacy(privacy),
        **corrections,
    )


def server_step(algorithm: FedAlgorithm, ctx: RoundContext, stats, stacked):
    """The server update of parameters and model state from the clients' summary; returns the new
    state and the aggregated update ``Delta`` (``fedorth.fed.update``)."""
    mean = stats["mean"]
    mean_delta = algorithm.server.combine_updates(ctx, mean["delta"], stacked)
    params, server_opt_state = algorithm.server.step(ctx, mean_delta)
    new = ctx.server.replace(
        round=ctx.round + 1,
        params=params,
        model_state=mean["model_state"],
        server_opt_state=server_opt_state,
    )
    return new, mean_delta


def server_quantities(
    algorithm: FedAlgorithm, ctx: RoundContext, new, mean, mean_delta, stacked, *, rows=False
) -> ServerState:
    """The new server quantities: ``extra`` (from ``new``: the parameters after the server step),
    the corrections' (``g_G``, ``c``), and the kept client states of the sampled clients
    (``rows``: ``server.clients`` holds the sampled clients' rows only, ``RoundConfig.client_rows``,
    which the new ones replace)."""
    server = ctx.server
    if algorithm.quantities is not None:
        reports = mean.get("report", {})
        new = new.replace(extra=algorithm.quantities.update(ctx, new, reports))
    new = algorithm.corrections.server_update(ctx, new, mean, mean_delta)
    if server.clients is not None and rows:
        cast = jax.tree.map(lambda x, r: r.astype(x.dtype), server.clients, stacked["persistent"])
        new = new.replace(clients=cast)
    elif server.clients is not None:
        new = new.replace(
            clients=scatter_clients(server.clients, ctx.client_ids, stacked["persistent"])
        )
    return new
