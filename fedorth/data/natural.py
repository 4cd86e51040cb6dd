"""Federated datasets whose clients are real writers, speaking roles and users.

The field's benchmarks with natural clients ship as files in three layouts, all read here
without TensorFlow:

* **TFF's HDF5** (``tff.simulation.datasets``, read by pfl-research too): a group ``examples``
  holding one group per client, ``examples/<client_id>/<feature>``, each feature a dataset whose
  first axis is the client's examples. Clients are taken in sorted id order, as TFF's
  ``HDF5ClientData`` lists them. Needs ``h5py`` (``pip install 'fedorth[tff]'``).
* **FedJAX's SQLite** (``fedjax.core.sqlite_federated_data``): one table
  ``federated_data(client_id BLOB NOT NULL PRIMARY KEY, data BLOB NOT NULL, num_examples INTEGER
  NOT NULL)``; ``data`` is a zlib-compressed msgpack map from feature name to array, arrays as
  msgpack extension 1 (``(shape, dtype name, C-order bytes)``) and bytes arrays as extension 4
  (``(shape, [bytes, ...])``), the encoding of ``fedjax.core.serialization``. Clients are taken
  in ``rowid`` order, as FedJAX's ``client_ids()`` lists them. Needs only ``msgpack`` (a
  dependency of flax).
* **Parquet with a client column** (flwr-datasets, the Hugging Face hub): one row per example and
  a column naming its client (``writer_id`` for FEMNIST, ``character_id`` for Shakespeare).
  Clients are taken in sorted id order, each client's rows in file order. Needs ``pyarrow``
  (``pip install 'fedorth[parquet]'``).

The datasets (``data.name``), each with ``data.partition='natural'``:

* ``emnist``: EMNIST-62 by writer (3,400 clients; ``only_digits=True``: EMNIST-10, 3,383).
  ``pixels`` float32 ``[n, 28, 28]`` as stored (TFF's convention; FedJAX's ``1 − pixels`` is not
  applied), ``label`` int32 → ``x [M, 28, 28, 1]``, ``y [M]``.
* ``shakespeare``: next-character prediction by speaking role (715 clients). Each ``snippets``
  string becomes ``[BOS] + chars + [EOS]``, padded with 0 to a multiple of 81 and cut into
  windows of 81 ids (``x [M, 81]``: the model reads ``x[:, :-1]`` and predicts ``x[:, 1:]``). Ids
  follow TFF's ``char_prediction_preprocessing``: 0 pad, 1..86 the characters of
  :data:`SHAKESPEARE_CHARS` in that order, 87 out of vocabulary, 88 BOS, 89 EOS (vocabulary 90).
* ``stackoverflow``: next-word prediction by user (342,477 clients). Each ``tokens`` string is
  split on spaces, truncated to 20 words, mapped to ids, prefixed with BOS and followed by EOS
  when shorter than 20, and right-padded with 0 to 21 ids, as TFF's
  ``word_prediction_preprocessing`` does: 0 pad, 1..V the vocabulary, V+1 out of vocabulary,
  V+2 BOS, V+3 EOS (V = ``vocab_size``, 10,000: vocabulary 10,004). The vocabulary is the first
  ``vocab_size`` words of ``stackoverflow.word_count`` in the data folder (TFF's file: words by
  decreasing number of users), or, without that file, the words used by the most loaded training
  clients (ties alphabetically).
* ``stackoverflow_tags``: tag prediction by user, from the same files (TFF's
  ``tag_prediction_preprocessing``): ``tokens`` and ``title`` joined by a space and split on
  whitespace; ``x`` is each word's share of the example's words (out-of-vocabulary words
  counted in the total), over the ``vocab_size`` words of ``stackoverflow.word_count`` (float32
  ``[M, 10000]``, 40 KB an example); ``y`` the multi-hot of the ``|``-separated ``tags`` over the
  ``tag_vocab_size`` tags of TFF's ``stackoverflow.tag_count`` (JSON tag → users, most users
  first; float32 ``[M, 500]``), out-of-vocabulary tags dropped.
* ``cifar100_pachinko``: CIFAR-100 in TFF's Pachinko partition (500 clients of 100 images).
  ``image`` uint8 ``[n, 32, 32, 3]`` normalized as ``cifar100`` (``IMAGE_STATS``), fine ``label``.
* ``parquet``: any parquet files with a client column (``client_column``), an input column
  (images as encoded PNG/JPEG bytes or arrays, or numeric lists) and an integer label column.

The padding id 0 stays in the windows as a target, as in TFF's. A run on ``shakespeare`` or
``stackoverflow`` (``fedorth.train.builders.build_model``) builds its ``task="lm"`` model with
``pad_id=0``: its accuracy leaves the padded targets out, as TFF reports it
(``MaskedCategoricalAccuracy(masked_tokens=[pad])``), and its loss counts them, as TFF's
``SparseCategoricalCrossentropy`` does.

``data.num_clients = N`` takes the first ``N`` clients in the file's order above (every client:
``N`` = the number in the file, which a larger ``N`` names). Only those clients are read. The
test split pools the test file's clients (the first ``num_test_clients``; all by default), and
keeps each example's client, so that ``eval_per_client=True`` reports per-client metrics.
"""

from __future__ import annotations

import functools
import importlib
import io
import json
import pathlib
import sqlite3
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from absl import logging

from fedorth.data.federated import DataConfigError
from fedorth.data.stream import STREAM_ABOVE_BYTES, ClientStream
from fedorth.data.tfds import IMAGE_STATS, DatasetNotPreparedError, images_to_float
from fedorth.data.tfds import resolve_data_dir as _resolve_data_dir

__all__ = [
    "LOADERS",
    "SHAKESPEARE_CHARS",
    "SOURCES",
    "ClientFile",
    "MissingPackageError",
    "WrongLayoutError",
    "load_cifar100_pachinko",
    "load_emnist",
    "load_parquet",
    "load_shakespeare",
    "load_stackoverflow",
    "load_stackoverflow_tags",
    "open_client_file",
    "read_clients",
    "shakespeare_windows",
    "stackoverflow_bag_of_words",
    "stackoverflow_ids",
    "stackoverflow_tag_vocab",
    "stackoverflow_tags_multi_hot",
    "stackoverflow_vocab",
]

EXTRAS = {"h5py": "tff", "pyarrow": "parquet"}


class MissingPackageError(DataConfigError):
    """Reading a file needs an optional package (one line naming the extra)."""


class WrongLayoutError(DataConfigError):
    """A file is not in the layout its reader expects (one line naming the file and the
    layout)."""


def _require(module: str, path: pathlib.Path) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackageError(
            f"reading {path} needs {module}, which is not installed: pip install "
            f"'fedorth[{EXTRAS[module]}]' (or pip install {module})."
        ) from None


# ------------------------------------------------------------------------------------ readers


class ClientFile:
    """A file of per-client examples: ``client_ids()`` in the file's fixed order, ``read(id)``
    the client's features as ``{name: [n, ...] array}``."""

    path: pathlib.Path

    def client_ids(self) -> list[str]:
        raise NotImplementedError

    def read(self, client_id: str) -> Mapping[str, np.ndarray]:
        raise NotImplementedError

    def counts(self, client_ids: Sequence[str]) -> np.ndarray:
        """``[len(client_ids)]`` int64 records per client, from the file's index (no example is
        read)."""
        return np.array([len(next(iter(self.read(c).values()))) for c in client_ids], np.int64)

    def close(self) -> None:
        pass

    def __enter__(self) -> ClientFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _text_array(values) -> np.ndarray:
    """Strings as an object array of ``bytes`` (HDF5 fixed or variable length, Arrow strings)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return out


class HDF5ClientFile(ClientFile):
    """TFF's ``examples/<client_id>/<feature>`` HDF5 layout; clients in sorted id order."""

    def __init__(self, path: pathlib.Path):
        h5py = _require("h5py", path)
        self.path = path
        try:
            self._file = h5py.File(path, "r")
        except OSError as e:
            raise WrongLayoutError(f"{path} is not an HDF5 file ({e}).") from None
        if "examples" not in self._file:
            top = sorted(self._file.keys())
            self._file.close()
            raise WrongLayoutError(
                f"{path} is not in TFF's federated layout: it has no group 'examples' (top "
                f"level: {top[:10]}); TFF's files hold examples/<client_id>/<feature>."
            )
        self._examples = self._file["examples"]

    def client_ids(self) -> list[str]:
        return sorted(self._examples.keys())

    def read(self, client_id: str) -> Mapping[str, np.ndarray]:
        group = self._examples[client_id]
        if not hasattr(group, "keys"):
            raise WrongLayoutError(
                f"{self.path}: examples/{client_id} is a dataset, not a group of features; "
                "TFF's files hold examples/<client_id>/<feature>."
            )
        return _HDF5Features(group)

    def counts(self, client_ids: Sequence[str]) -> np.ndarray:
        out = np.zeros(len(client_ids), np.int64)
        for i, client_id in enumerate(client_ids):
            group = self._examples[client_id]
            for name in group:  # the first feature's length: a dataset's shape is metadata
                out[i] = group[name].shape[0]
                break
        return out


class _HDF5Features(Mapping):
    """A client's features, each read when first used (StackOverflow's clients hold six text
    features, of which next-word prediction reads one)."""

    def __init__(self, group):
        self._group = group

    def __getitem__(self, name: str) -> np.ndarray:
        values = self._group[name][()]
        return _text_array(values.reshape(-1)) if values.dtype.kind in "SOU" else values

    def __iter__(self):
        return iter(self._group.keys())

    def __len__(self) -> int:
        return len(self._group)

    def close(self) -> None:
        self._file.close()


_SQLITE_COLUMNS = ("client_id", "data", "num_examples")
_EXT_NDARRAY, _EXT_NPSCALAR, _EXT_BYTES_NDARRAY = 1, 3, 4


def _msgpack_ext(code: int, data: bytes):
    import msgpack

    if code in (_EXT_NDARRAY, _EXT_NPSCALAR):
        shape, dtype, buffer = msgpack.unpackb(data, raw=True)
        array = np.frombuffer(buffer, dtype=np.dtype(dtype.decode())).reshape(shape)
        return array[()] if code == _EXT_NPSCALAR else array
    if code == _EXT_BYTES_NDARRAY:
        shape, flat = msgpack.unpackb(data, raw=True)
        out = np.empty(len(flat), dtype=object)
        out[:] = flat
        return out.reshape(shape)
    return msgpack.ExtType(code, data)


def decode_fedjax_blob(blob: bytes) -> dict[str, np.ndarray]:
    """A FedJAX client blob: zlib-compressed msgpack of ``{feature: array}``."""
    import msgpack

    return msgpack.unpackb(zlib.decompress(blob), ext_hook=_msgpack_ext, raw=False)


class SQLiteClientFile(ClientFile):
    """FedJAX's ``federated_data`` table; clients in ``rowid`` order."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        # Read by one thread at a time: the round prefetch's (fedorth.data.stream) after the
        # index is built in the caller's.
        self._connection = sqlite3.connect(
            f"file:{path}?mode=ro", uri=True, check_same_thread=False
        )
        try:
            columns = [
                row[1] for row in self._connection.execute("PRAGMA table_info(federated_data)")
            ]
        except sqlite3.DatabaseError as e:
            self._connection.close()
            raise WrongLayoutError(f"{path} is not an SQLite database ({e}).") from None
        if not set(_SQLITE_COLUMNS) <= set(columns):
            tables = [
                row[0]
                for row in self._connection.execute(
                    "SELECT name FROM sqlite_master WHERE type='table'"
                )
            ]
            self._connection.close()
            raise WrongLayoutError(
                f"{path} is not in FedJAX's layout: it needs a table federated_data(client_id, "
                f"data, num_examples), found tables {tables} (federated_data columns: {columns})."
            )

    def client_ids(self) -> list[str]:
        rows = self._connection.execute("SELECT client_id FROM federated_data ORDER BY rowid")
        return [_as_str(row[0]) for row in rows]

    def counts(self, client_ids: Sequence[str]) -> np.ndarray:
        rows = self._connection.execute(
            "SELECT client_id, num_examples FROM federated_data ORDER BY rowid"
        )
        stored = {_as_str(client_id): count for client_id, count in rows}
        return np.array([stored[c] for c in client_ids], np.int64)

    def read(self, client_id: str) -> dict[str, np.ndarray]:
        row = self._connection.execute(
            "SELECT data FROM federated_data WHERE client_id = ?", [client_id.encode()]
        ).fetchone()
        if row is None:  # ids written as TEXT rather than BLOB
            row = self._connection.execute(
                "SELECT data FROM federated_data WHERE client_id = ?", [client_id]
            ).fetchone()
        try:
            return decode_fedjax_blob(row[0])
        except (zlib.error, ValueError, TypeError) as e:
            raise WrongLayoutError(
                f"{self.path}: the data of client {client_id!r} is not a zlib-compressed "
                f"msgpack blob as FedJAX writes ({type(e).__name__}: {e})."
            ) from None

    def close(self) -> None:
        self._connection.close()


def _as_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class ParquetClientFile(ClientFile):
    """One row per example and a client column; clients in sorted id order (``client_column``
    None: every row in one client, ``"all"``).

    ``by_row_group=True`` keeps only an index (each client's row groups and number of rows,
    built from the client column) and reads a client's row groups when the client is read: a
    file too large for memory streams, fastest when each client's rows sit in few row groups
    (a file written sorted by client)."""

    def __init__(self, path: pathlib.Path, client_column: str | None, *, by_row_group=False):
        _require("pyarrow", path)
        parquet = importlib.import_module("pyarrow.parquet")
        self.path = path
        self._cached: tuple[int, Any] | None = None
        try:
            if by_row_group and client_column is not None:
                self._file = parquet.ParquetFile(path)
                names = self._file.schema_arrow.names
            else:
                table = parquet.read_table(path)
                names = table.column_names
        except Exception as e:  # noqa: BLE001 - pyarrow's own errors: not a parquet file
            raise WrongLayoutError(f"{path} is not a parquet file ({e}).") from None
        if client_column is None:
            self._table, self._rows = table, {"all": np.arange(table.num_rows)}
            return
        if client_column not in names:
            raise WrongLayoutError(
                f"{path} has no column {client_column!r} naming the client "
                f"(data.dataset_kwargs.client_column); its columns: {names}."
            )
        self._column = client_column
        if by_row_group:
            self._index_row_groups()
            return
        self._table = table
        owners = np.asarray([_as_str(v) for v in table.column(client_column).to_pylist()])
        ids, inverse = np.unique(owners, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        starts = np.searchsorted(inverse[order], np.arange(ids.size + 1))
        self._rows = {str(cid): order[starts[i] : starts[i + 1]] for i, cid in enumerate(ids)}

    def _index_row_groups(self) -> None:
        groups: dict[str, list[int]] = {}
        sizes: Counter = Counter()
        for group in range(self._file.num_row_groups):
            column = self._file.read_row_group(group, columns=[self._column]).column(0)
            for owner, count in Counter(_as_str(v) for v in column.to_pylist()).items():
                groups.setdefault(owner, []).append(group)
                sizes[owner] += count
        self._groups = {owner: groups[owner] for owner in sorted(groups)}
        self._sizes = sizes
        self._rows = None

    def client_ids(self) -> list[str]:
        return list(self._groups if self._rows is None else self._rows)

    def counts(self, client_ids: Sequence[str]) -> np.ndarray:
        if self._rows is None:
            return np.array([self._sizes[c] for c in client_ids], np.int64)
        return np.array([self._rows[c].size for c in client_ids], np.int64)

    def _row_group(self, group: int):
        if self._cached is None or self._cached[0] != group:
            self._cached = (group, self._file.read_row_group(group))
        return self._cached[1]

    def read(self, client_id: str) -> dict[str, np.ndarray]:
        if self._rows is not None:
            return _parquet_columns(self._table.take(self._rows[client_id]))
        pieces = []
        for group in self._groups[client_id]:
            table = self._row_group(group)
            owners = np.asarray([_as_str(v) for v in table.column(self._column).to_pylist()])
            pieces.append(table.take(np.flatnonzero(owners == client_id)))
        return _parquet_columns(importlib.import_module("pyarrow").concat_tables(pieces))


def _parquet_columns(rows) -> dict[str, np.ndarray]:
    out = {}
    for name in rows.column_names:
        values = rows.column(name).to_pylist()
        if values and isinstance(values[0], dict) and "bytes" in values[0]:
            values = [v["bytes"] for v in values]  # Hugging Face's Image feature
        if values and isinstance(values[0], str | bytes):
            out[name] = _text_array(values)
        else:
            out[name] = np.asarray(values)
    return out


def open_client_file(path, *, client_column: str | None = None) -> ClientFile:
    """A reader for ``path`` by its suffix: ``.h5``/``.hdf5`` (TFF), ``.sqlite``/``.db``
    (FedJAX), ``.parquet`` (a ``client_column`` is then required)."""
    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    if suffix in (".h5", ".hdf5"):
        return HDF5ClientFile(path)
    if suffix in (".sqlite", ".sqlite3", ".db"):
        return SQLiteClientFile(path)
    if suffix == ".parquet":
        if not client_column:
            raise DataConfigError(f"reading {path} needs data.dataset_kwargs.client_column.")
        return ParquetClientFile(path, client_column)
    raise WrongLayoutError(
        f"{path}: unknown federated file type {suffix!r}; fedorth reads TFF's .h5, FedJAX's "
        ".sqlite and .parquet with a client column."
    )


class Split(NamedTuple):
    """Examples pooled over clients: inputs, targets, and each example's client index."""

    x: np.ndarray
    y: np.ndarray
    client: np.ndarray  # [M] int32 index into names
    names: list[str]


def read_clients(
    file: ClientFile,
    to_examples: Callable[[dict[str, np.ndarray]], tuple[np.ndarray, np.ndarray]],
    *,
    num_clients: int | None = None,
    skip_empty: bool = False,
    what: str = "data.num_clients",
) -> Split:
    """The first ``num_clients`` clients of ``file`` (all if None), converted and pooled.

    Args:
      file: an open :class:`ClientFile`.
      to_examples: the client's features → ``(x [n, ...], y [n, ...])``.
      num_clients: how many clients, in the file's order.
      skip_empty: leave out clients with no examples after conversion (test files); otherwise an
        empty client is an error.
      what: the config key that set ``num_clients``, for the error.

    Returns:
      A :class:`Split`.
    """
    ids = _first_ids(file, num_clients, what)
    xs, ys, owners, names = [], [], [], []
    for client_id in ids:
        try:
            x, y = to_examples(file.read(client_id))
        except KeyError as e:
            raise WrongLayoutError(
                f"{file.path}: client {client_id!r} has no feature {e.args[0]!r} (it has "
                f"{sorted(file.read(client_id))})."
            ) from None
        if len(x) == 0:
            if skip_empty:
                continue
            raise DataConfigError(
                f"client {client_id!r} of {file.path} has no examples; lower {what} or "
                "choose a file without empty clients."
            )
        owners.append(np.full(len(x), len(names), np.int32))
        names.append(client_id)
        xs.append(x)
        ys.append(y)
    if not xs:
        raise WrongLayoutError(f"{file.path}: its first {len(ids)} clients hold no examples.")
    return Split(np.concatenate(xs), np.concatenate(ys), np.concatenate(owners), names)


# ------------------------------------------------------------------------- files and sources


class Source(NamedTuple):
    """Where a dataset's files come from."""

    tff_files: tuple[str, str]  # (train, test) in the data folder
    tff_url: str  # the archive holding them
    fedjax_files: tuple[str, str]  # the names fedjax.datasets downloads or builds them as


_TFF = "https://storage.googleapis.com/tff-datasets-public/"

SOURCES: dict[str, Source] = {
    "emnist": Source(
        ("fed_emnist_train.h5", "fed_emnist_test.h5"),
        _TFF + "fed_emnist.tar.bz2",
        ("federated_emnist_train.sqlite", "federated_emnist_test.sqlite"),
    ),
    "emnist_digits": Source(
        ("fed_emnist_digitsonly_train.h5", "fed_emnist_digitsonly_test.h5"),
        _TFF + "fed_emnist_digitsonly.tar.bz2",
        ("federated_emnist_digitsonly_train.sqlite", "federated_emnist_digitsonly_test.sqlite"),
    ),
    "shakespeare": Source(
        ("shakespeare_train.h5", "shakespeare_test.h5"),
        _TFF + "shakespeare.tar.bz2",
        ("shakespeare_train.sqlite", "shakespeare_test.sqlite"),
    ),
    "stackoverflow": Source(
        ("stackoverflow_train.h5", "stackoverflow_test.h5"),
        _TFF + "stackoverflow.tar.bz2",
        ("stackoverflow_train.sqlite", "stackoverflow_test.sqlite"),
    ),
    "cifar100_pachinko": Source(
        ("fed_cifar100_train.h5", "fed_cifar100_test.h5"),
        _TFF + "fed_cifar100.tar.bz2",
        ("federated_cifar100_train.sqlite", "federated_cifar100_test.sqlite"),
    ),
}
STACKOVERFLOW_WORD_COUNT = "stackoverflow.word_count"
STACKOVERFLOW_WORD_COUNT_URL = _TFF + "stackoverflow.word_count.tar.bz2"
STACKOVERFLOW_TAG_COUNT = "stackoverflow.tag_count"
STACKOVERFLOW_TAG_COUNT_URL = _TFF + "stackoverflow.tag_count.tar.bz2"
# The files TFF keeps beside stackoverflow.tar.bz2, fetched by ``experiments.prepare``.
STACKOVERFLOW_COUNT_FILES = (STACKOVERFLOW_WORD_COUNT, STACKOVERFLOW_TAG_COUNT)


def dataset_files(name: str, data_dir) -> tuple[pathlib.Path, pathlib.Path]:
    """The (train, test) files of dataset ``name`` in ``data_dir``: TFF's HDF5 files if both
    are there, else FedJAX's SQLite files.

    Raises:
      DatasetNotPreparedError: neither pair is complete (one line: where it looked, what to
        fetch).
    """
    directory = _resolve_data_dir(data_dir)
    source = SOURCES[name]
    for files in (source.tff_files, source.fedjax_files):
        paths = tuple(directory / f for f in files)
        if all(p.is_file() for p in paths):
            return paths
    dataset = "emnist" if name == "emnist_digits" else name
    raise DatasetNotPreparedError(
        f"Dataset {dataset!r} is not in data.data_dir={str(directory)!r}: looked for "
        f"{' and '.join(source.tff_files)} (TFF) and {' and '.join(source.fedjax_files)} "
        f"(FedJAX). Run `python -m experiments.prepare {dataset} --data_dir={directory}` once "
        f"with network access, or fetch {source.tff_url} and unpack it into {directory}."
    )


# ---------------------------------------------------------------------------- preprocessing


def _emnist_examples(features):
    pixels = np.asarray(features["pixels"], np.float32)
    return pixels[..., None], np.asarray(features["label"]).reshape(-1).astype(np.int32)


# TFF's character vocabulary (tff.simulation.baselines.shakespeare, char_prediction_preprocessing,
# reused from the TFF text-generation tutorial); id = 1 + its position.
SHAKESPEARE_CHARS = (
    "dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ\"&*.26:\naeimquyAEIMQUY]!%)-159\r"
)
SHAKESPEARE_SEQUENCE_LENGTH = 80  # McMahan et al. 2017, as TFF and FedJAX
SHAKESPEARE_OOV = len(SHAKESPEARE_CHARS) + 1
SHAKESPEARE_BOS = len(SHAKESPEARE_CHARS) + 2
SHAKESPEARE_EOS = len(SHAKESPEARE_CHARS) + 3
SHAKESPEARE_VOCAB_SIZE = len(SHAKESPEARE_CHARS) + 4

_CHAR_TABLE = np.full(256, SHAKESPEARE_OOV, np.int32)
for _i, _c in enumerate(SHAKESPEARE_CHARS.encode("ascii")):
    _CHAR_TABLE[_c] = _i + 1


def shakespeare_windows(
    snippets: Iterable[bytes], sequence_length: int = SHAKESPEARE_SEQUENCE_LENGTH
) -> np.ndarray:
    """TFF's Shakespeare next-character examples: ``[M, sequence_length + 1]`` int32 windows.

    Each snippet becomes ``[BOS] + ids + [EOS]``, padded with 0 to a multiple of
    ``sequence_length + 1``; the concatenation is cut into windows of ``sequence_length + 1``
    (TFF's ``char_prediction_preprocessing``: ``to_tokens_and_pad``, then ``batch(81)``). Bytes
    outside :data:`SHAKESPEARE_CHARS` map to the out-of-vocabulary id (TFF looks up single
    bytes, so a multi-byte UTF-8 character gives one such id per byte).
    """
    window = sequence_length + 1
    pieces = []
    for snippet in snippets:
        raw = np.frombuffer(bytes(snippet), np.uint8)
        tokens = np.concatenate([[SHAKESPEARE_BOS], _CHAR_TABLE[raw], [SHAKESPEARE_EOS]])
        pad = (-tokens.size) % window
        pieces.append(np.concatenate([tokens, np.zeros(pad, np.int64)]).astype(np.int32))
    if not pieces:
        return np.zeros((0, window), np.int32)
    return np.concatenate(pieces).reshape(-1, window)


def _shakespeare_examples(features, sequence_length: int):
    windows = shakespeare_windows(features["snippets"], sequence_length)
    return windows, np.full(windows.shape[0], windows.shape[1], np.int32)


STACKOVERFLOW_SEQUENCE_LENGTH = 20  # TFF's DEFAULT_SEQUENCE_LENGTH (Reddi et al. 2021)
STACKOVERFLOW_VOCAB_SIZE = 10000  # TFF's DEFAULT_WORD_VOCAB_SIZE


def stackoverflow_ids(
    tokens: Iterable[bytes],
    vocab: dict[str, int],
    sequence_length: int = STACKOVERFLOW_SEQUENCE_LENGTH,
) -> np.ndarray:
    """TFF's StackOverflow next-word examples: ``[M, sequence_length + 1]`` int32.

    ``vocab`` maps a word to its id ``1..V``; V+1 is out of vocabulary, V+2 BOS, V+3 EOS, 0 pad
    (TFF's ``word_prediction_preprocessing.build_to_ids_fn``): ``[BOS] + ids[:L]``, then EOS
    when fewer than ``L`` words, right-padded with 0 to ``L + 1``.
    """
    size = len(vocab)
    oov, bos, eos = size + 1, size + 2, size + 3
    tokens = list(tokens)
    out = np.zeros((len(tokens), sequence_length + 1), np.int32)
    for row, sentence in enumerate(tokens):
        words = _as_str(sentence).split(" ")[:sequence_length]
        ids = [bos, *(vocab.get(word, oov) for word in words)]
        if len(words) < sequence_length:
            ids.append(eos)
        out[row, : len(ids)] = ids
    return out


def stackoverflow_vocab(data_dir, train: ClientFile, clients: Sequence[str], vocab_size: int):
    """The ``vocab_size`` words of TFF's ``stackoverflow.word_count`` (most users first), or,
    without that file, of the loaded training clients counted the same way (by users)."""
    path = _resolve_data_dir(data_dir) / STACKOVERFLOW_WORD_COUNT
    words: list[str] = []
    if path.is_file():
        with path.open() as f:
            for line in f:
                if len(words) == vocab_size:
                    break
                if line.strip():
                    words.append(line.split()[0])
    else:
        logging.warning(
            "%s is missing: the StackOverflow vocabulary is counted over the %d loaded training "
            "clients (TFF's is over all 342,477; fetch %s into the data folder for it).",
            path,
            len(clients),
            STACKOVERFLOW_WORD_COUNT_URL,
        )
        users = Counter()
        for client_id in clients:
            seen = set()
            for sentence in train.read(client_id)["tokens"]:
                seen.update(_as_str(sentence).split(" "))
            users.update(seen)
        ranked = sorted(users.items(), key=lambda item: (-item[1], item[0]))
        words = [word for word, _ in ranked[:vocab_size]]
    return {word: i + 1 for i, word in enumerate(words)}


STACKOVERFLOW_TAG_VOCAB_SIZE = 500  # TFF's DEFAULT_TAG_VOCAB_SIZE (Reddi et al. 2021)


def stackoverflow_tag_vocab(data_dir, tag_vocab_size: int) -> dict[str, int]:
    """The ``tag_vocab_size`` tags of TFF's ``stackoverflow.tag_count`` (a JSON object tag →
    users), most users first (ties in the file's order, as TFF's ``load_tag_counts`` sorts),
    each mapped to its label index ``0..tag_vocab_size-1``.

    Raises:
      DatasetNotPreparedError: the file is missing or not such a JSON object (one line naming
        the folder and ``experiments.prepare``).
    """
    directory = _resolve_data_dir(data_dir)
    path = directory / STACKOVERFLOW_TAG_COUNT
    fix = (
        f"run `python -m experiments.prepare stackoverflow --data_dir={directory}` once with "
        f"network access, or fetch {STACKOVERFLOW_TAG_COUNT_URL} and unpack it into {directory}."
    )
    if not path.is_file():
        raise DatasetNotPreparedError(
            f"data.name='stackoverflow_tags' reads its labels from {STACKOVERFLOW_TAG_COUNT}, "
            f"which is not in data.data_dir={str(directory)!r}: {fix}"
        )
    try:
        counts = json.loads(path.read_text())
        ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)
    except (ValueError, AttributeError, TypeError) as e:
        raise DatasetNotPreparedError(
            f"{path} is not TFF's tag counts, a JSON object tag -> count ({e}): replace it "
            f"with TFF's, fetched from {STACKOVERFLOW_TAG_COUNT_URL} and unpacked into {directory}."
        ) from None
    return {tag: i for i, (tag, _) in enumerate(ranked[:tag_vocab_size])}


def stackoverflow_bag_of_words(
    tokens: Iterable[bytes],
    titles: Iterable[bytes],
    vocab: dict[str, int],
    size: int | None = None,
) -> np.ndarray:
    """TFF's StackOverflow tag-prediction inputs: ``[M, size]`` float32 (``size`` defaults to
    ``V = len(vocab)``; the columns past ``V`` of a shorter vocabulary stay 0).

    ``vocab`` maps a word to ``1..V`` (:func:`stackoverflow_vocab`). Each example's ``tokens``
    and ``title`` are joined by a space and split on whitespace; feature ``v`` is the number of
    the words that are word ``v``, divided by the number of words, out-of-vocabulary ones
    included (TFF's ``tag_prediction_preprocessing.build_to_ids_fn``: one-hot over V + 1 ids,
    mean over the words, the out-of-vocabulary column dropped). An example without words has
    zero features (TFF's mean over no words is NaN).
    """
    words_known = len(vocab)
    size = words_known if size is None else int(size)
    tokens = list(tokens)
    out = np.zeros((len(tokens), size), np.float32)
    for row, (text, title) in enumerate(zip(tokens, titles, strict=True)):
        words = f"{_as_str(text)} {_as_str(title)}".split()
        ids = np.fromiter((vocab.get(word, words_known + 1) - 1 for word in words), np.int64)
        if ids.size:
            counts = np.bincount(ids, minlength=words_known + 1)[:words_known]
            out[row, :words_known] = (counts / np.float64(ids.size)).astype(np.float32)
    return out


def stackoverflow_tags_multi_hot(
    tags: Iterable[bytes], tag_vocab: dict[str, int], size: int | None = None
) -> np.ndarray:
    """TFF's StackOverflow tag-prediction labels: ``[M, size]`` float32 (``size`` defaults to
    ``T = len(tag_vocab)``), each example's ``|``-separated tags summed as one-hot rows over
    ``tag_vocab`` (indices ``0..T-1``); tags outside it are dropped (TFF's
    ``build_to_ids_fn``)."""
    tags = list(tags)
    out = np.zeros((len(tags), len(tag_vocab) if size is None else int(size)), np.float32)
    for row, value in enumerate(tags):
        for tag in _as_str(value).split("|"):
            index = tag_vocab.get(tag)
            if index is not None:
                out[row, index] += 1.0
    return out


def _cifar100_examples(features):
    images = np.asarray(features["image"], np.uint8)
    return (
        images_to_float(images, *IMAGE_STATS["cifar100"]),
        np.asarray(features["label"]).reshape(-1).astype(np.int32),
    )


# ------------------------------------------------------------------------------------ loaders


def _subsample_test(test: Split, max_test: int | None, seed: int) -> Split:
    if max_test is None or max_test >= test.x.shape[0]:
        return test
    keep = np.sort(np.random.default_rng(seed).choice(test.x.shape[0], max_test, replace=False))
    return test._replace(x=test.x[keep], y=test.y[keep], client=test.client[keep])


def _read_test_subset(file: ClientFile, to_examples, num_clients, max_test: int, seed: int):
    """:func:`_subsample_test` of the pooled test clients without pooling them: the same
    ``max_test`` positions drawn from the file's counts, and only the clients holding them
    read (StackOverflow's 16.6 M test examples are never loaded together)."""
    ids = _first_ids(file, num_clients, "data.dataset_kwargs.num_test_clients")
    counts = file.counts(ids)
    total = int(counts.sum())
    if max_test >= total:
        what = "data.dataset_kwargs.num_test_clients"
        return read_clients(file, to_examples, num_clients=num_clients, skip_empty=True, what=what)
    keep = np.sort(np.random.default_rng(seed).choice(total, max_test, replace=False))
    starts = np.concatenate([[0], np.cumsum(counts)])
    owners = np.searchsorted(starts, keep, side="right") - 1
    rank = np.cumsum(counts > 0) - 1  # a client's index among the non-empty ones
    xs, ys = [], []
    for owner in np.unique(owners).tolist():
        x, y = to_examples(file.read(ids[owner]))
        positions = keep[owners == owner] - starts[owner]
        xs.append(x[positions])
        ys.append(y[positions])
    names = [c for c, n in zip(ids, counts.tolist(), strict=True) if n > 0]
    return Split(np.concatenate(xs), np.concatenate(ys), rank[owners].astype(np.int32), names)


class Selection(NamedTuple):
    """The arguments every natural loader shares: where the files are, which clients, and
    whether the training clients are streamed (``fedorth.data.stream``)."""

    data_dir: Any
    seed: int
    num_clients: int | None
    num_test_clients: int | None
    max_test: int | None
    stream: bool | str = False


def _lm_meta(name: str, vocab_size: int, sequence_length: int) -> dict[str, Any]:
    return {
        "name": name,
        "num_classes": vocab_size,
        "vocab_size": vocab_size,
        "task": "lm",
        "input_shape": (sequence_length,),
    }


def _first_ids(file: ClientFile, num_clients: int | None, what: str) -> list[str]:
    ids = file.client_ids()
    if not ids:
        raise WrongLayoutError(f"{file.path} holds no clients.")
    if num_clients is not None and num_clients > len(ids):
        raise DataConfigError(
            f"{what}={num_clients} but {file.path} holds {len(ids)} clients: set "
            f"{what} <= {len(ids)} (the first N clients in the file's order are used)."
        )
    return ids if num_clients is None else ids[:num_clients]


def _stream(
    file: ClientFile, num_clients, to_examples, mode: bool | str, per_record: bool
) -> ClientStream | None:
    """The training clients as a :class:`ClientStream` when ``mode`` (``data.stream``) says
    so: True, or ``"auto"`` with more than ``STREAM_ABOVE_BYTES`` of examples; else None."""
    if mode is False:
        return None
    ids = _first_ids(file, num_clients, "data.num_clients")
    stream = ClientStream(file, ids, to_examples, per_record=per_record)
    if mode == "auto" and stream.nbytes <= STREAM_ABOVE_BYTES:
        return None
    return stream


def _load(
    source: str,
    to_examples,
    meta: dict[str, Any],
    selection: Selection,
    vocab_fn: Callable[[ClientFile, list[str]], Callable] | None = None,
    per_record: bool = True,
):
    data_dir, seed, num_clients, num_test_clients, max_test, mode = selection
    train_path, test_path = dataset_files(source, data_dir)
    train_file = open_client_file(train_path)
    stream = None
    try:
        if vocab_fn is not None:
            ids = train_file.client_ids()
            to_examples = vocab_fn(train_file, ids[:num_clients] if num_clients else ids)
        stream = _stream(train_file, num_clients, to_examples, mode, per_record)
        if stream is None:
            train = read_clients(train_file, to_examples, num_clients=num_clients)
        with open_client_file(test_path) as test_file:
            if stream is not None and per_record and max_test is not None:
                test = _read_test_subset(test_file, to_examples, num_test_clients, max_test, seed)
            else:
                test = read_clients(
                    test_file,
                    to_examples,
                    num_clients=num_test_clients,
                    skip_empty=True,
                    what="data.dataset_kwargs.num_test_clients",
                )
    except BaseException:
        train_file.close()
        raise
    if stream is None:
        train_file.close()
    else:  # the rounds read the file: the stream closes it
        owners = np.zeros(len(stream.head_x), np.int32)
        train = Split(stream.head_x, stream.head_y, owners, stream.client_ids)
        meta = {**meta, "stream": stream}
    test = _subsample_test(test, max_test, seed)
    return _result(train, test, meta, files=(str(train_path), str(test_path)))


def _result(train: Split, test: Split, meta: dict[str, Any], files):
    meta = {
        **meta,
        "client_ids": train.client,
        "client_names": train.names,
        "test_client_ids": test.client,
        "test_client_names": test.names,
        "natural": True,
        "files": files,
    }
    return train.x, train.y, test.x, test.y, meta


def _natural(fn):
    fn.natural_clients = True  # load_federated passes data.num_clients
    return fn


@_natural
def load_emnist(
    *,
    data_dir=None,
    seed: int = 0,
    num_clients: int | None = None,
    only_digits: bool = False,
    num_test_clients: int | None = None,
    max_test: int | None = None,
    stream: bool | str = False,
):
    """Federated EMNIST by writer: TFF's ``fed_emnist_{train,test}.h5`` or FedJAX's
    ``federated_emnist_{train,test}.sqlite`` (Caldas et al. 2018, "LEAF"; Cohen et al. 2017).

    Args:
      data_dir: the folder holding the files.
      seed: NumPy seed of the optional test subsample.
      num_clients: the first ``num_clients`` writers in the file's order (None: all 3,400).
      only_digits: EMNIST-10 (``fed_emnist_digitsonly_*``) instead of EMNIST-62.
      num_test_clients: pool only the first this many test clients (None: all).
      max_test: keep a uniform random subset of this many pooled test examples.
      stream: read the training clients per round instead of loading them
        (``fedorth.data.stream``; ``"auto"``: when their examples exceed 4 GiB).

    Returns:
      ``(x_train, y_train, x_test, y_test, meta)``: float32 ``[M, 28, 28, 1]`` pixels as stored,
      int32 labels; ``meta["client_ids"]`` each training example's writer index.
    """
    return _load(
        "emnist_digits" if only_digits else "emnist",
        _emnist_examples,
        {
            "name": "emnist",
            "num_classes": 10 if only_digits else 62,
            "task": "classification",
            "input_shape": (28, 28, 1),
        },
        Selection(data_dir, seed, num_clients, num_test_clients, max_test, stream),
    )


@_natural
def load_shakespeare(
    *,
    data_dir=None,
    seed: int = 0,
    num_clients: int | None = None,
    sequence_length: int = SHAKESPEARE_SEQUENCE_LENGTH,
    num_test_clients: int | None = None,
    max_test: int | None = None,
    stream: bool | str = False,
):
    """Federated Shakespeare by speaking role, next-character prediction (McMahan et al. 2017;
    TFF's ``shakespeare_{train,test}.h5`` or FedJAX's ``shakespeare_{train,test}.sqlite``).

    Args:
      data_dir: the folder holding the files.
      seed: NumPy seed of the optional test subsample.
      num_clients: the first ``num_clients`` roles in the file's order (None: all 715).
      sequence_length: characters predicted per window (TFF's 80).
      num_test_clients: pool only the first this many test clients (None: all).
      max_test: keep a uniform random subset of this many pooled test windows.
      stream: read the training clients per round instead of loading them
        (``fedorth.data.stream``; ``"auto"``: when their examples exceed 4 GiB).

    Returns:
      ``(x_train, y_train, x_test, y_test, meta)``: int32 windows ``[M, sequence_length + 1]``
      (:func:`shakespeare_windows`; the ``task="lm"`` input), ``y [M]`` the window length;
      vocabulary :data:`SHAKESPEARE_VOCAB_SIZE` (90).
    """
    return _load(
        "shakespeare",
        functools.partial(_shakespeare_examples, sequence_length=sequence_length),
        _lm_meta("shakespeare", SHAKESPEARE_VOCAB_SIZE, sequence_length),
        Selection(data_dir, seed, num_clients, num_test_clients, max_test, stream),
        per_record=False,  # a client's snippets are cut into a number of windows
    )


@_natural
def load_stackoverflow(
    *,
    data_dir=None,
    seed: int = 0,
    num_clients: int | None = None,
    vocab_size: int = STACKOVERFLOW_VOCAB_SIZE,
    sequence_length: int = STACKOVERFLOW_SEQUENCE_LENGTH,
    num_test_clients: int | None = None,
    max_test: int | None = None,
    stream: bool | str = False,
    num_held_out_clients: int = 0,
):
    """Federated StackOverflow by user, next-word prediction (TFF's
    ``stackoverflow_{train,test}.h5`` or FedJAX's ``stackoverflow_{train,test}.sqlite``; Reddi
    et al. 2021, "Adaptive Federated Optimization", Sec. 5).

    Only the first ``num_clients`` users are read; the 342,477 users' 135.8 M examples do not fit
    one device (pass ``max_test`` too: the test file has 16.6 M examples).

    Args:
      data_dir: the folder holding the files (and ``stackoverflow.word_count``).
      seed: NumPy seed of the optional test subsample.
      num_clients: the first ``num_clients`` users in the file's order.
      vocab_size: the most frequent words kept (TFF's 10,000).
      sequence_length: words per example (TFF's 20).
      num_test_clients: pool only the first this many test clients (None: all).
      max_test: keep a uniform random subset of this many pooled test examples.
      stream: read the training clients per round instead of loading them
        (``fedorth.data.stream``; ``"auto"``: when their examples exceed 4 GiB).
      num_held_out_clients: the first this many users of ``stackoverflow_held_out.h5`` (or
        ``.sqlite``; TFF's users with ``user_id % 10 == 0``, none of them in the training file)
        pooled as the validation split (``val_loss``, ``val_accuracy``); 0: none.

    Returns:
      ``(x_train, y_train, x_test, y_test, meta)``: int32 ids ``[M, sequence_length + 1]``
      (:func:`stackoverflow_ids`), ``y [M]`` the row length; vocabulary ``vocab_size + 4``;
      ``meta["x_val"]``, ``meta["y_val"]`` the held-out users' examples.
    """
    converters = []

    def with_vocab(train_file, clients):
        vocab = stackoverflow_vocab(data_dir, train_file, clients, vocab_size)

        def to_examples(features):
            ids = stackoverflow_ids(features["tokens"], vocab, sequence_length)
            return ids, np.full(ids.shape[0], ids.shape[1], np.int32)

        converters.append(to_examples)
        return to_examples

    out = _load(
        "stackoverflow",
        None,
        _lm_meta("stackoverflow", vocab_size + 4, sequence_length),
        Selection(data_dir, seed, num_clients, num_test_clients, max_test, stream),
        with_vocab,
    )
    return _with_held_out(out, data_dir, converters[0], num_held_out_clients)


def _with_held_out(out, data_dir, to_examples, num_held_out_clients: int):
    """``out`` with the first ``num_held_out_clients`` users of StackOverflow's held-out file
    pooled as the validation split (``meta["x_val"]``, ``meta["y_val"]``)."""
    if num_held_out_clients:
        path = _held_out_file(data_dir)
        with open_client_file(path) as held_out_file:
            held = read_clients(
                held_out_file,
                to_examples,
                num_clients=num_held_out_clients,
                skip_empty=True,
                what="data.dataset_kwargs.num_held_out_clients",
            )
        out[4].update(x_val=held.x, y_val=held.y)
    return out


@_natural
def load_stackoverflow_tags(
    *,
    data_dir=None,
    seed: int = 0,
    num_clients: int | None = None,
    vocab_size: int = STACKOVERFLOW_VOCAB_SIZE,
    tag_vocab_size: int = STACKOVERFLOW_TAG_VOCAB_SIZE,
    num_test_clients: int | None = None,
    max_test: int | None = None,
    stream: bool | str = False,
    num_held_out_clients: int = 0,
):
    """Federated StackOverflow by user, tag prediction from a bag of words (TFF's
    ``create_tag_prediction_task``; Reddi et al. 2021, "Adaptive Federated Optimization",
    Sec. 5 and App. C, "Stack Overflow LR"). Reads the files of ``stackoverflow``.

    Args:
      data_dir: the folder holding the files, ``stackoverflow.word_count`` (the vocabulary;
        without it, the loaded clients' most used words) and ``stackoverflow.tag_count``.
      seed: NumPy seed of the optional test subsample.
      num_clients: the first ``num_clients`` users in the file's order.
      vocab_size: the most frequent words, the input features (TFF's 10,000).
      tag_vocab_size: the most frequent tags, the labels (TFF's 500).
      num_test_clients: pool only the first this many test clients (None: all).
      max_test: keep a uniform random subset of this many pooled test examples.
      stream: read the training clients per round instead of loading them
        (``fedorth.data.stream``; ``"auto"``: when their examples exceed 4 GiB).
      num_held_out_clients: the first this many users of ``stackoverflow_held_out.h5`` (or
        ``.sqlite``) pooled as the validation split; 0: none.

    Returns:
      ``(x_train, y_train, x_test, y_test, meta)``: float32 ``[M, vocab_size]`` word
      frequencies (:func:`stackoverflow_bag_of_words`), float32 ``[M, tag_vocab_size]``
      multi-hot tags (:func:`stackoverflow_tags_multi_hot`); ``meta["task"] = "multilabel"``.
    """
    for key, value in (("vocab_size", vocab_size), ("tag_vocab_size", tag_vocab_size)):
        if int(value) < 1:
            raise DataConfigError(
                f"data.dataset_kwargs.{key}={value} must be >= 1 (TFF's: 10,000 words, 500 tags)."
            )
    dataset_files("stackoverflow", data_dir)  # the clients' files are named first when missing
    tag_vocab = stackoverflow_tag_vocab(data_dir, tag_vocab_size)
    converters = []

    def with_vocab(train_file, clients):
        vocab = stackoverflow_vocab(data_dir, train_file, clients, vocab_size)

        def to_examples(features):
            x = stackoverflow_bag_of_words(features["tokens"], features["title"], vocab, vocab_size)
            return x, stackoverflow_tags_multi_hot(features["tags"], tag_vocab, tag_vocab_size)

        converters.append(to_examples)
        return to_examples

    meta = {
        "name": "stackoverflow_tags",
        "num_classes": int(tag_vocab_size),
        "task": "multilabel",
        "input_shape": (vocab_size,),
    }
    out = _load(
        "stackoverflow",
        None,
        meta,
        Selection(data_dir, seed, num_clients, num_test_clients, max_test, stream),
        with_vocab,
    )
    return _with_held_out(out, data_dir, converters[0], num_held_out_clients)


def _held_out_file(data_dir) -> pathlib.Path:
    directory = _resolve_data_dir(data_dir)
    for name in ("stackoverflow_held_out.h5", "stackoverflow_held_out.sqlite"):
        if (directory / name).is_file():
            return directory / name
    raise DatasetNotPreparedError(
        f"data.dataset_kwargs.num_held_out_clients reads stackoverflow_held_out.h5 (TFF) or "
        f"stackoverflow_held_out.sqlite (FedJAX), neither of which is in {directory}: fetch "
        f"{SOURCES['stackoverflow'].tff_url} (it holds the held-out file) and unpack it there."
    )


@_natural
def load_cifar100_pachinko(
    *,
    data_dir=None,
    seed: int = 0,
    num_clients: int | None = None,
    num_test_clients: int | None = None,
    max_test: int | None = None,
    stream: bool | str = False,
):
    """CIFAR-100 in TFF's Pachinko partition: 500 training clients of 100 images, 100 test
    clients (TFF's ``fed_cifar100_{train,test}.h5`` or FedJAX's
    ``federated_cifar100_{train,test}.sqlite``; Reddi et al. 2021, Sec. 5).

    Args:
      data_dir: the folder holding the files.
      seed: NumPy seed of the optional test subsample.
      num_clients: the first ``num_clients`` clients in the file's order (None: all 500).
      num_test_clients: pool only the first this many test clients (None: all 100).
      max_test: keep a uniform random subset of this many pooled test images.
      stream: read the training clients per round instead of loading them
        (``fedorth.data.stream``; ``"auto"``: when their examples exceed 4 GiB).

    Returns:
      ``(x_train, y_train, x_test, y_test, meta)``: float32 ``[M, 32, 32, 3]`` normalized
      images, int32 fine labels.
    """
    return _load(
        "cifar100_pachinko",
        _cifar100_examples,
        {
            "name": "cifar100_pachinko",
            "num_classes": 100,
            "task": "classification",
            "input_shape": (32, 32, 3),
            "mean_std": IMAGE_STATS["cifar100"],
        },
        Selection(data_dir, seed, num_clients, num_test_clients, max_test, stream),
    )


def _decode_image(value) -> np.ndarray:
    if isinstance(value, bytes):
        from PIL import Image

        with Image.open(io.BytesIO(value)) as image:
            array = np.asarray(image)
    else:
        array = np.asarray(value)
    return array[..., None] if array.ndim == 2 else array


def _parquet_examples(features, input_column: str, label_column: str):
    inputs = features[input_column]
    if inputs.dtype == object and inputs.size and isinstance(inputs[0], bytes):
        x = np.stack([_decode_image(v) for v in inputs])
    else:
        x = np.stack([np.asarray(v) for v in inputs]) if inputs.dtype == object else inputs
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / np.float32(255.0)
    return x.astype(np.float32), np.asarray(features[label_column]).astype(np.int32)


@_natural
def load_parquet(
    *,
    data_dir=None,
    seed: int = 0,
    num_clients: int | None = None,
    train_file: str = "train.parquet",
    test_file: str = "test.parquet",
    client_column: str = "client_id",
    input_column: str = "image",
    label_column: str = "label",
    num_classes: int | None = None,
    num_test_clients: int | None = None,
    max_test: int | None = None,
    stream: bool | str = False,
):
    """A classification dataset from parquet files with a client column (flwr-datasets' and the
    Hugging Face hub's layout, e.g. ``flwrlabs/femnist`` with ``client_column="writer_id"``,
    ``label_column="character"``).

    Inputs: encoded images (PNG/JPEG bytes, or Hugging Face's ``{"bytes", "path"}`` image struct)
    decoded to ``[H, W, C]``, or numeric arrays; uint8 values are scaled to ``[0, 1]``. A test
    file without the client column is pooled as one test client.

    Args:
      data_dir: the folder holding the files.
      seed: NumPy seed of the optional test subsample.
      num_clients: the first ``num_clients`` clients in sorted id order (None: all).
      train_file: the training file, relative to ``data_dir``.
      test_file: the test file, relative to ``data_dir``.
      client_column: the column naming each example's client.
      input_column: the input column.
      label_column: the integer label column.
      num_classes: the number of classes (None: the largest training label + 1).
      num_test_clients: pool only the first this many test clients (None: all).
      max_test: keep a uniform random subset of this many pooled test examples.
      stream: read the training clients per round instead of loading them
        (``fedorth.data.stream``; ``"auto"``: when their examples exceed 4 GiB).

    Returns:
      ``(x_train, y_train, x_test, y_test, meta)``: float32 inputs, int32 labels.
    """
    directory = _resolve_data_dir(data_dir)
    paths = [directory / train_file, directory / test_file]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DatasetNotPreparedError(
            f"Dataset 'parquet' is not in data.data_dir={str(directory)!r}: "
            f"{' and '.join(missing)} missing (data.dataset_kwargs.train_file and test_file "
            "name them; flwr-datasets or the Hugging Face hub provide such files)."
        )
    to_examples = functools.partial(
        _parquet_examples, input_column=input_column, label_column=label_column
    )
    train_file = ParquetClientFile(paths[0], client_column, by_row_group=stream is not False)
    streamed = _stream(train_file, num_clients, to_examples, stream, per_record=True)
    if streamed is None:
        if stream is not False:  # read whole: one pass over the table, not per row group
            train_file = ParquetClientFile(paths[0], client_column)
        train = read_clients(train_file, to_examples, num_clients=num_clients)
    else:
        owners = np.zeros(len(streamed.head_x), np.int32)
        train = Split(streamed.head_x, streamed.head_y, owners, streamed.client_ids)
    _require("pyarrow", paths[1])
    schema = importlib.import_module("pyarrow.parquet").read_schema(paths[1])
    test = read_clients(
        ParquetClientFile(paths[1], client_column if client_column in schema.names else None),
        to_examples,
        num_clients=num_test_clients,
        skip_empty=True,
        what="data.dataset_kwargs.num_test_clients",
    )
    test = _subsample_test(test, max_test, seed)
    if num_classes:
        classes = int(num_classes)
    elif streamed is None:
        classes = int(train.y.max()) + 1
    else:
        raise DataConfigError(
            "data.dataset_kwargs.num_classes is needed to stream a parquet dataset (the "
            "largest label is not known before every client is read): set it, or "
            "data.stream=false."
        )
    meta = {"name": "parquet", "num_classes": classes, "task": "classification"}
    if streamed is not None:
        meta["stream"] = streamed
    meta["input_shape"] = train.x.shape[1:]
    return _result(train, test, meta, files=tuple(map(str, paths)))


LOADERS: dict[str, Callable[..., Any]] = {
    "emnist": load_emnist,
    "shakespeare": load_shakespeare,
    "stackoverflow": load_stackoverflow,
    "stackoverflow_tags": load_stackoverflow_tags,
    "cifar100_pachinko": load_cifar100_pachinko,
    "parquet": load_parquet,
}
