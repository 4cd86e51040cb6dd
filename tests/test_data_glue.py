"""GLUE with a subword tokenizer (fedorth.data.glue), on TFDS mock data and a tokenizer trained
inside the test with RoBERTa's post-processor (<s> A </s></s> B </s>)."""

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedorth import data
from fedorth.data import glue
from fedorth.data import tfds as T
from fedorth.train import builders

USE_CODE = tfds.testing.MockPolicy.USE_CODE
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # RoBERTa's ids 0, 1, 2, 3


def _roberta_like_tokenizer(path):
    from tokenizers import Tokenizer, pre_tokenizers, processors, trainers
    from tokenizers import models as tmodels

    bpe = Tokenizer(tmodels.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["a sentence pair for the glue tasks", "paraphrase or not"], trainer)
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    bpe.save(str(path))
    return bpe


def test_pairs_are_encoded_like_roberta_and_padded(tmp_path):
    reference = _roberta_like_tokenizer(tmp_path / "tokenizer.json")
    with tfds.testing.mock_data(num_examples=6, policy=USE_CODE):
        source = T.open_data_source("glue/mrpc", "train")
        pairs = [
            (T._as_text(source[i]["sentence1"]), T._as_text(source[i]["sentence2"]))
            for i in range(6)
        ]
        labels = [int(source[i]["label"]) for i in range(6)]
        x_train, y_train, x_test, y_test, meta = data.load_dataset(
            "glue/mrpc", tokenizer=str(tmp_path / "tokenizer.json"), max_len=24
        )
    assert x_train.shape == (6, 24) and x_train.dtype == np.int32
    assert y_train.tolist() == labels and meta["num_classes"] == 2 and meta["pad_id"] == 1
    for row, (a, b) in zip(x_train, pairs, strict=True):
        a_ids = reference.encode(a, add_special_tokens=False).ids
        b_ids = reference.encode(b, add_special_tokens=False).ids
        full = [0, *a_ids, 2, 2, *b_ids, 2]
        if len(full) <= 24:  # untruncated: exactly <s> A </s></s> B </s>, then pads
            np.testing.assert_array_equal(row, full + [1] * (24 - len(full)))
        else:  # truncated longest-first to max_len, still framed by <s> ... </s>
            assert row[0] == 0 and row[-1] == 2 and list(row).count(2) == 3


def test_mnli_has_three_classes_and_the_matched_validation_split(tmp_path):
    _roberta_like_tokenizer(tmp_path / "tokenizer.json")
    with tfds.testing.mock_data(num_examples=5, policy=USE_CODE):
        *_, y_test, meta = data.load_dataset("glue/mnli", tokenizer=str(tmp_path), max_len=16)
    assert meta["num_classes"] == 3 and set(y_test.tolist()) <= {0, 1, 2}
    shape, dtype, classes = builders.input_spec("glue/mnli", {"tokenizer": str(tmp_path)})
    assert shape == (128,) and classes == 3  # load_glue's default max_len


def test_glue_without_a_tokenizer_says_how_to_get_one():
    with pytest.raises(ValueError, match=r"data.dataset_kwargs.tokenizer=PATH.*roberta-base"):
        glue.load_glue("rte")
    assert builders.input_spec("glue/sst2")[0] == (64,)  # the word-level RNN setting is kept


def test_glue_with_a_missing_tokenizer_names_robertas(tmp_path):
    """GLUE runs RoBERTa: a tokenizer path that holds nothing gets RoBERTa's download command
    (`hf download`, huggingface_hub's command), not T5's, from the loader and the config check."""
    missing = str(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match=r"`hf download roberta-base tokenizer.json") as e:
        glue.load_glue("rte", tokenizer=missing)
    assert "t5" not in str(e.value) and "\n" not in str(e.value)
    config = ml_collections.ConfigDict(
        {
            "data": {"name": "glue/rte", "dataset_kwargs": {"tokenizer": missing}},
            "model": {"name": "roberta_base"},
        }
    )
    with pytest.raises(FileNotFoundError, match=r"`hf download roberta-base tokenizer.json"):
        builders._check_tokenizer(config)


def test_dirichlet_label_split_of_glue_labels():
    """The papers' Dir-0.8 split over 4 clients applies to GLUE's labels like any others:
    every example is assigned once, and each client's label mix follows its own draw."""
    labels = np.repeat(np.arange(2, dtype=np.int32), 200)
    parts = data.PARTITIONERS["dirichlet_label_split"](labels, 4, seed=0, alpha=0.8)
    joined = np.sort(np.concatenate([np.asarray(p) for p in parts]))
    np.testing.assert_array_equal(joined, np.arange(400))
    shares = np.array([np.mean(labels[np.asarray(p)]) for p in parts])
    assert shares.std() > 0.05  # heterogeneous clients (an iid split gives ~0.5 everywhere)
