"""TFDS loaders without TensorFlow: a real prepared array_record dataset, tfds.testing.mock_data
(which patches ``builder.as_data_source`` in tfds 4.9.10, so the loaders run unchanged), the
conversions, the missing-dataset error, and Tiny ImageNet from a fake extracted folder."""

import subprocess

import numpy as np
import PIL.Image
import pytest
import tensorflow_datasets as tfds
from reliability_helpers import MISSING_DATA, REPO, assert_documented, cli, missing_data_message
from tensorflow_datasets.image_classification import mnist

from fedorth import data
from fedorth.data import tfds as T

USE_CODE = tfds.testing.MockPolicy.USE_CODE


# ------------------------------------------------------------------------ conversion functions


def test_tokenize_golden():
    assert T.tokenize("It's GREAT, isn't it?  Yes!!") == [
        "it's", "great", ",", "isn't", "it", "?", "yes", "!", "!",
    ]  # fmt: skip


def test_build_vocab_and_encode():
    texts = ["b a c", "a b", "a d d", "e"]
    vocab = T.build_vocab(texts, 5)
    # Counts a:3, b:2, d:2, c:1, e:1 → top 3 words with ties broken alphabetically; 0/1 reserved.
    assert vocab == {"a": 2, "b": 3, "d": 4}
    ids = T.encode_texts(["a c b d", "d", "a b a b a"], vocab, 4)
    np.testing.assert_array_equal(ids, [[2, 1, 3, 4], [4, 0, 0, 0], [2, 3, 2, 3]])
    assert ids.dtype == np.int32
    with pytest.raises(ValueError, match="vocab_size"):
        T.build_vocab(texts, 2)


def test_byte_tokenizer_round_trip():
    text = "naïve café — ok"
    ids = T.byte_encode(text)
    assert ids[-1] == T.BYTE_EOS and ids.dtype == np.int32
    assert ids.size == len(text.encode("utf-8")) + 1 and ids.max() == T.BYTE_EOS
    assert T.byte_decode(ids) == text


def test_images_to_float_matches_float64():
    images = np.random.default_rng(0).integers(0, 256, (4, 5, 5, 3), dtype=np.uint8)
    mean, std = T.IMAGE_STATS["cifar10"]
    expected = (images.astype(np.float64) / 255 - np.array(mean)) / np.array(std)
    got = T.images_to_float(images, mean, std)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="uint8"):
        T.images_to_float(images.astype(np.float32), mean, std)
    with pytest.raises(ValueError, match="one entry per channel"):
        T.images_to_float(images, (0.5,), (0.5,))


# -------------------------------------------------------------- missing data: a helpful error


@pytest.mark.parametrize("name", ["mnist", "glue/sst2", "c4"])
def test_missing_dataset_error_names_dataset_dir_and_command(name, tmp_path):
    with pytest.raises(data.DatasetNotPreparedError) as info:
        data.load_dataset(name, data_dir=tmp_path)
    message = str(info.value)
    assert repr(name) in message and str(tmp_path) in message
    assert f"tfds build {name} --data_dir={tmp_path} --file_format=array_record" in message
    assert "download_and_prepare()" in message and f"data.data_dir='{tmp_path}'" in message
    # The command line's keys, and no embedded dataset a config might not take (the minimax
    # configs run on zipf_sentiment, not digits): a config's default preset is the way.
    assert "pass --config.data.data_dir=DIR" in message and "digits" not in message
    assert message.endswith(T.NO_DOWNLOAD)
    assert isinstance(info.value, FileNotFoundError)


def test_missing_tiny_imagenet_error(tmp_path):
    with pytest.raises(data.DatasetNotPreparedError, match="tiny-imagenet-200") as info:
        data.load_dataset("tiny_imagenet", data_dir=tmp_path)
    assert str(info.value).endswith(f"pass --config.data.data_dir=DIR. {T.NO_DOWNLOAD}")


def test_cli_missing_dataset_is_a_clear_error_without_traceback(tmp_path):
    data_dir = tmp_path / "tfds"
    args = ["--config.data.name=cifar10", f"--config.data.data_dir={data_dir}"]
    out = subprocess.run(cli(tmp_path / "w", *args), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    expected = missing_data_message(data_dir)
    assert expected in out.stderr, out.stderr
    for needed in ("'cifar10'", str(data_dir), f"tfds build cifar10 --data_dir={data_dir}"):
        assert needed in expected
    assert_documented(MISSING_DATA, expected, tmp_path)


# --------------------------------------------------- a real prepared array_record dataset


def _fake_image(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, (28, 28), dtype=np.uint8)


class _FakeMnist(mnist.MNIST, skip_registration=True):
    """MNIST's real builder and features, with 7 + 3 generated images instead of the download.

    Prepared into ``data_dir/mnist/3.0.1`` as array_record, it is read by the unchanged loader
    through TFDS's real (unmocked) data source; PIL images are encoded without TensorFlow.
    """

    name = "mnist"

    def _split_generators(self, dl_manager):
        del dl_manager
        return {
            "train": self._generate_examples(range(7)),
            "test": self._generate_examples([7, 8, 9]),
        }

    def _generate_examples(self, indices):
        for i in indices:
            yield i, {"image": PIL.Image.fromarray(_fake_image(i)), "label": i}


@pytest.fixture(scope="module")
def prepared_mnist(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    _FakeMnist(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return data_dir


def test_prepared_array_record_is_read_without_mocks(prepared_mnist):
    x_train, y_train, x_test, y_test, meta = data.load_dataset("mnist", data_dir=prepared_mnist)
    assert x_train.shape == (7, 28, 28, 1) and x_test.shape == (3, 28, 28, 1)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    assert sorted(y_train.tolist()) == list(range(7)) and sorted(y_test.tolist()) == [7, 8, 9]
    assert meta["num_classes"] == 10 and meta["task"] == "classification"
    # Each image is exactly its generated pixels, normalized: (x/255 − 0.1307)/0.3081.
    for x, y in zip(
        np.concatenate([x_train, x_test]), np.concatenate([y_train, y_test]), strict=True
    ):
        expected = (_fake_image(int(y)).astype(np.float64) / 255 - 0.1307) / 0.3081
        np.testing.assert_allclose(x[..., 0], expected, rtol=1e-6, atol=1e-6)
    sub = data.load_dataset("mnist", data_dir=prepared_mnist, seed=1, max_train=4, max_test=2)
    assert sub[0].shape[0] == 4 and sub[2].shape[0] == 2
    assert set(sub[1].tolist()) <= set(range(7))
    fed = data.load_federated("mnist", num_clients=3, seed=0, data_dir=prepared_mnist)
    assert fed.x_train.shape == (7, 28, 28, 1) and int(fed.client_size.sum()) == 7


# ------------------------------------------------------------------- tfds.testing.mock_data


@pytest.mark.parametrize(("name", "shape", "classes"), [
    ("cifar10", (32, 32, 3), 10), ("cifar100", (32, 32, 3), 100),
    ("fashion_mnist", (28, 28, 1), 10),
])  # fmt: skip
def test_image_loaders_with_mock_data(name, shape, classes):
    with tfds.testing.mock_data(num_examples=6, policy=USE_CODE):
        raw = T.open_data_source(name, "train")
        raw_images = np.stack([raw[i]["image"] for i in range(6)])
        raw_labels = [int(raw[i]["label"]) for i in range(6)]
        x_train, y_train, x_test, y_test, meta = data.load_dataset(name)
    assert x_train.shape == (6, *shape) and x_test.shape == (6, *shape)
    assert meta["num_classes"] == classes and meta["input_shape"] == shape
    mean, std = T.IMAGE_STATS[name]
    expected = (raw_images.astype(np.float64) / 255 - np.array(mean)) / np.array(std)
    np.testing.assert_allclose(x_train, expected, rtol=1e-6, atol=1e-6)
    assert y_train.tolist() == raw_labels and y_train.dtype == np.int32


@pytest.mark.parametrize(("name", "text_key", "test_split"), [
    ("glue/sst2", "sentence", "validation"), ("yelp_polarity_reviews", "text", "test"),
])  # fmt: skip
def test_text_loaders_with_mock_data(name, text_key, test_split):
    with tfds.testing.mock_data(num_examples=8, policy=USE_CODE):
        train = T.open_data_source(name, "train")
        test = T.open_data_source(name, test_split)
        train_texts = [T._as_text(train[i][text_key]) for i in range(8)]
        test_texts = [T._as_text(test[i][text_key]) for i in range(8)]
        train_labels = [int(train[i]["label"]) for i in range(8)]
        x_train, y_train, x_test, y_test, meta = data.load_dataset(name, vocab_size=12, max_len=6)
    assert x_train.shape == (8, 6) and x_test.shape == (8, 6) and x_train.dtype == np.int32
    assert y_train.tolist() == train_labels and meta["num_classes"] == 2
    vocab = T.build_vocab(train_texts, 12)
    assert meta["vocab"] == vocab and len(vocab) <= 10
    np.testing.assert_array_equal(x_train, T.encode_texts(train_texts, vocab, 6))
    np.testing.assert_array_equal(x_test, T.encode_texts(test_texts, vocab, 6))


def test_c4_streams_and_packs_bytes():
    with tfds.testing.mock_data(num_examples=30, policy=USE_CODE):
        source = T.open_data_source("c4", "train")
        stream = np.concatenate([T.byte_encode(T._as_text(source[i]["text"])) for i in range(30)])
        x_train, y_train, x_test, y_test, meta = data.load_dataset(
            "c4", seq_len=15, num_train_sequences=9, num_test_sequences=2
        )
    assert x_train.shape == (9, 16) and x_test.shape == (2, 16) and x_train.dtype == np.int32
    # Packing identity: the windows are the document byte stream (EOS-separated), in order.
    np.testing.assert_array_equal(x_train.ravel(), stream[: 9 * 16])
    np.testing.assert_array_equal(y_train, np.full(9, 16))
    assert meta["task"] == "lm" and meta["num_classes"] == T.BYTE_VOCAB_SIZE == 257
    with tfds.testing.mock_data(num_examples=2, policy=USE_CODE):
        with pytest.raises(ValueError, match="ran out of text"):
            T.load_c4(seq_len=127, num_train_sequences=1000)


SENTIMENT140 = {
    "train": [
        {"text": "good day", "polarity": np.int32(4), "user": "ann"},
        {"text": "bad day", "polarity": np.int32(0), "user": "bob"},
        {"text": "so good", "polarity": np.int32(4), "user": "ann"},
    ],
    "test": [
        {"text": "good", "polarity": np.int32(4), "user": "x"},
        {"text": "meh", "polarity": np.int32(2), "user": "y"},  # neutral: dropped
        {"text": "bad bad", "polarity": np.int32(0), "user": "z"},
    ],
}


def test_sentiment140_labels_users_and_neutral_dropped():
    def as_data_source(self, split, **kwargs):
        del self, kwargs
        return SENTIMENT140[split]

    with tfds.testing.mock_data(policy=USE_CODE, as_data_source_fn=as_data_source):
        x_train, y_train, x_test, y_test, meta = data.load_dataset("sentiment140", max_len=3)
    assert y_train.tolist() == [1, 0, 1] and y_test.tolist() == [1, 0]
    assert meta["client_ids"].tolist() == ["ann", "bob", "ann"]
    # Vocabulary from the training text only: day:2, good:2, bad:1, so:1 → ids 2, 3, 4, 5.
    assert meta["vocab"] == {"day": 2, "good": 3, "bad": 4, "so": 5}
    np.testing.assert_array_equal(x_test, [[3, 0, 0], [4, 4, 0]])
    parts = data.partition_lib.natural(y_train, 2, seed=0, groups=meta["client_ids"])
    assert sorted(p.tolist() for p in parts) == [[0, 2], [1]]


# ---------------------------------------------------------------------------- Tiny ImageNet


def _tiny_pixels(index: int, gray: bool) -> np.ndarray:
    shape = (64, 64) if gray else (64, 64, 3)
    return np.random.default_rng(index).integers(0, 256, shape, dtype=np.uint8)


@pytest.fixture(scope="module")
def tiny_imagenet(tmp_path_factory):
    """A 3-class tiny-imagenet-200/ folder. Images are PNG data under .JPEG names (PIL detects
    the format from the content), so decoded pixels are exact; image 1 is grayscale."""
    base = tmp_path_factory.mktemp("tiny")
    root = base / "tiny-imagenet-200"
    wnids = ["n03", "n01", "n02"]  # listed unsorted: classes are the sorted ids
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    index = 0
    for wnid in wnids:
        folder = root / "train" / wnid / "images"
        folder.mkdir(parents=True)
        for k in range(2):
            pixels = _tiny_pixels(index, gray=index == 1)
            PIL.Image.fromarray(pixels).save(folder / f"{wnid}_{k}.JPEG", format="PNG")
            index += 1
    lines = []
    for k, wnid in enumerate(["n02", "n01"]):
        PIL.Image.fromarray(_tiny_pixels(100 + k, False)).save(
            root / "val" / "images" / f"val_{k}.JPEG", format="PNG"
        )
        lines.append(f"val_{k}.JPEG\t{wnid}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return base


def test_tiny_imagenet_folder(tiny_imagenet):
    x_train, y_train, x_test, y_test, meta = data.load_dataset(
        "tiny_imagenet", data_dir=tiny_imagenet
    )
    assert meta["wnids"] == ["n01", "n02", "n03"] and meta["num_classes"] == 3
    assert x_train.shape == (6, 64, 64, 3) and x_test.shape == (2, 64, 64, 3)
    # Train images are listed class by class (sorted wnids), files sorted within a class.
    assert y_train.tolist() == [0, 0, 1, 1, 2, 2] and y_test.tolist() == [1, 0]
    mean, std = (
        np.array(T.IMAGE_STATS["tiny_imagenet"][0]),
        np.array(T.IMAGE_STATS["tiny_imagenet"][1]),
    )
    # n01 holds images 2, 3; n02 holds 4, 5; n03 holds 0, 1 (1 is grayscale → 3 equal channels).
    for row, index in enumerate([2, 3, 4, 5, 0, 1]):
        pixels = _tiny_pixels(index, gray=index == 1).astype(np.float64)
        if pixels.ndim == 2:
            pixels = np.repeat(pixels[..., None], 3, axis=-1)
        np.testing.assert_allclose(x_train[row], (pixels / 255 - mean) / std, rtol=1e-6, atol=1e-6)
    expected = (_tiny_pixels(100, False) / 255 - mean) / std
    np.testing.assert_allclose(x_test[0], expected, rtol=1e-6, atol=1e-6)
    # The folder itself is also accepted as data_dir.
    again = data.load_dataset(
        "tiny_imagenet", data_dir=tiny_imagenet / "tiny-imagenet-200", max_train=2
    )
    assert again[0].shape[0] == 2


def test_unknown_tfds_name():
    with pytest.raises(ValueError, match=r"Unknown TFDS dataset 'imagenet2012'.*'cifar10'"):
        T.open_data_source("imagenet2012", "train")
