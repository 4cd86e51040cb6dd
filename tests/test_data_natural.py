"""Datasets with natural clients (``fedorth.data.natural``): each reader on small files written
here in the real layouts (TFF's HDF5, FedJAX's SQLite, parquet with a client column), compared
with NumPy; the one-line errors; ``experiments.prepare`` offline; a CLI run with per-client
evaluation."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pathlib
import sqlite3
import subprocess
import sys
import tarfile
import zlib

import msgpack
import numpy as np
import pytest

from fedorth import data as data_lib
from fedorth.data import natural
from tests.test_prepare import run as prepare

REPO = pathlib.Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "ERRORS.md"

needs_h5py = pytest.mark.skipif(
    importlib.util.find_spec("h5py") is None, reason="h5py is not installed (fedorth[tff])"
)
needs_pyarrow = pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None,
    reason="pyarrow is not installed (fedorth[parquet])",
)

# TFF's character list, copied from tff.simulation.baselines.shakespeare
# (char_prediction_preprocessing.CHAR_VOCAB): the test's own reference.
TFF_CHARS = list(
    "dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ\"&*.26:\naeimquyAEIMQUY]!%)-159\r"
)


# ------------------------------------------------------------------------- writers (layouts)


def write_tff_h5(path: pathlib.Path, clients: dict[str, dict[str, np.ndarray]]) -> None:
    """TFF's layout: examples/<client_id>/<feature>, one dataset per feature."""
    import h5py

    with h5py.File(path, "w") as f:
        examples = f.create_group("examples")
        for client_id, features in clients.items():
            group = examples.create_group(client_id)
            for name, values in features.items():
                if values.dtype == object:  # variable-length bytes, as TFF's text files
                    group.create_dataset(name, data=values, dtype=h5py.special_dtype(vlen=bytes))
                else:
                    group.create_dataset(name, data=values)


def _fedjax_ext(x):
    """fedjax.core.serialization's msgpack extensions: 1 ndarray, 4 bytes ndarray."""
    if isinstance(x, np.ndarray) and x.dtype == object:
        payload = msgpack.packb((x.shape, list(x.reshape(-1))), use_bin_type=True)
        return msgpack.ExtType(4, payload)
    if isinstance(x, np.ndarray):
        payload = msgpack.packb((x.shape, x.dtype.name, x.tobytes("C")), use_bin_type=True)
        return msgpack.ExtType(1, payload)
    raise TypeError(type(x))


def write_fedjax_sqlite(path: pathlib.Path, clients: dict[str, dict[str, np.ndarray]]) -> None:
    """FedJAX's table: client_id BLOB, zlib(msgpack(features)) blobs, num_examples."""
    connection = sqlite3.connect(path)
    connection.execute(
        "CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY, data BLOB NOT NULL, "
        "num_examples INTEGER NOT NULL);"
    )
    for client_id, features in clients.items():
        blob = zlib.compress(msgpack.packb(features, default=_fedjax_ext, strict_types=True))
        count = len(next(iter(features.values())))
        connection.execute(
            "INSERT INTO federated_data VALUES (?, ?, ?)", (client_id.encode(), blob, count)
        )
    connection.commit()
    connection.close()


def emnist_clients(rng, sizes: dict[str, int]) -> dict[str, dict[str, np.ndarray]]:
    return {
        cid: {
            "label": rng.integers(0, 62, n).astype(np.int32),
            "pixels": rng.random((n, 28, 28)).astype(np.float32),
        }
        for cid, n in sizes.items()
    }


# Client ids written out of sorted order: TFF's reader sorts them, FedJAX's keeps rowid order.
TRAIN_SIZES = {"f0003_07": 5, "f0001_03": 3, "f0002_11": 4}
TEST_SIZES = {"f0003_07": 2, "f0001_03": 1, "f0002_11": 3}


@pytest.fixture
def emnist_dir(tmp_path):
    rng = np.random.default_rng(0)
    train, test = emnist_clients(rng, TRAIN_SIZES), emnist_clients(rng, TEST_SIZES)
    return tmp_path, train, test


def expected(clients, order):
    x = np.concatenate([clients[c]["pixels"] for c in order])[..., None]
    y = np.concatenate([clients[c]["label"] for c in order])
    owner = np.concatenate([np.full(len(clients[c]["label"]), i) for i, c in enumerate(order)])
    return x, y, owner


@needs_h5py
def test_tff_hdf5_emnist_first_clients_in_sorted_order(emnist_dir):
    directory, train, test = emnist_dir
    write_tff_h5(directory / "fed_emnist_train.h5", train)
    write_tff_h5(directory / "fed_emnist_test.h5", test)
    x_train, y_train, x_test, y_test, meta = natural.load_emnist(data_dir=directory, num_clients=2)
    order = sorted(TRAIN_SIZES)[:2]  # f0001_03, f0002_11
    x, y, owner = expected(train, order)
    np.testing.assert_array_equal(x_train, x)
    np.testing.assert_array_equal(y_train, y)
    np.testing.assert_array_equal(meta["client_ids"], owner)
    assert meta["client_names"] == order
    # The test split pools every test client, in sorted order, and keeps their ids.
    x, y, owner = expected(test, sorted(TEST_SIZES))
    np.testing.assert_array_equal(x_test, x)
    np.testing.assert_array_equal(y_test, y)
    np.testing.assert_array_equal(meta["test_client_ids"], owner)
    assert (x_train.dtype, y_train.dtype, meta["num_classes"]) == (np.float32, np.int32, 62)


def test_fedjax_sqlite_emnist_in_rowid_order(emnist_dir):
    directory, train, test = emnist_dir
    write_fedjax_sqlite(directory / "federated_emnist_train.sqlite", train)
    write_fedjax_sqlite(directory / "federated_emnist_test.sqlite", test)
    x_train, y_train, x_test, _, meta = natural.load_emnist(data_dir=directory)
    order = list(TRAIN_SIZES)  # as inserted
    x, y, owner = expected(train, order)
    np.testing.assert_array_equal(x_train, x)
    np.testing.assert_array_equal(y_train, y)
    np.testing.assert_array_equal(meta["client_ids"], owner)
    assert meta["client_names"] == order
    np.testing.assert_array_equal(x_test, expected(test, list(TEST_SIZES))[0])
    with natural.open_client_file(directory / "federated_emnist_train.sqlite") as f:
        blob = f.read("f0001_03")
    assert blob["pixels"].dtype == np.float32 and blob["pixels"].shape == (3, 28, 28)


def test_load_federated_gives_each_file_client_its_examples(emnist_dir):
    directory, train, test = emnist_dir
    write_fedjax_sqlite(directory / "federated_emnist_train.sqlite", train)
    write_fedjax_sqlite(directory / "federated_emnist_test.sqlite", test)
    fed = data_lib.load_federated(
        "emnist", num_clients=3, partition="natural", seed=0, data_dir=str(directory)
    )
    sizes = np.asarray(fed.client_size)
    np.testing.assert_array_equal(sizes, list(TRAIN_SIZES.values()))
    for i, cid in enumerate(TRAIN_SIZES):
        rows = np.asarray(fed.client_index[i, : sizes[i]])
        np.testing.assert_array_equal(
            np.asarray(fed.x_train)[rows], train[cid]["pixels"][..., None]
        )
    np.testing.assert_array_equal(
        np.asarray(fed.test_client), np.repeat(np.arange(3), list(TEST_SIZES.values()))
    )
    with pytest.raises(
        data_lib.DataConfigError, match="holds 3 clients: set data.num_clients"
    ) as info:
        data_lib.load_federated(
            "emnist", num_clients=4, partition="natural", seed=0, data_dir=str(directory)
        )
    documented(TOO_MANY_CLIENTS, "error: " + str(info.value), directory)
    with pytest.raises(data_lib.DataConfigError, match="set data.partition=natural"):
        data_lib.load_federated(
            "emnist", num_clients=3, partition="iid", seed=0, data_dir=str(directory)
        )


def test_a_validation_fraction_keeps_each_client_its_own_examples(emnist_dir):
    directory, train, test = emnist_dir
    write_fedjax_sqlite(directory / "federated_emnist_train.sqlite", train)
    write_fedjax_sqlite(directory / "federated_emnist_test.sqlite", test)
    fed = data_lib.load_federated(
        "emnist", num_clients=3, partition="natural", seed=1, data_dir=str(directory),
        validation_fraction=0.25,
    )  # fmt: skip
    sizes = np.asarray(fed.client_size)
    assert fed.x_val.shape[0] == 3 and sizes.sum() == 9
    pooled = np.concatenate([train[c]["pixels"] for c in TRAIN_SIZES])[..., None]
    held = {np.asarray(v).tobytes() for v in fed.x_val}
    for i, cid in enumerate(TRAIN_SIZES):
        rows = np.asarray(fed.x_train)[np.asarray(fed.client_index[i, : sizes[i]])]
        own = {p.tobytes() for p in train[cid]["pixels"][..., None]}
        assert {r.tobytes() for r in rows} <= own  # only its own writer's images
        assert len(own - {r.tobytes() for r in rows} - held) == 0  # the rest were held out
    assert len(held | {r.tobytes() for r in np.asarray(fed.x_train)}) == pooled.shape[0]


def tff_shakespeare_reference(snippet: bytes, sequence_length: int) -> list[list[int]]:
    """TFF's to_tokens_and_pad, then batch(sequence_length + 1), written out by hand."""
    pad, oov, bos, eos = 0, len(TFF_CHARS) + 1, len(TFF_CHARS) + 2, len(TFF_CHARS) + 3
    ids = [bos]
    for char in snippet.decode("latin-1"):
        ids.append(TFF_CHARS.index(char) + 1 if char in TFF_CHARS else oov)
    ids.append(eos)
    ids += [pad] * ((-len(ids)) % (sequence_length + 1))
    window = sequence_length + 1
    return [ids[i : i + window] for i in range(0, len(ids), window)]


SNIPPETS = {
    "THE_TEMPEST_MIRANDA": [b"O, I have suffered", b"With those that I saw suffer!~"],
    "HAMLET_HAMLET": [b"To be, or not to be"],
}


@needs_h5py
def test_shakespeare_ids_and_windows_follow_tff(tmp_path):
    clients = {c: {"snippets": np.array(s, dtype=object)} for c, s in SNIPPETS.items()}
    write_tff_h5(tmp_path / "shakespeare_train.h5", clients)
    write_tff_h5(tmp_path / "shakespeare_test.h5", clients)
    x_train, _, _, _, meta = natural.load_shakespeare(data_dir=tmp_path, sequence_length=10)
    reference, owners = [], []
    for i, cid in enumerate(sorted(SNIPPETS)):
        for snippet in SNIPPETS[cid]:
            windows = tff_shakespeare_reference(snippet, 10)
            reference += windows
            owners += [i] * len(windows)
    np.testing.assert_array_equal(x_train, np.asarray(reference, np.int32))
    np.testing.assert_array_equal(meta["client_ids"], owners)
    assert meta["num_classes"] == 90 and meta["task"] == "lm"
    # "!~": '!' is in TFF's list, '~' is not (out of vocabulary, 87), then EOS 89.
    assert TFF_CHARS.index("!") + 1 in x_train and 87 in x_train and 89 in x_train
    default = natural.shakespeare_windows([b"To be"])
    assert default.shape == (1, 81) and default[0, :7].tolist() == [
        88,
        *(TFF_CHARS.index(c) + 1 for c in "To be"),
        89,
    ]


STACK = {
    "00000001": ["how do i sort a list", "use sorted ( ) here"],
    "00000002": ["sort the list in place with list . sort ( ) please now"],
}


STACK_TITLES = {"00000001": ["sort  a list", "sorted"], "00000002": ["in-place sort"]}
STACK_TAGS = {"00000001": ["python|list|sorting", "python"], "00000002": ["list|c++|python"]}
# TFF's stackoverflow.tag_count: a JSON object tag -> users, read most users first.
STACK_TAG_COUNT = {"sorting": 2, "list": 7, "python": 9, "c++": 7}


def stack_clients():
    return {
        cid: {
            "tokens": np.array([t.encode() for t in texts], dtype=object),
            "title": np.array([t.encode() for t in STACK_TITLES[cid]], dtype=object),
            "tags": np.array([t.encode() for t in STACK_TAGS[cid]], dtype=object),
        }
        for cid, texts in STACK.items()
    }


def write_stack_tag_count(folder: pathlib.Path) -> None:
    (folder / "stackoverflow.tag_count").write_text(json.dumps(STACK_TAG_COUNT))


def test_stackoverflow_word_ids_follow_tff(tmp_path):
    write_fedjax_sqlite(tmp_path / "stackoverflow_train.sqlite", stack_clients())
    write_fedjax_sqlite(tmp_path / "stackoverflow_test.sqlite", stack_clients())
    # TFF's stackoverflow.word_count: "word count" lines, most users first.
    (tmp_path / "stackoverflow.word_count").write_text("list 9\nsort 8\n( 7\n) 6\nthe 5\n")
    x, _, _, _, meta = natural.load_stackoverflow(
        data_dir=tmp_path, vocab_size=4, sequence_length=8
    )
    vocab = {"list": 1, "sort": 2, "(": 3, ")": 4}
    oov, bos, eos = 5, 6, 7

    def reference(text):
        words = text.split(" ")[:8]
        ids = [bos, *(vocab.get(w, oov) for w in words)] + ([eos] if len(words) < 8 else [])
        return ids + [0] * (9 - len(ids))

    texts = [t for cid in sorted(STACK) for t in STACK[cid]]
    np.testing.assert_array_equal(x, [reference(t) for t in texts])
    assert meta["num_classes"] == 8 and x[2, -1] != eos  # a long row is cut without EOS


def test_stackoverflow_held_out_users_are_the_validation_split(tmp_path):
    for split in ("train", "test"):
        write_fedjax_sqlite(tmp_path / f"stackoverflow_{split}.sqlite", stack_clients())
    held = {"00000010": {"tokens": np.array([b"sort it", b"list"], dtype=object)}}
    (tmp_path / "stackoverflow.word_count").write_text("list 9\nsort 8\n")
    kwargs = {"vocab_size": 2, "sequence_length": 3, "num_held_out_clients": 1}
    with pytest.raises(data_lib.DatasetNotPreparedError, match="stackoverflow_held_out.h5"):
        data_lib.load_federated(
            "stackoverflow", num_clients=2, partition="natural", seed=0,
            data_dir=str(tmp_path), dataset_kwargs=kwargs,
        )  # fmt: skip
    write_fedjax_sqlite(tmp_path / "stackoverflow_held_out.sqlite", held)
    fed = data_lib.load_federated(
        "stackoverflow", num_clients=2, partition="natural", seed=0,
        data_dir=str(tmp_path), dataset_kwargs=kwargs,
    )  # fmt: skip
    # oov 3, bos 4, eos 5: "sort it" -> [bos, sort, oov, eos]; "list" -> [bos, list, eos, pad]
    np.testing.assert_array_equal(np.asarray(fed.x_val), [[4, 2, 3, 5], [4, 1, 5, 0]])
    assert fed.x_train.shape == (3, 4) and fed.x_test.shape == (3, 4)
    with pytest.raises(data_lib.DataConfigError, match="set one of them to 0"):
        data_lib.load_federated(
            "stackoverflow", num_clients=2, partition="natural", seed=0,
            data_dir=str(tmp_path), dataset_kwargs=kwargs, validation_fraction=0.5,
        )  # fmt: skip


def test_stackoverflow_vocabulary_without_the_count_file_counts_users(tmp_path, caplog):
    write_fedjax_sqlite(tmp_path / "stackoverflow_train.sqlite", stack_clients())
    write_fedjax_sqlite(tmp_path / "stackoverflow_test.sqlite", stack_clients())
    with natural.open_client_file(tmp_path / "stackoverflow_train.sqlite") as f:
        vocab = natural.stackoverflow_vocab(tmp_path, f, list(STACK), 3)
    # Used by both users: "(", ")", "list", "sort"; ties alphabetically.
    assert vocab == {"(": 1, ")": 2, "list": 3}


def tag_reference(vocab: list[str], tags: list[str]):
    """TFF's tag_prediction_preprocessing.build_to_ids_fn transcribed: tokens and title joined
    by a space and split on whitespace, one-hot over the words and one out-of-vocabulary id,
    mean over the words, the last column dropped; tags one-hot summed, the last dropped."""
    texts = [
        (t, title, tag)
        for cid in sorted(STACK)
        for t, title, tag in zip(STACK[cid], STACK_TITLES[cid], STACK_TAGS[cid], strict=True)
    ]
    xs, ys = [], []
    for text, title, tag in texts:
        ids = [vocab.index(w) if w in vocab else len(vocab) for w in f"{text} {title}".split()]
        xs.append(np.eye(len(vocab) + 1)[ids].mean(axis=0)[: len(vocab)])
        labels = [tags.index(t) if t in tags else len(tags) for t in tag.split("|")]
        ys.append(np.eye(len(tags) + 1)[labels].sum(axis=0)[: len(tags)])
    return np.array(xs), np.array(ys)


@needs_h5py
def test_stackoverflow_tags_bag_of_words_and_labels_follow_tff(tmp_path):
    tff, fedjax = tmp_path / "tff", tmp_path / "fedjax"
    for folder, write in ((tff, write_tff_h5), (fedjax, write_fedjax_sqlite)):
        folder.mkdir()
        for split in ("train", "test"):
            write(folder / f"stackoverflow_{split}.{'h5' if folder == tff else 'sqlite'}",
                  stack_clients())  # fmt: skip
        (folder / "stackoverflow.word_count").write_text("list 9\nsort 8\n( 7\n) 6\nthe 5\n")
        write_stack_tag_count(folder)
    a = natural.load_stackoverflow_tags(data_dir=tff, vocab_size=4, tag_vocab_size=3)
    b = natural.load_stackoverflow_tags(data_dir=fedjax, vocab_size=4, tag_vocab_size=3)
    # Tags by users, ties in the file's order: python, list, c++ ("sorting" is dropped).
    x, y = tag_reference(["list", "sort", "(", ")"], ["python", "list", "c++"])
    for loaded in (a, b):
        np.testing.assert_allclose(loaded[0], x, rtol=1e-6)
        np.testing.assert_array_equal(loaded[1], y)
        np.testing.assert_allclose(loaded[2], x, rtol=1e-6)  # the same clients as test file
        assert loaded[0].dtype == loaded[1].dtype == np.float32
        meta = loaded[4]
        assert (meta["task"], meta["num_classes"], meta["name"]) == (
            "multilabel", 3, "stackoverflow_tags",
        )  # fmt: skip
    # Wider vocabularies than the files hold keep the configured shapes, zero-filled.
    wide = natural.load_stackoverflow_tags(data_dir=fedjax, vocab_size=7, tag_vocab_size=6)
    assert wide[0].shape == (3, 7) and wide[1].shape == (3, 6)
    x, y = tag_reference(["list", "sort", "(", ")", "the"], ["python", "list", "c++", "sorting"])
    np.testing.assert_allclose(wide[0][:, :5], x, rtol=1e-6)
    np.testing.assert_array_equal(wide[1][:, :4], y)
    assert not wide[0][:, 5:].any() and not wide[1][:, 4:].any()


def test_stackoverflow_tags_without_the_tag_counts_is_one_line(tmp_path):
    for split in ("train", "test"):
        write_fedjax_sqlite(tmp_path / f"stackoverflow_{split}.sqlite", stack_clients())
    with pytest.raises(data_lib.DatasetNotPreparedError) as info:
        natural.load_stackoverflow_tags(data_dir=tmp_path)
    message = str(info.value)
    assert f"experiments.prepare stackoverflow --data_dir={tmp_path}" in message
    assert "stackoverflow.tag_count.tar.bz2" in message
    documented("`data.name='stackoverflow_tags'` without `stackoverflow.tag_count`", message,
               tmp_path)  # fmt: skip
    (tmp_path / "stackoverflow.tag_count").write_text("python 9\n")  # not TFF's JSON
    with pytest.raises(data_lib.DatasetNotPreparedError) as info:
        natural.load_stackoverflow_tags(data_dir=tmp_path)
    documented("a `stackoverflow.tag_count` that is not a JSON object", str(info.value), tmp_path)
    write_stack_tag_count(tmp_path)
    with pytest.raises(data_lib.DataConfigError) as info:
        natural.load_stackoverflow_tags(data_dir=tmp_path, tag_vocab_size=0)
    documented("`data.dataset_kwargs.tag_vocab_size=0`", str(info.value), tmp_path)


@needs_h5py
def test_stackoverflow_from_tff_hdf5_fixed_length_strings_equals_fedjax_sqlite(tmp_path):
    tff, fedjax = tmp_path / "tff", tmp_path / "fedjax"
    tff.mkdir()
    fedjax.mkdir()
    fixed = {  # TFF's HDF5 text as fixed-length bytes ('S'), FedJAX's as a bytes ndarray
        cid: {k: v.astype(bytes) for k, v in features.items()}
        for cid, features in stack_clients().items()
    }
    for split in ("train", "test"):
        write_tff_h5(tff / f"stackoverflow_{split}.h5", fixed)
        write_fedjax_sqlite(fedjax / f"stackoverflow_{split}.sqlite", stack_clients())
    a = natural.load_stackoverflow(data_dir=tff, vocab_size=5, num_clients=1)
    b = natural.load_stackoverflow(data_dir=fedjax, vocab_size=5, num_clients=1)
    for left, right in zip(a[:4], b[:4], strict=True):
        np.testing.assert_array_equal(left, right)
    assert a[0].shape == (2, 21) and a[4]["client_names"] == ["00000001"]


@needs_h5py
def test_cifar100_pachinko_tff_hdf5(tmp_path):
    rng = np.random.default_rng(2)

    def clients(sizes):
        return {
            str(cid): {
                "coarse_label": rng.integers(0, 20, n).astype(np.int64),
                "image": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
                "label": rng.integers(0, 100, n).astype(np.int64),
            }
            for cid, n in sizes.items()
        }

    # String ids "0".."11" sort as strings: "0", "1", "10", "11", "2", ...
    train, test = clients({i: 2 for i in range(12)}), clients({i: 3 for i in range(2)})
    write_tff_h5(tmp_path / "fed_cifar100_train.h5", train)
    write_tff_h5(tmp_path / "fed_cifar100_test.h5", test)
    x, y, x_test, y_test, meta = natural.load_cifar100_pachinko(data_dir=tmp_path, num_clients=4)
    order = ["0", "1", "10", "11"]
    mean, std = (np.asarray(v, np.float32) for v in data_lib.tfds.IMAGE_STATS["cifar100"])
    images = np.concatenate([train[c]["image"] for c in order]).astype(np.float32)
    np.testing.assert_array_equal(x, (images / np.float32(255.0) - mean) / std)
    np.testing.assert_array_equal(y, np.concatenate([train[c]["label"] for c in order]))
    assert meta["client_names"] == order and y.dtype == np.int32
    assert x_test.shape == (6, 32, 32, 3) and meta["num_classes"] == 100


@pytest.mark.slow  # compiles LLaMA-tiny's evaluations
@needs_h5py
def test_per_client_evaluation_of_a_language_model(tmp_path):
    import jax

    from fedorth.train import builders
    from tests.test_reliability import tiny_config

    clients = {c: {"snippets": np.array(s, dtype=object)} for c, s in SNIPPETS.items()}
    write_tff_h5(tmp_path / "shakespeare_train.h5", clients)
    write_tff_h5(tmp_path / "shakespeare_test.h5", clients)
    config = tiny_config(
        **{
            "data.name": "shakespeare",
            "data.data_dir": str(tmp_path),
            "data.partition": "natural",
            "data.num_clients": 2,
            "data.dataset_kwargs": {"sequence_length": 10},
            "eval_per_client": True,
            "eval_batch_size": 3,
        }
    )
    config.model = {"name": "llama", "size": "tiny"}
    experiment = builders.build(config)
    params, state = experiment.init_params, experiment.init_model_state
    sums = builders.make_client_sums_fn(experiment, 3, lambda batch: batch)
    out = builders.client_metrics(jax.device_get(sums(params, state, experiment.data)))
    test = experiment.data.x_test
    owner = np.asarray(experiment.data.test_client)
    sums_fn = jax.jit(experiment.model.eval_fn)  # one shape: each client's windows by a mask
    losses = []
    for client in range(2):
        mask = (owner == client).astype(np.float32)
        sums = jax.device_get(sums_fn(params, state, {"x": test, "mask": mask}))
        losses.append(sums["loss_sum"] / sums["count"])
    np.testing.assert_allclose(out["test_loss_client_mean"], np.mean(losses), rtol=1e-5)
    np.testing.assert_allclose(out["test_loss_client_std"], np.std(losses), rtol=1e-4)


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_femnist_parquet(path, rows):
    """flwrlabs/femnist's layout: image {bytes, path}, writer_id, character."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "image": [{"bytes": png_bytes(p), "path": None} for p, _, _ in rows],
            "writer_id": [w for _, w, _ in rows],
            "character": [c for _, _, c in rows],
        }
    )
    pq.write_table(table, path)


@needs_pyarrow
def test_parquet_with_a_client_column(tmp_path):
    rng = np.random.default_rng(1)
    writers = ["w9", "w1", "w9", "w5", "w1"]
    rows = [(rng.integers(0, 256, (28, 28), dtype=np.uint8), w, i) for i, w in enumerate(writers)]
    write_femnist_parquet(tmp_path / "train.parquet", rows)
    write_femnist_parquet(tmp_path / "test.parquet", rows[:2])
    x, y, x_test, _, meta = natural.load_parquet(
        data_dir=tmp_path, client_column="writer_id", label_column="character", num_classes=62
    )
    order = [1, 4, 3, 0, 2]  # w1's rows, w5's, w9's; each in file order
    pixels = np.stack([rows[i][0] for i in order]).astype(np.float32)
    np.testing.assert_array_equal(x[..., 0], pixels / np.float32(255.0))
    np.testing.assert_array_equal(y, order)
    assert meta["client_names"] == ["w1", "w5", "w9"]
    np.testing.assert_array_equal(meta["client_ids"], [0, 0, 1, 2, 2])
    assert x.shape == (5, 28, 28, 1) and x_test.shape == (2, 28, 28, 1)
    # Numeric inputs; a test file without the client column is one pooled test client.
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = rng.random((4, 3)).astype(np.float32)
    pq.write_table(
        pa.table({"x": features.tolist(), "user": ["b", "a", "b", "a"], "y": [0, 1, 2, 1]}),
        tmp_path / "numeric.parquet",
    )
    pq.write_table(pa.table({"x": features[:1].tolist(), "y": [2]}), tmp_path / "held.parquet")
    x, y, x_test, y_test, meta = natural.load_parquet(
        data_dir=tmp_path,
        train_file="numeric.parquet",
        test_file="held.parquet",
        client_column="user",
        input_column="x",
        label_column="y",
    )
    np.testing.assert_array_equal(x, features[[1, 3, 0, 2]])
    np.testing.assert_array_equal(y, [1, 1, 0, 2])
    np.testing.assert_array_equal(x_test, features[:1])
    assert meta["num_classes"] == 3 and meta["test_client_names"] == ["all"]
    with pytest.raises(natural.WrongLayoutError) as info:
        natural.load_parquet(data_dir=tmp_path, client_column="user")
    documented(NO_CLIENT_COLUMN, "error: " + str(info.value), tmp_path)
    assert str(info.value) == (
        f"{tmp_path / 'train.parquet'} has no column 'user' naming the client "
        "(data.dataset_kwargs.client_column); its columns: ['image', 'writer_id', 'character']."
    )


# --------------------------------------------------------------------------------- errors

NOT_PREPARED = "`--config.data.name=emnist` with nothing in `$DATA_DIR` (exit code 1)"
NO_EXAMPLES_GROUP = "an HDF5 file without TFF's `examples` group"
NOT_FEDJAX = "an SQLite file without FedJAX's `federated_data` table"
NO_H5PY = "an HDF5 file where h5py is not installed"
NOT_NATURAL = "`data.name='emnist'`, `data.partition='iid'` (exit code 2)"
TOO_MANY_CLIENTS = "`data.num_clients=4` on a file of 3 clients (exit code 2)"
NO_CLIENT_COLUMN = (
    "`data.dataset_kwargs.client_column='user'`, a column the parquet file lacks (exit code 2)"
)
PER_CLIENT_WITHOUT = "`eval_per_client=True` on `data.name='digits'` (exit code 2)"


def row_of(description: str, message: str, directory: pathlib.Path) -> str:
    cell = message.replace(str(directory), "$DATA_DIR").replace("|", "\\|")
    return f"| {description} | {cell.replace(chr(10), '<br>')} |"


def documented(description: str, message: str, directory: pathlib.Path) -> None:
    """The message is one line (after the config checker's "Invalid config:" heading) and is
    in docs/ERRORS.md's section on these datasets."""
    assert len(message.removeprefix("error: Invalid config:\n").splitlines()) == 1, message
    row = row_of(description, message, directory)
    assert row in DOC.read_text(), f"docs/ERRORS.md lacks:\n{row}"


def test_missing_files_are_one_line_naming_the_folder_and_what_to_fetch(tmp_path):
    with pytest.raises(data_lib.DatasetNotPreparedError) as info:
        natural.load_emnist(data_dir=tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message and "fed_emnist_train.h5 and fed_emnist_test.h5" in message
    assert "https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2" in message
    assert f"python -m experiments.prepare emnist --data_dir={tmp_path}" in message
    documented(NOT_PREPARED, "error: " + message, tmp_path)


@needs_h5py
def test_wrong_layouts_are_one_line(tmp_path):
    import h5py

    with h5py.File(tmp_path / "fed_emnist_train.h5", "w") as f:
        f.create_dataset("pixels", data=np.zeros(3))
    with pytest.raises(natural.WrongLayoutError) as info:
        natural.open_client_file(tmp_path / "fed_emnist_train.h5")
    documented(NO_EXAMPLES_GROUP, str(info.value), tmp_path)
    connection = sqlite3.connect(tmp_path / "x.sqlite")
    connection.execute("CREATE TABLE clients (id TEXT)")
    connection.close()
    with pytest.raises(natural.WrongLayoutError) as info:
        natural.open_client_file(tmp_path / "x.sqlite")
    documented(NOT_FEDJAX, str(info.value), tmp_path)


def test_a_missing_package_names_the_extra(tmp_path, monkeypatch):
    real = natural.importlib.import_module

    def without_h5py(name, *args):
        if name == "h5py":
            raise ImportError("No module named 'h5py'")
        return real(name, *args)

    monkeypatch.setattr(natural.importlib, "import_module", without_h5py)
    with pytest.raises(natural.MissingPackageError) as info:
        natural.open_client_file(tmp_path / "fed_emnist_train.h5")
    assert "pip install 'fedorth[tff]'" in str(info.value)
    documented(NO_H5PY, str(info.value), tmp_path)


def config_error(**overrides) -> str:
    from fedorth.train import validate
    from tests.test_reliability import tiny_config

    with pytest.raises(validate.ConfigError) as info:
        validate.validate(tiny_config(**overrides))
    return str(info.value)


def test_a_natural_dataset_needs_the_natural_partition():
    message = config_error(**{"data.name": "emnist", "data.partition": "iid"})
    documented(NOT_NATURAL, "error: " + message, pathlib.Path("/nonexistent"))


# ------------------------------------------------------------------------ prepare, offline


def test_prepare_without_network_is_one_line(tmp_path):
    url = "http://127.0.0.1:9/fed_emnist.tar.bz2"  # the discard port: refused at once
    out = prepare(tmp_path, "emnist", f"--data_dir={tmp_path / 'd'}", f"--url={url}")
    assert out.returncode == 1, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"error: could not download emnist from {url}: "), line
    assert line.endswith(
        f"or fetch {url} by hand and unpack it into {tmp_path / 'd'} (runs "
        "read the files there offline)."
    )


@needs_h5py
def test_prepare_unpacks_tffs_archive_once_then_runs_offline(tmp_path, emnist_dir):
    directory, train, test = emnist_dir
    packed = tmp_path / "packed"
    packed.mkdir()
    write_tff_h5(packed / "fed_emnist_train.h5", train)
    write_tff_h5(packed / "fed_emnist_test.h5", test)
    archive = tmp_path / "fed_emnist.tar.bz2"
    with tarfile.open(archive, "w:bz2") as tar:  # TFF's archive: the .h5 files in a folder
        for name in ("fed_emnist_train.h5", "fed_emnist_test.h5"):
            tar.add(packed / name, arcname=f"datasets/{name}")
    target = tmp_path / "data"
    out = prepare(tmp_path, "emnist", f"--data_dir={target}", f"--url={archive.as_uri()}")
    assert out.returncode == 0 and out.stdout.strip() == f"emnist prepared in {target}.", out
    again = prepare(tmp_path, "emnist", f"--data_dir={target}", "--url=http://127.0.0.1:9/x")
    assert again.stdout.strip() == f"emnist is already prepared in {target}.", again.stderr
    assert sorted(p.name for p in target.iterdir()) == ["fed_emnist_test.h5", "fed_emnist_train.h5"]
    x_train = natural.load_emnist(data_dir=target)[0]
    np.testing.assert_array_equal(x_train, expected(train, sorted(TRAIN_SIZES))[0])


@needs_h5py
def test_prepare_stackoverflow_fetches_the_word_counts_from_beside_the_archive(tmp_path):
    from experiments import prepare as prepare_lib

    mirror, packed = tmp_path / "mirror", tmp_path / "packed"
    mirror.mkdir()
    packed.mkdir()
    fixed = {c: {k: v.astype(bytes) for k, v in f.items()} for c, f in stack_clients().items()}
    for split in ("train", "held_out", "test"):
        write_tff_h5(packed / f"stackoverflow_{split}.h5", fixed)
    (packed / "stackoverflow.word_count").write_text("list 9\nsort 8\n")
    write_stack_tag_count(packed)
    for archive, names in (
        ("stackoverflow.tar.bz2", [f"stackoverflow_{s}.h5" for s in ("train", "held_out", "test")]),
        ("stackoverflow.word_count.tar.bz2", ["stackoverflow.word_count"]),
        ("stackoverflow.tag_count.tar.bz2", ["stackoverflow.tag_count"]),
    ):
        with tarfile.open(mirror / archive, "w:bz2") as tar:
            for name in names:
                tar.add(packed / name, arcname=name)
    target = tmp_path / "data"
    url = (mirror / "stackoverflow.tar.bz2").as_uri()
    assert prepare_lib.prepare("stackoverflow", target, url=url) == (
        f"stackoverflow prepared in {target}."
    )
    x = natural.load_stackoverflow(data_dir=target, vocab_size=2, sequence_length=4)[0]
    # The vocabulary is the word-count file's: "how do i sort" -> bos 4, oov 3 (x3), sort 2.
    assert x[0].tolist() == [4, 3, 3, 3, 2]
    assert (target / "stackoverflow_held_out.h5").is_file()
    # The tag counts too, for tag prediction: "python" (9 users) is label 0.
    y = natural.load_stackoverflow_tags(data_dir=target, vocab_size=2, tag_vocab_size=2)[1]
    assert y[:, 0].all()
    # A folder holding the clients' files fetches only a count file it lacks.
    (target / "stackoverflow.tag_count").unlink()
    (mirror / "stackoverflow.tar.bz2").unlink()
    assert prepare_lib.prepare("stackoverflow", target, url=url).endswith(
        "prepared in " + str(target) + "."
    )
    assert json.loads((target / "stackoverflow.tag_count").read_text()) == STACK_TAG_COUNT


# ---------------------------------------------------------------- per-client evaluation, CLI


def test_per_client_metrics_match_a_client_by_client_evaluation(emnist_dir):
    import jax

    from fedorth.train import builders
    from tests.test_reliability import tiny_config

    directory, train, test = emnist_dir
    write_fedjax_sqlite(directory / "federated_emnist_train.sqlite", train)
    write_fedjax_sqlite(directory / "federated_emnist_test.sqlite", test)
    config = tiny_config(
        **{
            "data.name": "emnist",
            "data.data_dir": str(directory),
            "data.partition": "natural",
            "data.num_clients": 3,
            "eval_per_client": True,
            "eval_batch_size": 4,  # batches cut across clients
        }
    )
    experiment = builders.build(config)
    params, state = experiment.init_params, experiment.init_model_state
    out = builders.make_eval_fn(experiment)(params, state)
    losses, accuracies = [], []
    for cid in TEST_SIZES:  # each writer's test examples on their own, as the model sums them
        batch = {"x": test[cid]["pixels"][..., None], "y": test[cid]["label"]}
        sums = jax.device_get(jax.jit(experiment.model.eval_fn)(params, state, batch))
        losses.append(sums["loss_sum"] / sums["count"])
        accuracies.append(sums["correct"] / sums["count"])
    assert out["test_clients"] == 3
    for name, values in (("loss", losses), ("accuracy", accuracies)):
        np.testing.assert_allclose(out[f"test_{name}_client_mean"], np.mean(values), rtol=1e-5)
        np.testing.assert_allclose(out[f"test_{name}_client_std"], np.std(values), rtol=1e-4)
        np.testing.assert_allclose(
            out[f"test_{name}_client_p10"], np.percentile(values, 10), rtol=1e-5
        )
    with pytest.raises(builders.ConfigError) as info:
        builders.make_eval_fn(builders.build(tiny_config(eval_per_client=True)))
    documented(PER_CLIENT_WITHOUT, "error: " + str(info.value), pathlib.Path("/nonexistent"))


def main(directory: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m experiments.main`` with FedAvg on ``--config.data.name=emnist`` in
    ``directory``: 3 writers, 2 per round, 2 rounds."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.main",
            "--config=configs/fedavg.py",
            f"--workdir={directory / 'run'}",
            "--config.data.name=emnist",
            f"--config.data.data_dir={directory}",
            "--config.data.partition=natural",
            "--config.data.num_clients=3",
            "--config.fed.clients_per_round=2",
            "--config.fed.rounds=2",
            "--config.fed.local_steps=2",
            "--config.fed.batch_size=4",
            "--config.model.hidden_sizes=(16,)",
            "--config.eval_every=1",
            "--config.checkpoint_every=0",
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_bad_files_end_with_one_line(emnist_dir):
    directory, train, test = emnist_dir
    out = main(directory)  # nothing there
    assert out.returncode == 1, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("error: Dataset 'emnist' is not in data.data_dir="), line
    assert "python -m experiments.prepare emnist" in line
    for features in train.values():
        features["image"] = features.pop("pixels")  # a file of another dataset's features
    write_fedjax_sqlite(directory / "federated_emnist_train.sqlite", train)
    write_fedjax_sqlite(directory / "federated_emnist_test.sqlite", test)
    out = main(directory)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert line == (
        f"error: {directory / 'federated_emnist_train.sqlite'}: client 'f0003_07' has no "
        "feature 'pixels' (it has ['image', 'label'])."
    )


@pytest.mark.slow  # a run of 2 rounds in a fresh process
@needs_h5py
def test_cli_run_on_tff_emnist_writes_per_client_metrics(emnist_dir):
    directory, train, test = emnist_dir
    write_tff_h5(directory / "fed_emnist_train.h5", train)
    write_tff_h5(directory / "fed_emnist_test.h5", test)
    workdir = directory / "run"
    out = main(directory, "--config.eval_per_client=True")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["test_clients"] == 3
        assert 0.0 <= row["test_accuracy_client_p10"] <= row["test_accuracy_client_p90"] <= 1.0
        assert np.isfinite(row["test_loss_client_mean"]) and row["test_loss_client_std"] >= 0
    assert "train_loss" in rows[-1]
