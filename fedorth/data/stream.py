"""Training clients read per round, for datasets with natural clients too large to load whole.

A :class:`ClientStream` keeps an index of the training clients (their ids and example counts,
``O(N)``) and an open reader of their file (``fedorth.data.natural``: TFF's HDF5 read one
group per client, FedJAX's SQLite one row per client, parquet by row groups). A round's data
(:meth:`ClientStream.round_data`) holds the ``S`` sampled clients' examples only, each padded
to the largest client's count ``max_size``: ``x_train [S * max_size, ...]`` with
``client_index [S, max_size]``, ``client_size [S]`` and ``round_clients [S]`` (their ids), a
fixed shape every round, so the round compiles once. Mini-batches are drawn inside the
compiled round exactly as for data loaded whole (``fedorth.data.sample_batch`` reads the
client's row by its rank among the sorted sampled ids), so a streamed run equals the run on
the same clients loaded whole, bit for bit.

Memory: the host and the device hold ``O(S × max_size)`` examples per round (two rounds while
the next one is prefetched, ``fedorth.train.feed``), plus the index, ``O(N)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from fedorth.data.federated import DataConfigError, FederatedData, make_federated

__all__ = ["STREAM_ABOVE_BYTES", "STREAM_MODES", "ClientStream", "base_data", "stream_mode"]

# data.stream="auto" streams a natural dataset whose training examples take more than this
# (as the arrays the round reads: float32 pixels, int32 ids) and loads smaller ones whole.
STREAM_ABOVE_BYTES = 4 << 30
STREAM_MODES = ("auto", "true", "false")


def stream_mode(value) -> bool | str:
    """``data.stream`` as ``"auto"``, True or False (from ``"auto"``, ``"true"``, ``"false"`` in
    any case, or a bool).

    Raises:
      DataConfigError: any other value (one line naming the key and its values).
    """
    if isinstance(value, bool):
        return value
    mode = str(value).lower()
    if mode not in STREAM_MODES:
        raise DataConfigError(
            f"data.stream={value!r}; valid: auto, true, false (true reads each round's sampled "
            "clients from a natural dataset's files, false loads every client, auto streams "
            "above 4 GiB of training examples)."
        )
    return "auto" if mode == "auto" else mode == "true"


def _labels(y: np.ndarray) -> np.ndarray:
    return y.astype(np.int32) if np.issubdtype(y.dtype, np.integer) else y


class ClientStream:
    """A natural dataset's training clients, read by id when a round samples them.

    Args:
      file: an open ``fedorth.data.natural.ClientFile`` (owned by the stream from here on:
        :meth:`close` closes it).
      client_ids: the training clients, in the order that numbers them ``0..N-1``.
      to_examples: the client's features → ``(x [n, ...], y [n])``.
      per_record: whether ``to_examples`` gives one example per stored record (EMNIST,
        StackOverflow, CIFAR-100, parquet): the counts are then the file's index
        (``ClientFile.counts``), read without reading any example; otherwise (Shakespeare's
        windows) every client is converted once to count its examples, one at a time.
      what: the config key that set the number of clients, for the error on an empty client.

    Attributes:
      counts: ``[N]`` int32 examples per client.
      max_size: the largest count: every client of a round is padded to it.
      reads: how many clients were read to build rounds (the index and the first examples
        are not counted).
    """

    def __init__(
        self,
        file,
        client_ids: Sequence[str],
        to_examples: Callable[[Any], tuple[np.ndarray, np.ndarray]],
        *,
        per_record: bool,
        what: str = "data.num_clients",
    ):
        self.file = file
        self.client_ids = list(client_ids)
        self._to_examples = to_examples
        self.reads = 0
        if per_record:
            counts = file.counts(self.client_ids)
        else:
            counts = [len(self._convert(c)[0]) for c in self.client_ids]
        self.counts = np.asarray(counts, np.int64).astype(np.int32)
        empty = np.flatnonzero(self.counts == 0)
        if empty.size:
            raise DataConfigError(
                f"client {self.client_ids[empty[0]]!r} of {file.path} has no examples; lower "
                f"{what} or choose a file without empty clients."
            )
        self.max_size = int(self.counts.max())
        self.head_x, self.head_y = self._head()
        self.reads = 0

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    @property
    def num_examples(self) -> int:
        return int(self.counts.sum(dtype=np.int64))

    @property
    def example_bytes(self) -> int:
        """Bytes of one example as the round reads it (input and target)."""
        return self.head_x[0].nbytes + self.head_y[0].nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of every training example loaded whole."""
        return self.num_examples * self.example_bytes

    def _convert(self, client_id: str) -> tuple[np.ndarray, np.ndarray]:
        features = self.file.read(client_id)
        try:
            x, y = self._to_examples(features)
        except KeyError as e:
            raise DataConfigError(
                f"{self.file.path}: client {client_id!r} has no feature {e.args[0]!r} (it has "
                f"{sorted(features)})."
            ) from None
        return np.asarray(x), _labels(np.asarray(y))

    def _head(self) -> tuple[np.ndarray, np.ndarray]:
        """The first two training examples in the pooled order (what a model is initialized
        on, as for the data loaded whole)."""
        xs, ys, count = [], [], 0
        for client_id in self.client_ids:
            x, y = self._convert(client_id)
            xs.append(x[: 2 - count])
            ys.append(y[: 2 - count])
            count += len(xs[-1])
            if count == 2 or count == self.num_examples:
                break
        return np.concatenate(xs), np.concatenate(ys)

    def read(self, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(x [S * max_size, ...], y [S * max_size, ...])``: client ``clients[j]``'s examples
        at rows ``j * max_size ..``, zeros after them."""
        clients = np.asarray(clients)
        width = self.max_size
        x = np.zeros((clients.size * width, *self.head_x.shape[1:]), self.head_x.dtype)
        y = np.zeros((clients.size * width, *self.head_y.shape[1:]), self.head_y.dtype)
        for j, client in enumerate(clients.tolist()):
            cx, cy = self._convert(self.client_ids[client])
            if len(cx) != self.counts[client]:
                raise DataConfigError(
                    f"{self.file.path}: client {self.client_ids[client]!r} holds {len(cx)} "
                    f"examples, its index {self.counts[client]}: the file changed while it was "
                    "read; rerun on a file no process writes."
                )
            x[j * width : j * width + len(cx)] = cx
            y[j * width : j * width + len(cy)] = cy
            self.reads += 1
        return x, y

    def round_data(self, base: FederatedData, clients: np.ndarray) -> FederatedData:
        """``base`` (:func:`base_data`) holding the training examples of ``clients`` (sorted
        int ids) only, on the device."""
        clients = np.asarray(clients, np.int32)
        x, y = self.read(clients)
        index = np.arange(clients.size * self.max_size, dtype=np.int32)
        return base.replace(
            x_train=jnp.asarray(x),
            y_train=jnp.asarray(y),
            client_index=jnp.asarray(index.reshape(clients.size, self.max_size)),
            client_size=jnp.asarray(self.counts[clients]),
            round_clients=jnp.asarray(clients),
        )

    def close(self) -> None:
        self.file.close()


def base_data(stream: ClientStream, x_test, y_test, name: str, num_classes: int) -> FederatedData:
    """The dataset of a streamed run outside its rounds: the test split on the device, every
    client's count (``client_size [N]``), no client's examples (``client_index [0,
    max_size]``), and the first two training examples as ``x_train`` (model initialization)."""
    head = make_federated(
        stream.head_x,
        stream.head_y,
        x_test,
        y_test,
        [np.arange(len(stream.head_x))],
        name,
        num_classes,
    )
    return head.replace(
        client_index=jnp.zeros((0, stream.max_size), jnp.int32),
        client_size=jnp.asarray(stream.counts),
    )
