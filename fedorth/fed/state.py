"""Server and client state of the federated engine.

All state is a pytree of device arrays so that one round is one jitted call and a checkpoint is
one ``orbax`` save. Per-client persistent state is stacked over a leading axis of size ``N``
(all clients), gathered for the sampled clients inside the round and scattered back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

PyTree = Any


@struct.dataclass
class ClientState:
    """What one client keeps between the rounds it joins (``persistent`` algorithms).

    Attributes:
      opt_state: the client's own local-optimizer state (FedMuon-LMO's ``M_i``), the list of
        the leaves ``start.Global.keep`` selects (FAFED's previous iterate), or ``None``.
      control: the client's control variate ``c_i`` / ``C_i`` (SCAFFOLD, FedMuon-LMO), or ``None``.
    """

    opt_state: PyTree = None
    control: PyTree = None


@struct.dataclass
class ServerState:
    """The server's state between rounds.

    Attributes:
      round: number of completed rounds, int32 scalar.
      params: global model parameters ``x^r``.
      model_state: global non-trainable model state (BatchNorm statistics), averaged like params.
      opt_state: server-aggregated local-optimizer state (FedMuon's ``M-bar``, FedPAC's
        ``Theta``), or ``None`` when clients reset or keep their own.
      global_direction: ``g_G = -mean_i(x_i^K - x^r) / (K eta_r)`` (FedMuon (Liu et al.)
      ``Delta_G``,
        FedPAC (Liu et al.) ``g_G``; FedCM's global momentum), or ``None``.
      control: server control variate ``c`` / ``C``, or ``None``.
      server_opt_state: state of the server optimizer applied to the pseudo-gradient.
      clients: :class:`ClientState` stacked over all ``N`` clients, or ``None``.
      key: the run's base PRNG key; rounds derive theirs with ``fold_in(key, round)``.
      extra: algorithm-defined server quantities (``ServerQuantities``), passed
        to the clients' local optimizer as extra arguments.
      privacy: client-level differential privacy's state (``fedorth.fed.privacy``: the clip
        norm), or None without it.
    """

    round: jax.Array
    params: PyTree
    model_state: PyTree
    opt_state: PyTree
    global_direction: PyTree
    control: PyTree
    server_opt_state: PyTree
    clients: ClientState | None
    key: jax.Array
    extra: dict = struct.field(default_factory=dict)
    privacy: PyTree = None


def zeros_like_tree(tree: PyTree) -> PyTree:
    return jax.tree.map(jnp.zeros_like, tree)


def stack_clients(tree: PyTree, num_clients: int) -> PyTree:
    """Broadcasts a single-client pytree to ``[num_clients, ...]``."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients, *jnp.shape(x))).copy(), tree)


def gather_clients(tree: PyTree, ids: jax.Array) -> PyTree:
    """Selects the rows ``ids`` of a client-stacked pytree."""
    return jax.tree.map(lambda x: x[ids], tree)


def scatter_clients(tree: PyTree, ids: jax.Array, rows: PyTree) -> PyTree:
    """Writes ``rows`` back at ``ids``; clients not in ``ids`` keep their state unchanged."""
    return jax.tree.map(lambda x, r: x.at[ids].set(r.astype(x.dtype)), tree, rows)


def masked_leaves(tree: PyTree, mask: PyTree) -> list:
    """The leaves of ``tree`` where ``mask`` (bools, same structure) is True, in leaf order."""
    marks = jax.tree.leaves(mask)
    leaves = jax.tree.leaves(tree)
    if len(marks) != len(leaves):
        raise ValueError(f"mask has {len(marks)} leaves, the tree {len(leaves)}.")
    return [x for x, keep in zip(leaves, marks, strict=True) if keep]


def with_masked_leaves(tree: PyTree, mask: PyTree, kept: list) -> PyTree:
    """``tree`` with its ``mask`` leaves replaced by ``kept`` (as :func:`masked_leaves` lists)."""
    leaves, treedef = jax.tree.flatten(tree)
    rows = iter(kept)
    marks = jax.tree.leaves(mask)
    return treedef.unflatten(
        [next(rows) if keep else x for x, keep in zip(leaves, marks, strict=True)]
    )
