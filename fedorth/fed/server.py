"""The server: its state before round 0, the clients a round samples, its update after them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.state import (
    ClientState,
    ServerState,
    masked_leaves,
    scatter_clients,
    stack_clients,
    zeros_like_tree,
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
) -> ServerState:
    """The server state before round 0 (``g_G = 0``, control variates ``0``, ``M_i = 0``)."""
    _check_model_state(model_state, algorithm)
    # The round donates the server state: copy so the caller's arrays stay valid.
    params = jax.tree.map(jnp.copy, params)
    model_state = jax.tree.map(jnp.copy, model_state)
    opt_state = algorithm.local_tx.init(params) if algorithm.aggregate_opt_state else None
    control = zeros_like_tree(params) if algorithm.control_variates else None
    clients = None
    if (
        algorithm.client_state == "persistent"
        or algorithm.control_variates
        or algorithm.persistent_mask is not None
    ):
        client_opt = (
            algorithm.local_tx.init(params) if algorithm.client_state == "persistent" else None
        )
        if algorithm.persistent_mask is not None:
            fresh = algorithm.local_tx.init(params)
            client_opt = masked_leaves(fresh, persistent_mask(algorithm, fresh))
        clients = stack_clients(ClientState(opt_state=client_opt, control=control), num_clients)
    return ServerState(
        round=jnp.zeros([], jnp.int32),
        params=params,
        model_state=model_state,
        opt_state=opt_state,
        global_direction=zeros_like_tree(params) if algorithm.uses_global_direction else None,
        control=control,
        server_opt_state=algorithm.server_tx.init(params),
        clients=clients,
        key=key,
        extra=algorithm.server_extra_init(params) if algorithm.server_extra_init else {},
    )


def persistent_mask(algorithm: FedAlgorithm, opt_state: PyTree) -> PyTree:
    """``algorithm.persistent_mask(opt_state)``, checked disjoint from its ``aggregate_mask``."""
    mask = algorithm.persistent_mask(opt_state)
    shared = algorithm.aggregate_mask(opt_state) if algorithm.aggregate_mask else mask
    if any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(a and b), mask, shared))):
        raise ValueError(
            f"{algorithm.name}: persistent_mask and aggregate_mask select the same leaves; a "
            "leaf is either averaged or kept per client."
        )
    return mask


def sample_clients(
    key: jax.Array, round_index: jax.Array, num_clients: int, clients_per_round: int
):
    """The round's key and its ``S`` sampled client ids (sorted, without replacement)."""
    round_key = jax.random.fold_in(key, round_index)
    sample_key, _ = jax.random.split(round_key)
    ids = jax.random.choice(sample_key, num_clients, (clients_per_round,), replace=False)
    return round_key, jnp.sort(ids.astype(jnp.int32))


def server_step(algorithm: FedAlgorithm, server: ServerState, stats, stacked, lr, n, s, k):
    """The server update of parameters and model state from the clients' summary; returns the new
    state and the aggregated update ``mean_i(x_i^K - x^r)`` (or ``aggregate_delta``'s)."""
    mean = stats["mean"]
    mean_delta = mean["delta"]
    if algorithm.aggregate_delta is not None:
        # E.g. FedPM's preconditioned mixing of the client-stacked updates and reports.
        mean_delta = algorithm.aggregate_delta(server, stacked["delta"], stacked["report"])
    if algorithm.server_rule == "mean":
        scale = 1.0
    elif algorithm.server_rule == "partial":
        scale = s / n
    else:
        scale = algorithm.server_lr / (k * lr)
    pseudo_grad = jax.tree.map(lambda d: -scale * d, mean_delta)
    updates, server_opt_state = algorithm.server_tx.update(
        pseudo_grad, server.server_opt_state, server.params
    )
    params = optax.apply_updates(server.params, updates)
    new = server.replace(
        round=server.round + 1,
        params=params,
        model_state=mean["model_state"],
        server_opt_state=server_opt_state,
    )
    return new, mean_delta


def server_quantities(
    algorithm: FedAlgorithm, server, new, mean, mean_delta, stacked, ids, lr, n, s, k
) -> ServerState:
    """The new server quantities: ``extra``, ``g_G``, control variates, the clients' kept state."""
    if algorithm.client_report is not None:
        new = new.replace(extra=algorithm.server_extra_update(server, mean["report"], lr))
    if algorithm.uses_global_direction:
        # FedMuon (Liu et al.) Alg. 2 line 13 / FedPAC (Liu et al.) Alg. 2 line 14: g_G =
        # -mean(dx) / (K eta).
        new = new.replace(global_direction=jax.tree.map(lambda d: -d / (k * lr), mean_delta))
    if algorithm.control_variates:
        # c <- c + (1/N) sum_{i in S} (c_i+ - c_i)  (SCAFFOLD Alg. 1 line 17; FedMuon-LMO line
        # 17).
        control = jax.tree.map(
            lambda c, diff: c + (s / n) * diff, server.control, mean["control_diff"]
        )
        new = new.replace(control=control)
    if server.clients is not None:
        new = new.replace(clients=scatter_clients(server.clients, ids, stacked["persistent"]))
    return new
