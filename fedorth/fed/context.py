"""The round's context: one frozen record that every spec method of every design axis receives.

The engine builds one :class:`RoundContext` per round (:func:`begin_round`) and passes it, as
the first argument after the spec itself, to the round's calls of every axis: the client start,
the corrections and their control variates, the server quantities and the clients' reports, the
server update and its rule, and the local optimizer (the extra argument ``round_context``). A
spec written outside fedorth therefore reads what a built-in spec reads: ``N``, ``S``, ``K``,
the round's learning rate, the round's key, the sampled ids and the server state the round
started from.

Per-client calls also receive a typed record of that client: :class:`ClientResult` (a report,
after the local steps) and :class:`PrepassInput` (the pre-pass, before them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedorth.fed.state import ClientState, ServerState

PyTree = Any


@struct.dataclass
class RoundContext:
    """What one round is, fixed before its clients run (frozen; a pytree, ``N``, ``S``, ``K``
    static).

    Attributes:
      server: the server state the round starts from: ``server.params`` is ``x^r``, the point
        every sampled client starts from; ``server.extra`` the server quantities sent down.
      client_ids: the ``S`` sampled client ids, sorted (int32, ``[S]``).
      learning_rate: the round's local learning rate ``eta_r`` (``RoundConfig.lr``). The
        server's own step size belongs to the server update (``ServerUpdate.tx``, or
        ``GlobalStep.gamma``).
      key: the round key ``fold_in(server.key, round)``; client ``i``'s key is
        :meth:`client_key`.
      num_clients: ``N``.
      clients_per_round: ``S``.
      local_steps: ``K``.
    """

    server: ServerState
    client_ids: jax.Array
    learning_rate: jax.Array
    key: jax.Array
    num_clients: int = struct.field(pytree_node=False)
    clients_per_round: int = struct.field(pytree_node=False)
    local_steps: int = struct.field(pytree_node=False)

    @property
    def params(self) -> PyTree:
        """The server's parameters ``x^r`` at the start of the round."""
        return self.server.params

    @property
    def round(self) -> jax.Array:
        """The round index ``r`` (int32 scalar: the rounds completed before this one)."""
        return self.server.round

    def client_key(self, client_id: jax.Array) -> jax.Array:
        """Client ``client_id``'s key, ``fold_in(key, client_id)``; its local step ``k`` draws
        from ``fold_in(client_key, k)`` (``fedorth.fed.client``)."""
        return jax.random.fold_in(self.key, client_id)


def sample_clients(
    key: jax.Array, round_index: jax.Array, num_clients: int, clients_per_round: int
):
    """The round's key and its ``S`` sampled client ids (sorted, without replacement)."""
    round_key = jax.random.fold_in(key, round_index)
    sample_key, _ = jax.random.split(round_key)
    ids = jax.random.choice(sample_key, num_clients, (clients_per_round,), replace=False)
    return round_key, jnp.sort(ids.astype(jnp.int32))


_sample = jax.jit(sample_clients, static_argnums=(2, 3))


def round_clients(
    key: jax.Array, round_index: int, num_clients: int, clients_per_round: int
) -> np.ndarray:
    """The sorted ids round ``round_index`` samples (as :func:`begin_round` draws them), on the
    host: what a round's data and client states are read for before it runs."""
    _, ids = _sample(key, np.int32(round_index), num_clients, clients_per_round)
    return np.asarray(jax.device_get(ids))


def begin_round(server: ServerState, config) -> RoundContext:
    """The :class:`RoundContext` of the round that starts from ``server`` under ``config`` (a
    ``RoundConfig``): its key and sampled ids (:func:`sample_clients`) and
    learning rate."""
    n, s = config.num_clients, config.clients_per_round
    round_key, ids = sample_clients(server.key, server.round, n, s)
    return RoundContext(
        server=server,
        client_ids=ids,
        learning_rate=config.lr(server.round),
        key=round_key,
        num_clients=n,
        clients_per_round=s,
        local_steps=config.local_steps,
    )


class ClientResult(NamedTuple):
    """One client after its ``K`` local steps (what ``ClientReport.fn`` reads).

    Attributes:
      client_id: the client's id.
      params: its final parameters ``x_i^K`` (it started from the context's ``params``).
      delta: its update ``x_i^K - x^r``.
      opt_state: its final optimizer state, as uploaded (``start.client_end``).
      persistent: what it kept from the rounds it joined before (``ClientState``), or None.
    """

    client_id: jax.Array
    params: PyTree
    delta: PyTree
    opt_state: PyTree
    persistent: ClientState | None


class PrepassInput(NamedTuple):
    """One sampled client before its local steps (what ``Prepass.fn`` reads).

    Attributes:
      client_id: the client's id.
      batch: a fresh mini-batch, drawn with local step index ``K`` (the local steps use
        ``0..K-1``).
      grad_fn: ``grad_fn(params) -> grads`` of the client's loss on that batch.
    """

    client_id: jax.Array
    batch: PyTree
    grad_fn: Callable[[PyTree], PyTree]
