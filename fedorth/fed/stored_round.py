"""The round of a client-state store (``fed.client_state`` host or disk): the sampled clients'
rows read before it and written back after it, in background threads (``fedorth.fed.client_store``
describes the stores)."""

from __future__ import annotations

import concurrent.futures
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedorth.fed.client_store import ArrayStore
from fedorth.fed.context import round_clients
from fedorth.fed.disk_store import DiskStore
from fedorth.fed.state import ServerState

PyTree = Any


@jax.jit
def _non_finite(rows):
    return [
        jnp.logical_not(jnp.all(jnp.isfinite(x))) if jnp.issubdtype(x.dtype, jnp.inexact) else False
        for x in rows
    ]


def _shared_rows(ids: np.ndarray, previous: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``ids``: whether the previous round had it, and its position there."""
    if previous is None:
        return np.zeros(len(ids), bool), np.zeros(len(ids), np.int32)
    position = np.searchsorted(previous, ids).clip(0, len(previous) - 1)
    return previous[position] == ids, position.astype(np.int32)


@jax.jit
def _merge_rows(host_rows, device_rows, shared, position):
    def one(h, d):
        mask = shared.reshape(-1, *([1] * (h.ndim - 1)))
        return jnp.where(mask, d[position], h)

    return [one(h, d) for h, d in zip(host_rows, device_rows, strict=True)]


class StoredRoundFn:
    """A round whose clients' states live in a store (``fed.client_state`` ``host`` or
    ``disk``): ``round_fn(server, data) -> (server, metrics)`` with ``server.clients`` None.

    Wraps a round built with ``RoundConfig.client_rows`` (it reads and returns the ``S``
    sampled rows in ``server.clients``). Each call reads the sampled rows (prefetched during the
    previous round), runs the round, and hands its rows to a background writer; :meth:`wait`
    returns once every row has reached the store (the checkpoints call it).
    """

    def __init__(self, inner, store: ArrayStore, num_clients: int, clients_per_round: int):
        self.inner = inner
        self.store = store
        self.num_clients = num_clients
        self.clients_per_round = clients_per_round
        self._reader = concurrent.futures.ThreadPoolExecutor(1, "client-state-read")
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "client-state-write")
        self._pending: concurrent.futures.Future | None = None
        self._prefetch: tuple[int, concurrent.futures.Future] | None = None
        self._previous: tuple[np.ndarray, list] | None = None
        self._key: tuple[np.ndarray, Any] | None = None

    def sampled(self, server: ServerState, round_index: int) -> np.ndarray:
        """The ids round ``round_index`` samples (as the round itself samples them)."""
        return round_clients(server.key, round_index, self.num_clients, self.clients_per_round)

    def _host_key(self, server: ServerState) -> tuple[np.ndarray, Any]:
        # The server's key is the run's (fixed): a host copy, which the round's donation of
        # `server` does not take, draws every round's ids in the reader thread.
        if self._key is None:
            data = np.asarray(jax.device_get(jax.random.key_data(server.key)))
            self._key = (data, jax.random.key_impl(server.key))
        return self._key

    def _sampled_from(self, key: tuple[np.ndarray, Any], round_index: int) -> np.ndarray:
        data, impl = key
        server_key = jax.random.wrap_key_data(data, impl=impl)
        return round_clients(server_key, round_index, self.num_clients, self.clients_per_round)

    def _rows(self, server: ServerState, round_index: int) -> tuple[np.ndarray, list]:
        prefetched = self._prefetch
        self._prefetch = None
        if prefetched is not None and prefetched[0] == round_index:
            ids, host_rows = prefetched[1].result()
        else:
            self.wait()
            ids = self.sampled(server, round_index)
            host_rows, self._previous = self.store.read(ids), None
        previous_ids, previous_rows = self._previous or (None, None)
        shared, position = _shared_rows(ids, previous_ids)
        if shared.any():
            # Clients of the previous round: their rows are still being written; the device has
            # them (the same bytes).
            rows = _merge_rows(host_rows, previous_rows, shared, position)
        else:
            rows = [jnp.asarray(r) for r in host_rows]
        return ids, rows

    def _write(self, ids: np.ndarray, rows: list, round_index: int) -> None:
        host = [np.asarray(x) for x in jax.device_get(rows)]
        flags = jax.device_get(_non_finite(rows))
        if self.store.non_finite is None and any(flags):
            leaf = next(i for i, bad in enumerate(flags) if bad)
            self.store.non_finite = f"client state leaf {leaf} (round {round_index})"
        self.store.write(ids, host, round_index)

    def _arguments(self, server: ServerState) -> tuple[ServerState, np.ndarray, int]:
        round_index = int(server.round)
        ids, rows = self._rows(server, round_index)
        return server.replace(clients=self.store.treedef.unflatten(rows)), ids, round_index

    def _read_after(
        self, pending: concurrent.futures.Future | None, key, round_index: int
    ) -> tuple[np.ndarray, list]:
        # Drawing the ids costs O(N) (a permutation of the N ids): here, beside the round, not
        # before it. The rounds before the one in progress must have reached the store; the one
        # in progress is being written meanwhile, its rows come from the device (_rows).
        ids = self._sampled_from(key, round_index)
        if pending is not None:
            pending.result()
        return ids, self.store.read(ids)

    def __call__(self, server: ServerState, data: PyTree):
        server, ids, round_index = self._arguments(server)
        # The next round's ids, from the run's key (the same every round), drawn and read while
        # this round runs.
        key = self._host_key(server)
        prefetch = self._reader.submit(self._read_after, self._pending, key, round_index + 1)
        new, metrics = self.inner(server, data)  # donates `server`
        rows = jax.tree.leaves(new.clients)
        if self._pending is not None:
            self._pending.result()  # the round before: written
        self._pending = self._writer.submit(self._write, ids, rows, round_index + 1)
        self._previous = (ids, rows)
        self._prefetch = (round_index + 1, prefetch)
        return new.replace(clients=None), metrics

    def wait(self) -> None:
        """Returns once the rows of every round run have been written to the store."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def reset(self) -> None:
        """Forgets the rows in flight (before the store is started again, e.g. on resume)."""
        self.wait()
        if self._prefetch is not None:
            concurrent.futures.wait([self._prefetch[1]])  # its rows are dropped
        self._prefetch = None
        self._previous = None
        self._key = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._reader.shutdown(wait=True)
            self._writer.shutdown(wait=True)
            self.store.close()

    def _with_initial_rows(self, server: ServerState) -> ServerState:
        """``server`` with ``S`` rows of the initial client state (what the round's shapes, its
        measured strategy and its compiled program need; the store may not be started yet)."""
        rows = [
            jnp.broadcast_to(jnp.asarray(x), (self.clients_per_round, *x.shape))
            for x in self.store.template
        ]
        return server.replace(clients=self.store.treedef.unflatten(rows))

    def select(self, server: ServerState, data: PyTree):
        return self.inner.select(self._with_initial_rows(server), data)

    def lower(self, server: ServerState, data: PyTree):
        return self.inner.lower(self._with_initial_rows(server), data)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def make_store(
    kind: str, template: PyTree, num_clients: int, directory: str | pathlib.Path
) -> ArrayStore:
    """The store ``fed.client_state`` names: ``"host"`` or ``"disk"`` (``kind``)."""
    if kind == "host":
        return ArrayStore(template, num_clients)
    return DiskStore(template, num_clients, directory)
