"""Federated datasets: embedded offline defaults, TFDS loaders, partitioners, device-resident data.

Typical use::

    from fedorth import data
    fed = data.load_federated("digits", num_clients=20, partition="dirichlet", seed=0, alpha=0.1)
    batch = data.sample_batch(fed, client, key, batch_size=32)   # inside jit/vmap

Partitioners by name: ``partition_lib.partition(name, labels, num_clients, seed=..., ...)``
(module :mod:`fedorth.data.partition`, registry :data:`PARTITIONERS`).

Datasets by name (:func:`load_dataset`): ``digits`` and ``synthetic`` (embedded, no download),
the TFDS/folder loaders of :mod:`fedorth.data.tfds` (``mnist``, ``fashion_mnist``, ``cifar10``,
``cifar100``, ``glue/sst2``, ``sentiment140``, ``yelp_polarity_reviews``, ``c4``,
``tiny_imagenet``), and the datasets with natural clients of :mod:`fedorth.data.natural`
(``emnist``, ``shakespeare``, ``stackoverflow``, ``stackoverflow_tags``, ``cifar100_pachinko``,
``parquet``), read from TFF's HDF5, FedJAX's SQLite or parquet files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from fedorth.data import embedded, glue, heavy_tailed, natural, tfds
from fedorth.data import partition as partition_lib
from fedorth.data import stream as stream_lib
from fedorth.data.embedded import load_digits, load_synthetic, synthetic
from fedorth.data.federated import (
    DataConfigError,
    FederatedData,
    client_num_examples,
    client_permutation,
    make_federated,
    num_test_batches,
    sample_batch,
    sample_batch_without_replacement,
    test_batch,
    test_batches,
)
from fedorth.data.partition import PARTITIONERS, label_histogram
from fedorth.data.tfds import DatasetNotPreparedError

__all__ = [
    "DATASETS",
    "PARTITIONERS",
    "DataConfigError",
    "DatasetNotPreparedError",
    "FederatedData",
    "client_num_examples",
    "client_permutation",
    "embedded",
    "has_natural_clients",
    "label_histogram",
    "load_dataset",
    "load_digits",
    "load_federated",
    "load_streamed",
    "load_synthetic",
    "make_federated",
    "natural",
    "natural_partition_message",
    "not_streamed_message",
    "num_test_batches",
    "partition_lib",
    "sample_batch",
    "sample_batch_without_replacement",
    "synthetic",
    "test_batch",
    "test_batches",
    "tfds",
    "glue",
]


def _digits(*, data_dir=None, seed: int = 0, **kwargs):
    del data_dir, seed  # embedded, with a fixed split
    return load_digits(**kwargs)


def _synthetic(*, data_dir=None, seed: int = 0, **kwargs):
    del data_dir
    return load_synthetic(seed=seed, **kwargs)


DATASETS: dict[str, Callable[..., Any]] = {
    "digits": _digits,
    "synthetic": _synthetic,
    # Fed minimax (Zhang & Gao): heavy-tailed text
    "zipf_sentiment": heavy_tailed.load_zipf_sentiment,
    **tfds.LOADERS,
    **glue.LOADERS,  # GLUE with subword tokens (glue/sst2 keeps its word vocabulary without)
    **natural.LOADERS,  # writers, roles, users: TFF's HDF5, FedJAX's SQLite, parquet
}


def has_natural_clients(name: str) -> bool:
    """Whether dataset ``name`` has natural clients that its loader reads itself (the first
    ``data.num_clients`` of its files; ``data.partition='natural'``)."""
    return getattr(DATASETS.get(name), "natural_clients", False)


def load_dataset(name: str, *, data_dir=None, seed: int = 0, **kwargs):
    """Load a dataset by name as host arrays.

    Args:
      name: a key of :data:`DATASETS`.
      data_dir: data folder for the TFDS / Tiny ImageNet loaders (ignored by embedded ones).
      seed: NumPy seed (Synthetic's generative draw; subsampling of large datasets). The digits'
        train/test split is fixed and does not depend on it.
      **kwargs: the loader's options (e.g. ``alpha``, ``beta``, ``num_clients`` for synthetic;
        ``vocab_size``, ``max_len``, ``max_train`` for text).

    Returns:
      ``(x_train, y_train, x_test, y_test, meta)``; ``meta`` has at least ``name``,
      ``num_classes`` and ``task`` (``"classification"`` or ``"lm"``, the task names of
      ``fedorth.models``), and ``client_ids`` where the data has natural clients (with
      ``test_client_ids`` where its test split has clients too).
    """
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; valid choices: {sorted(DATASETS)}.")
    return DATASETS[name](data_dir=data_dir, seed=seed, **kwargs)


def load_federated(
    name: str,
    *,
    num_clients: int,
    partition: str = "iid",
    seed: int,
    data_dir=None,
    dataset_kwargs: dict[str, Any] | None = None,
    validation_fraction: float = 0.0,
    **partition_kwargs,
) -> FederatedData:
    """Load a dataset, partition its training split and put it on device.

    Args:
      name: dataset name (see :func:`load_dataset`).
      num_clients: number of clients.
      partition: partitioner name (see :data:`PARTITIONERS`); ``natural`` uses the dataset's
        ``meta["client_ids"]`` unless ``groups`` is given. A dataset whose loader reads its own
        clients (:func:`has_natural_clients`) needs ``natural``: its first ``num_clients``
        clients, in the file's order, are the clients.
      seed: NumPy seed for loading and partitioning.
      data_dir: data folder for the TFDS / Tiny ImageNet loaders.
      dataset_kwargs: options for the loader.
      validation_fraction: the fraction of the training examples held out as a validation
        split (``x_val``, ``y_val``; drawn with ``seed``, before partitioning: no client holds
        them), for choosing hyperparameters without looking at the test split.
      **partition_kwargs: options for the partitioner (``alpha``, ``min_size``, ``ratios``, ...).

    Returns:
      The :class:`FederatedData` (with ``test_client`` where the test split has clients).
    """
    dataset_kwargs = dict(dataset_kwargs or {})
    if has_natural_clients(name):
        if partition != "natural":
            raise DataConfigError(natural_partition_message(name, partition))
        dataset_kwargs["num_clients"] = num_clients
    x_train, y_train, x_test, y_test, meta = load_dataset(
        name, data_dir=data_dir, seed=seed, **dataset_kwargs
    )
    if has_natural_clients(name):
        return _natural_federated(x_train, y_train, x_test, y_test, meta, seed, validation_fraction)
    if partition == "natural" and "groups" not in partition_kwargs:
        if "client_ids" not in meta:
            raise ValueError(
                f"partition='natural' needs per-example client ids; dataset {name!r} has none "
                "(pass groups=...)."
            )
        partition_kwargs["groups"] = meta["client_ids"]
    held_out = None
    if validation_fraction:
        x_train, y_train, held_out = _hold_out(x_train, y_train, validation_fraction, seed)
    labels = np.asarray(y_train)
    if meta.get("task") == "lm":  # no classes: label-based partitions see one
        labels = np.zeros(labels.shape[0], np.int64)
    if num_clients > labels.shape[0]:
        raise DataConfigError(
            f"data.num_clients={num_clients} is more than the {labels.shape[0]} training examples "
            f"of data.name={name!r}: every client needs one; set data.num_clients <= "
            f"{labels.shape[0]}."
        )
    try:
        parts = partition_lib.partition(
            partition, labels, num_clients, seed=seed, **partition_kwargs
        )
    except ValueError as e:  # the partitioner's own check of its options on these labels
        raise DataConfigError(
            f"data.partition={partition!r} (data.partition_kwargs, data.alpha, data.num_clients) "
            f"on data.name={name!r}: {e}"
        ) from None
    empty = [i for i, part in enumerate(parts) if np.size(part) == 0]
    if empty:
        raise DataConfigError(
            f"data.partition={partition!r} left {len(empty)} of {num_clients} clients empty "
            f"(clients {empty[:10]}{', ...' if len(empty) > 10 else ''}) on the "
            f"{labels.shape[0]} examples of data.name={name!r}: lower data.num_clients"
            + (
                f" or raise data.alpha (the Dirichlet concentration, {partition_kwargs['alpha']})"
                if "alpha" in partition_kwargs
                else ""
            )
            + "."
        )
    data = make_federated(
        x_train, y_train, x_test, y_test, parts, meta["name"], meta["num_classes"]
    )
    if held_out is None:
        return data
    x_val, y_val = held_out
    if np.issubdtype(y_val.dtype, np.integer):
        y_val = y_val.astype(np.int32)
    return data.replace(x_val=jnp.asarray(x_val), y_val=jnp.asarray(y_val))


def natural_partition_message(name: str, partition: str) -> str:
    """The one line refusing ``data.partition`` other than ``natural`` for dataset ``name``
    (raised by :func:`load_federated` and by the config checks before anything loads)."""
    return (
        f"data.name={name!r} has natural clients, which data.partition={partition!r} would "
        "ignore: set data.partition=natural (data.num_clients takes the first N clients of its "
        "files, in their order)."
    )


def _natural_federated(x_train, y_train, x_test, y_test, meta, seed, validation_fraction):
    """The loader's clients as they are: client ``i`` holds the examples with
    ``meta["client_ids"] == i``."""
    owners = np.asarray(meta["client_ids"])
    held_out = None
    if "x_val" in meta:
        if validation_fraction:
            raise DataConfigError(
                f"data.validation_fraction={validation_fraction} and the held-out clients of "
                f"data.name={meta['name']!r} (data.dataset_kwargs.num_held_out_clients) both "
                "make a validation split: set one of them to 0."
            )
        held_out = (meta["x_val"], meta["y_val"])
    elif validation_fraction:
        x_train, y_train, held_out, keep = _hold_out(
            x_train, y_train, validation_fraction, seed, with_kept=True
        )
        owners = owners[keep]
    count = len(meta["client_names"])
    order = np.argsort(owners, kind="stable")
    starts = np.searchsorted(owners[order], np.arange(count + 1))
    parts = [order[starts[i] : starts[i + 1]] for i in range(count)]
    empty = [meta["client_names"][i] for i, part in enumerate(parts) if part.size == 0]
    if empty:
        raise DataConfigError(
            f"data.validation_fraction={validation_fraction} held out every example of "
            f"{len(empty)} clients ({empty[:5]}) of data.name={meta['name']!r}: lower it."
        )
    data = make_federated(
        x_train, y_train, x_test, y_test, parts, meta["name"], meta["num_classes"]
    )
    return _with_held_out(data, meta, held_out)


def not_streamed_message(name: str) -> str:
    """The one line refusing ``data.stream=true`` for dataset ``name``, which has no natural
    clients."""
    return (
        f"data.stream=true reads a dataset's clients from its files, and data.name={name!r} "
        f"has no natural clients ({', '.join(natural.LOADERS)} have): set data.stream=auto or "
        "false."
    )


def _with_held_out(data: FederatedData, meta, held_out) -> FederatedData:
    if meta.get("test_client_ids") is not None:
        data = data.replace(test_client=jnp.asarray(meta["test_client_ids"], jnp.int32))
    if held_out is not None:
        x_val, y_val = held_out
        data = data.replace(x_val=jnp.asarray(x_val), y_val=jnp.asarray(y_val))
    return data


def load_streamed(
    name: str,
    *,
    num_clients: int,
    seed: int,
    stream: bool | str = "auto",
    data_dir=None,
    dataset_kwargs: dict[str, Any] | None = None,
    validation_fraction: float = 0.0,
) -> tuple[FederatedData, stream_lib.ClientStream | None]:
    """A dataset with natural clients whose training clients are read per round
    (:mod:`fedorth.data.stream`).

    Args:
      name: a dataset with natural clients (:func:`has_natural_clients`).
      num_clients: its first ``num_clients`` clients, in the file's order.
      seed: NumPy seed of the test subsample.
      stream: ``data.stream`` (``stream.stream_mode``): true streams; ``"auto"`` streams when
        the training examples exceed ``stream.STREAM_ABOVE_BYTES`` and loads them whole
        otherwise; false loads them whole.
      data_dir: the folder holding the files.
      dataset_kwargs: options for the loader.
      validation_fraction: must be 0 when streamed (a held-out fraction of examples needs every
        example); the held-out clients of StackOverflow are a validation split that streams.

    Returns:
      ``(data, stream)``: with a stream, ``data`` is :func:`stream.base_data` (the test split,
      the clients' counts, no training example) and each round reads
      ``stream.round_data(data, ids)``; without, ``data`` is :func:`load_federated`'s and
      ``stream`` is None.
    """
    stream = stream_lib.stream_mode(stream)
    if not has_natural_clients(name):
        raise DataConfigError(not_streamed_message(name))
    kwargs = {**(dataset_kwargs or {}), "num_clients": num_clients, "stream": stream}
    x_train, y_train, x_test, y_test, meta = load_dataset(
        name, data_dir=data_dir, seed=seed, **kwargs
    )
    streamed = meta.get("stream")
    if streamed is None:
        data = _natural_federated(x_train, y_train, x_test, y_test, meta, seed, validation_fraction)
        return data, None
    if validation_fraction:
        streamed.close()
        raise DataConfigError(
            f"data.validation_fraction={validation_fraction} holds out examples of every client, "
            f"which a streamed data.name={name!r} never loads together: set it to 0, or "
            "data.stream=false to load the clients whole."
        )
    data = stream_lib.base_data(streamed, x_test, y_test, meta["name"], meta["num_classes"])
    held_out = (meta["x_val"], meta["y_val"]) if "x_val" in meta else None
    return _with_held_out(data, meta, held_out), streamed


def _hold_out(x_train, y_train, fraction: float, seed: int, *, with_kept: bool = False):
    """``(x_train, y_train, (x_val, y_val))``: a random ``fraction`` of the examples held out
    (``with_kept``: and the indices of the examples kept)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"data.validation_fraction={fraction} must lie in [0, 1).")
    x_train, y_train = np.asarray(x_train), np.asarray(y_train)
    count = x_train.shape[0]
    held = int(round(fraction * count))
    if not 0 < held < count:
        raise ValueError(
            f"data.validation_fraction={fraction} of {count} training examples holds out "
            f"{held}: choose a fraction that leaves both splits non-empty."
        )
    order = np.random.default_rng(seed).permutation(count)
    val, keep = np.sort(order[:held]), np.sort(order[held:])
    if with_kept:
        return x_train[keep], y_train[keep], (x_train[val], y_train[val]), keep
    return x_train[keep], y_train[keep], (x_train[val], y_train[val])
