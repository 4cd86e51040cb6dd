"""The data each round reads: the dataset loaded whole, or a streamed round's sampled clients.

A streamed run (``data.stream``, :mod:`fedorth.data.stream`) knows each round's clients before
the round runs: the round samples them from ``fold_in(server.key, round)``
(``fedorth.fed.context.sample_clients``) and the server's key is fixed for the run. With
``data.prefetch`` the next round's clients are read, and put on the device, in a background
thread while the current round computes; without it, when the round asks for them. Both give
the same arrays.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from fedorth.data import FederatedData
from fedorth.data.stream import ClientStream
from fedorth.fed.context import round_clients

__all__ = ["RoundFeed", "StreamReadError", "round_clients"]


class StreamReadError(RuntimeError):
    """Reading a round's clients failed in the prefetch thread (one line: the round, the file,
    the cause)."""


class _Read(threading.Thread):
    """One round's read, in a daemon thread: a run that stops never waits for it at exit."""

    def __init__(self, read, round_index: int):
        super().__init__(name=f"fedorth-prefetch-round-{round_index}", daemon=True)
        self.read, self.round_index = read, round_index
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.read(self.round_index)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e


class RoundFeed:
    """``feed(round_index) -> FederatedData``: what round ``round_index`` reads.

    Args:
      data: the run's dataset (``Experiment.data``).
      stream: the training clients' stream, or None (``data`` is returned every round).
      key: the server's key (``ServerState.key``).
      num_clients: ``N``.
      clients_per_round: ``S``.
      prefetch: read round ``r + 1``'s clients in a background thread once round ``r``'s
        data was handed out.
      place: puts a round's data where the round reads it (``RoundFn.place``).
      rounds: the run's last round (``fed.rounds``): nothing is prefetched past it.
    """

    def __init__(
        self,
        data: FederatedData,
        stream: ClientStream | None,
        key: jax.Array,
        num_clients: int,
        clients_per_round: int,
        *,
        prefetch: bool = True,
        place=lambda tree: tree,
        rounds: int | None = None,
    ):
        self.data, self.stream = data, stream
        # A copy on the host: the round donates the server state, its key included.
        self._key_data = np.asarray(jax.device_get(jax.random.key_data(key)))
        self._key_impl = jax.random.key_impl(key)
        self._n, self._s = num_clients, clients_per_round
        self._prefetch = prefetch
        self._place = place
        self._rounds = rounds
        self._pending: _Read | None = None
        self._last: tuple[int, FederatedData] | None = None

    def _read(self, round_index: int) -> FederatedData:
        key = jax.random.wrap_key_data(self._key_data, impl=self._key_impl)
        ids = round_clients(key, round_index, self._n, self._s)
        return self._place(self.stream.round_data(self.data, ids))

    def read(self, round_index: int) -> FederatedData:
        """Round ``round_index``'s data, read now (nothing cached or prefetched)."""
        return self.data if self.stream is None else self._read(round_index)

    def _wait(self, read: _Read) -> FederatedData:
        while read.is_alive():
            read.join(0.2)  # short joins: Ctrl-C reaches the main thread while it waits
        if read.error is not None:
            raise self._failed(read.round_index, read.error, in_thread=True) from None
        return read.result

    def _failed(self, round_index: int, error: BaseException, in_thread: bool):
        cause = str(error).splitlines()[0] if str(error) else ""
        where = " in the prefetch thread" if in_thread else ""
        fix = (
            "rerun with --config.data.prefetch=False to read them in the main thread."
            if in_thread
            else "check the file, or rerun with --config.data.stream=false to load it whole."
        )
        return StreamReadError(
            f"reading the clients of round {round_index + 1} from {self.stream.file.path} "
            f"failed{where} ({type(error).__name__}: {cause}); {fix}"
        )

    def __call__(self, round_index: int) -> FederatedData:
        if self.stream is None:
            return self.data
        if self._last is not None and self._last[0] == round_index:
            return self._last[1]
        pending, self._pending = self._pending, None
        if pending is not None:
            data = self._wait(pending)  # also when another round was read: one reader at once
            if pending.round_index != round_index:
                data = None
        else:
            data = None
        if data is None:
            try:
                data = self._read(round_index)
            except Exception as error:  # noqa: BLE001 - one line naming the round and file
                raise self._failed(round_index, error, in_thread=False) from None
        self._last = (round_index, data)
        if self._prefetch and (self._rounds is None or round_index + 1 < self._rounds):
            self._pending = _Read(self._read, round_index + 1)
            self._pending.start()
        return data

    def close(self) -> None:
        """Waits for a read in flight (its error is dropped) and closes the stream's file."""
        if self._pending is not None:
            while self._pending.is_alive():
                self._pending.join(0.2)
            self._pending = None
        if self.stream is not None:
            self.stream.close()
