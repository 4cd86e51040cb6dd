"""A device-resident federated dataset and the batch samplers used inside the compiled round.

The training examples live on device once (``x_train``, ``y_train``); each client is a row of
``client_index`` (indices into ``x_train``, padded with 0) and its true size ``client_size``.
Mini-batches are gathered inside ``jit``/``vmap`` from a PRNG key, so no host transfer happens per
step (docs/ARCHITECTURE.md; docs/CONTRACTS.md, "Federated data").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DataConfigError",
    "FederatedData",
    "client_num_examples",
    "client_permutation",
    "make_federated",
    "num_test_batches",
    "sample_batch",
    "sample_batch_without_replacement",
    "test_batch",
    "test_batches",
]


class DataConfigError(ValueError):
    """``data.*`` values that the loaded data cannot satisfy (one line naming the key and the fix;
    raised by :func:`fedorth.data.load_federated`, which sees the data)."""


@flax.struct.dataclass
class FederatedData:
    """Training examples once on device, clients as padded index rows, and a central test split.

    Attributes:
      x_train: ``[M, ...]`` all training inputs.
      y_train: ``[M, ...]`` training targets (``[M]`` int32 class labels for classification).
      client_index: ``[N, max_size]`` int32 rows of indices into ``x_train``; entries at positions
        ``>= client_size[i]`` are padding (0) and never sampled.
      client_size: ``[N]`` int32 true number of examples of each client (all ``>= 1``); in a
        streamed round ``[S]``, by row (:func:`client_num_examples` reads either by client id).
      x_test: ``[T, ...]`` centralized test inputs.
      y_test: ``[T, ...]`` test targets.
      num_classes: number of classes (vocabulary size for language modelling); static.
      name: dataset name; static.
      frozen_params: parameters every client reads and nobody trains (a LoRA model's frozen
        base, ``fedorth.models.lora``), or None. They live here, once on device beside the
        data, so that they are in no client's or the server's state, optimizer state or upload;
        batches carry them under ``"frozen"``.
      x_val: ``[V, ...]`` validation inputs held out of the training data
        (``data.validation_fraction``; ``load_federated``), or None.
      y_val: ``[V, ...]`` validation targets, or None.
      test_client: ``[T]`` int32 client of each test example where the test split has clients
        (datasets with natural clients, ``fedorth.data.natural``), or None; per-client
        evaluation (``eval_per_client``) groups the test examples by it.
      round_clients: ``[S]`` int32 sorted ids of the clients whose examples this dataset holds
        when it holds one round's sampled clients only (a streamed round,
        ``fedorth.data.stream``): row ``j`` of ``client_index`` is client ``round_clients[j]``;
        None: row ``i`` is client ``i``.
    """

    x_train: jax.Array
    y_train: jax.Array
    client_index: jax.Array
    client_size: jax.Array
    x_test: jax.Array
    y_test: jax.Array
    num_classes: int = flax.struct.field(pytree_node=False)
    name: str = flax.struct.field(pytree_node=False)
    frozen_params: Any = None
    x_val: jax.Array | None = None
    y_val: jax.Array | None = None
    test_client: jax.Array | None = None
    round_clients: jax.Array | None = None

    @property
    def num_clients(self) -> int:
        return self.client_size.shape[0]

    @property
    def max_client_size(self) -> int:
        return self.client_index.shape[1]


def make_federated(
    x_train,
    y_train,
    x_test,
    y_test,
    partition: Sequence[np.ndarray],
    name: str,
    num_classes: int,
) -> FederatedData:
    """Build a :class:`FederatedData` from host arrays and a partition, and put it on device.

    Args:
      x_train: ``[M, ...]`` training inputs.
      y_train: ``[M, ...]`` training targets (integer labels are stored as int32).
      x_test: ``[T, ...]`` test inputs.
      y_test: ``[T, ...]`` test targets.
      partition: one index array into ``x_train`` per client (from :mod:`fedorth.data.partition`);
        every client must be non-empty (an empty client has nothing to sample).
      name: dataset name (static metadata).
      num_classes: number of classes (static metadata).

    Returns:
      The dataset with ``client_index [N, max_size]`` padded with 0 and ``client_size [N]``.
    """
    x_train, y_train = np.asarray(x_train), np.asarray(y_train)
    x_test, y_test = np.asarray(x_test), np.asarray(y_test)
    num_train = x_train.shape[0]
    if y_train.shape[0] != num_train or y_test.shape[0] != x_test.shape[0]:
        raise ValueError(
            f"x and y must have the same leading size: train {x_train.shape} vs {y_train.shape}, "
            f"test {x_test.shape} vs {y_test.shape}."
        )
    if len(partition) < 1:
        raise ValueError("partition must hold at least one client.")
    rows = [np.asarray(p).reshape(-1) for p in partition]
    sizes = np.array([r.size for r in rows], dtype=np.int64)
    empty = np.flatnonzero(sizes == 0)
    if empty.size:
        raise ValueError(
            f"clients {empty[:10].tolist()} are empty ({empty.size} of {len(rows)}); use a "
            "partition option that avoids them (e.g. dirichlet_label_split(min_size=...)) or "
            "fewer clients."
        )
    for i, r in enumerate(rows):
        if not np.issubdtype(r.dtype, np.integer) or r.min() < 0 or r.max() >= num_train:
            raise ValueError(
                f"partition[{i}] must hold integer indices in [0, {num_train}), got dtype "
                f"{r.dtype} and range [{r.min()}, {r.max()}]."
            )
    client_index = np.zeros((len(rows), int(sizes.max())), dtype=np.int32)
    for i, r in enumerate(rows):
        client_index[i, : r.size] = r

    def labels(y):
        return y.astype(np.int32) if np.issubdtype(y.dtype, np.integer) else y

    # device_put copies host arrays without compiling anything (jnp.asarray compiles a copy
    # per shape and dtype: six compilations at a run's start).
    return FederatedData(
        x_train=jax.device_put(x_train),
        y_train=jax.device_put(labels(y_train)),
        client_index=jax.device_put(client_index),
        client_size=jax.device_put(sizes.astype(np.int32)),
        x_test=jax.device_put(x_test),
        y_test=jax.device_put(labels(y_test)),
        num_classes=int(num_classes),
        name=str(name),
    )


def _with_frozen(data: FederatedData, batch: dict[str, Any]) -> dict[str, Any]:
    if data.frozen_params is None:
        return batch
    return {**batch, "frozen": data.frozen_params}


def _row(data: FederatedData, client):
    """The row of ``client_index`` that holds ``client``: the sampled ids of a streamed round
    are sorted, so the row is the id's rank among them."""
    if data.round_clients is None:
        return client
    return jnp.searchsorted(data.round_clients, client).astype(jnp.int32)


def client_num_examples(data: FederatedData, client) -> jax.Array:
    """Client ``client``'s number of examples (``client`` a global id, may be traced): read
    through this, not ``client_size[client]``, whose rows a streamed round orders by rank."""
    return data.client_size[_row(data, client)]


def _gather(data: FederatedData, client, positions) -> dict[str, jax.Array]:
    rows = data.client_index[_row(data, client)][positions]
    return _with_frozen(data, {"x": data.x_train[rows], "y": data.y_train[rows]})


def sample_batch(data: FederatedData, client, key, batch_size: int) -> dict[str, jax.Array]:
    """Sample ``batch_size`` of the client's examples uniformly **with replacement**.

    ``j_b ~ U{0, ..., client_size[client] − 1}`` i.i.d.; the batch is
    ``x_train[client_index[client, j]]``.
    Works with a traced ``client`` (under ``jit`` and ``vmap`` over clients).

    Args:
      data: the dataset.
      client: int32 scalar client id (may be traced).
      key: PRNG key.
      batch_size: static batch size ``B``.

    Returns:
      ``{"x": [B, ...], "y": [B, ...]}``.
    """
    size = client_num_examples(data, client)
    positions = jax.random.randint(key, (batch_size,), 0, size, dtype=jnp.int32)
    return _gather(data, client, positions)


def client_permutation(data: FederatedData, client, key) -> jax.Array:
    """A uniformly random order of the client's real positions, padding last.

    ``jax.random.permutation`` over all ``max_size`` positions, then a stable sort that moves the
    padded positions (``>= client_size``) to the end: the first ``client_size[client]`` entries are
    a uniform random permutation of ``0..client_size−1``.

    Args:
      data: the dataset.
      client: int32 scalar client id (may be traced).
      key: PRNG key (draw it once per round for epoch-style sampling).

    Returns:
      ``[max_size]`` int32 positions into ``client_index[client]``.
    """
    perm = jax.random.permutation(key, data.max_client_size).astype(jnp.int32)
    padded = perm >= client_num_examples(data, client)
    return perm[jnp.argsort(padded, stable=True)]


def sample_batch_without_replacement(
    data: FederatedData, client, key, batch_size: int, *, step=0
) -> dict[str, jax.Array]:
    """Epoch-style batch: slot ``b`` of local step ``k`` is example ``π[(k·B + b) mod n]``.

    ``π`` is :func:`client_permutation` of ``key`` and ``n = client_size[client]``. Pass the **same
    key for every step of a round** and ``step = k``: consecutive steps then walk through one
    random permutation of the client's data, so no example repeats before all ``n`` were used.
    Rule when ``B·(k+1)`` exceeds ``n`` (including ``B > n``): the walk wraps around to the start of
    the same permutation, so over any ``T`` consecutive slots each example appears ``⌊T/n⌋`` or
    ``⌈T/n⌉`` times (a batch with ``B > n`` holds every example ``⌊B/n⌋`` or ``⌈B/n⌉`` times).

    Args:
      data: the dataset.
      client: int32 scalar client id (may be traced).
      key: PRNG key, fixed within a round.
      batch_size: static batch size ``B``.
      step: local step ``k`` within the round (may be traced).

    Returns:
      ``{"x": [B, ...], "y": [B, ...]}``.
    """
    perm = client_permutation(data, client, key)
    slots = jnp.asarray(step, jnp.int32) * batch_size + jnp.arange(batch_size, dtype=jnp.int32)
    return _gather(data, client, perm[slots % client_num_examples(data, client)])


def num_test_batches(data: FederatedData, batch_size: int) -> int:
    """``⌈T/B⌉``: how many fixed-size batches cover the test split."""
    return -(-data.x_test.shape[0] // batch_size)


def test_batch(data: FederatedData, index, batch_size: int) -> dict[str, jax.Array]:
    """Test batch number ``index`` of size ``B``, padded past the end, with a float ``mask``.

    Rows ``index·B + b`` for ``b < B``; rows past the last example repeat the last example and get
    ``mask = 0`` (so a masked sum over batches counts each test example exactly once). ``index``
    may be traced (e.g. in a ``lax.scan`` over :func:`num_test_batches`).

    Args:
      data: the dataset.
      index: batch number in ``[0, num_test_batches)``.
      batch_size: static batch size ``B``.

    Returns:
      ``{"x": [B, ...], "y": [B, ...], "mask": [B] float32}``.
    """
    num_test = data.x_test.shape[0]
    rows = jnp.asarray(index, jnp.int32) * batch_size + jnp.arange(batch_size, dtype=jnp.int32)
    mask = (rows < num_test).astype(jnp.float32)
    rows = jnp.minimum(rows, num_test - 1)
    return _with_frozen(data, {"x": data.x_test[rows], "y": data.y_test[rows], "mask": mask})


def test_batches(data: FederatedData, batch_size: int) -> Iterator[dict[str, jax.Array]]:
    """Iterate the test split in ``⌈T/B⌉`` fixed-size batches (see :func:`test_batch`).

    Args:
      data: the dataset.
      batch_size: batch size ``B`` (every batch has this shape, so one compilation serves all).

    Yields:
      ``{"x", "y", "mask"}`` dicts.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    for index in range(num_test_batches(data, batch_size)):
        yield _test_batch_jit(data, np.int32(index), batch_size)


_test_batch_jit = jax.jit(test_batch, static_argnums=2)


# pytest would otherwise try to collect these as tests when imported into a test module.
test_batch.__test__ = False  # type: ignore[attr-defined]
test_batches.__test__ = False  # type: ignore[attr-defined]
