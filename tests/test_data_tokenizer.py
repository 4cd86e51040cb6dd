"""Subword tokenizers for C4 (fedorth.data.tokenizer) and the LLaMA sizes they give.

The tokenizers are trained inside the tests (``tokenizers``' BPE trainer on a few sentences), so
nothing is downloaded; C4 is TFDS's mock data.
"""

import json

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedorth import data, models
from fedorth.data import tfds as T
from fedorth.data import tokenizer as tok

USE_CODE = tfds.testing.MockPolicy.USE_CODE

CORPUS = [
    "federated learning with orthogonalized local optimizers",
    "the server averages the clients' preconditioners",
    "muon orthogonalizes the momentum of each weight matrix",
] * 4


def _train_bpe(path, vocab_size=64):
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as tmodels

    bpe = Tokenizer(tmodels.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS, trainer)
    bpe.save(str(path))
    return bpe


def test_json_tokenizer_encodes_like_the_library_and_appends_eos(tmp_path):
    reference = _train_bpe(tmp_path / "tokenizer.json", vocab_size=300)
    loaded = tok.load_tokenizer(tmp_path)  # a folder resolves to its tokenizer.json
    text = "muon averages the momentum"
    expected = reference.encode(text, add_special_tokens=False).ids + [
        reference.token_to_id("</s>")
    ]
    np.testing.assert_array_equal(loaded.encode(text), expected)
    assert loaded.encode(text).dtype == np.int32
    assert loaded.eos_id == reference.token_to_id("</s>") == 1
    assert loaded.vocab_size == reference.get_vocab_size(with_added_tokens=False)


def test_a_tokenizer_file_is_loaded_once_per_version(tmp_path):
    # The config check, the model build and the loader ask for the same file: one parse.
    path = tmp_path / "tokenizer.json"
    _train_bpe(path, vocab_size=300)
    first = tok.load_tokenizer(tmp_path)
    assert tok.load_tokenizer(path) is first, "the folder and its file: one cached load"
    before = first.vocab_size
    _train_bpe(path, vocab_size=280)  # a rewritten file (new size) is read again
    again = tok.load_tokenizer(path)
    assert again is not first and again.vocab_size < before


def test_missing_and_malformed_tokenizers_are_one_line_errors(tmp_path):
    with pytest.raises(
        tok.TokenizerNotFoundError, match=r"tokenizer=.*no such file.*`hf download t5-base "
    ):
        tok.load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(tok.TokenizerNotFoundError, match="folder without any of"):
        tok.load_tokenizer(tmp_path)
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ValueError, match="is not a tokenizers JSON file") as error:
        tok.load_tokenizer(bad)
    assert "\n" not in str(error.value)


def test_c4_windows_are_the_subword_stream(tmp_path):
    _train_bpe(tmp_path / "tokenizer.json", vocab_size=300)
    subword = tok.load_tokenizer(tmp_path / "tokenizer.json")
    with tfds.testing.mock_data(num_examples=30, policy=USE_CODE):
        source = T.open_data_source("c4", "train")
        stream = np.concatenate([subword.encode(T._as_text(source[i]["text"])) for i in range(30)])
        x_train, _, x_test, _, meta = data.load_dataset(
            "c4",
            seq_len=7,
            num_train_sequences=5,
            num_test_sequences=2,
            tokenizer=str(tmp_path / "tokenizer.json"),
        )
    # Packing identity: the windows are the EOS-separated subword stream, in order.
    np.testing.assert_array_equal(x_train.ravel(), stream[: 5 * 8])
    assert x_test.shape == (2, 8)
    assert meta["num_classes"] == meta["vocab_size"] == subword.vocab_size
    assert int(x_train.max()) < subword.vocab_size


@pytest.mark.parametrize(
    "size, named, params",
    [("60m", 60e6, 58_073_600), ("130m", 130e6, 134_105_856), ("350m", 350e6, 367_969_280)],
)
def test_llama_sizes_with_the_t5_vocabulary(size, named, params):
    """With the 32,000-id T5 vocabulary the LLaMA configs have their named sizes (GaLore's counts,
    fedorth.models.llama); with the byte vocabulary (257) they are 25.6M / 85.3M / 303M."""

    def count(vocab):
        model = models.get_model("llama", size=size, vocab_size=vocab)
        shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 9), np.int32))
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes[0]))

    assert count(32000) == params
    assert abs(params - named) / named < 0.06  # "60M" etc. are rounded names
    assert count(T.BYTE_VOCAB_SIZE) < 0.9 * params


def test_llama_vocabulary_follows_the_tokenizer_and_a_mismatch_is_an_error():
    import types

    import ml_collections

    from fedorth.train import builders

    config = ml_collections.ConfigDict({"model": {"name": "llama", "size": "tiny"}})
    fed_data = types.SimpleNamespace(num_classes=300)
    assert builders.build_model(config, fed_data).module.vocab_size == 300
    config.model.vocab_size = 257
    with pytest.raises(ValueError, match=r"model.vocab_size=257 but the data's tokenizer has 300"):
        builders.build_model(config, fed_data)
