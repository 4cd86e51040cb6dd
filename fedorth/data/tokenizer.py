"""Subword tokenizers for language modelling, loaded from the files users already have.

FedPAC (Liu et al.) Table 3 / Table 10 trains LLaMA 60M/130M/350M on C4 with a 32k subword
vocabulary: the sizes are those of GaLore's LLaMA configs, which use the T5 tokenizer (32,000
SentencePiece pieces). With fedorth's byte tokenizer (vocabulary 257) the same architectures have
25.6M / 85.3M / 303M parameters and their losses are not comparable with the table; with the T5
vocabulary they have the named sizes (``fedorth.models.llama``).

Two file formats are read, both offline:

* ``tokenizer.json`` (the Hugging Face ``tokenizers`` format, e.g. ``t5-base/tokenizer.json``),
  through the ``tokenizers`` library;
* a SentencePiece model (``spiece.model``, ``tokenizer.model``), through the ``sentencepiece``
  library when it is installed (optional: ``pip install sentencepiece``).

A path may name the file itself or a folder holding one of them (a Hugging Face snapshot folder).
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Callable

import numpy as np

__all__ = ["SubwordTokenizer", "TokenizerNotFoundError", "load_tokenizer"]

_FILE_NAMES = ("tokenizer.json", "spiece.model", "tokenizer.model", "sentencepiece.model")


def _how_to_get(hub_name: str) -> str:
    """The download hint for the tokenizer of the Hugging Face model ``hub_name``."""
    return (
        f"Download {hub_name}'s tokenizer once on a machine with network access "
        f"(`hf download {hub_name} tokenizer.json --local-dir DIR`, or copy tokenizer.json "
        "from the model's Hugging Face snapshot), then pass "
        "data.dataset_kwargs.tokenizer=DIR/tokenizer.json"
    )


class TokenizerNotFoundError(FileNotFoundError):
    """No tokenizer file at the given path."""


class SubwordTokenizer:
    """A loaded subword tokenizer: ``encode(text) -> int32 ids`` ending with the EOS id.

    Attributes:
      path: the file it was loaded from.
      vocab_size: the number of ids the model's embedding must hold: the base vocabulary
        (``tokenizers``: without added tokens, e.g. 32,000 for T5's 32,100 with its 100 sentinel
        ids, which never occur in plain text; SentencePiece: the number of pieces).
      eos_id: the id appended after each document (``</s>`` for T5).
    """

    def __init__(
        self, path: pathlib.Path, encode_fn: Callable[[str], list[int]], vocab_size: int, eos_id
    ):
        self.path = path
        self._encode = encode_fn
        self.vocab_size = int(vocab_size)
        self.eos_id = int(eos_id)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` followed by :attr:`eos_id`, as int32."""
        ids = np.asarray(list(self._encode(text)) + [self.eos_id], np.int32)
        if ids.size and int(ids.max()) >= self.vocab_size:
            bad = int(ids.max())
            raise ValueError(
                f"tokenizer {str(self.path)!r} produced id {bad} >= its vocabulary size "
                f"{self.vocab_size} (an added token in the text?): use a tokenizer whose added "
                "tokens do not occur in the data."
            )
        return ids

    def __repr__(self) -> str:
        return f"SubwordTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _resolve(path: str | os.PathLike, hub_name: str) -> pathlib.Path:
    candidate = pathlib.Path(path).expanduser()
    if candidate.is_dir():
        for name in _FILE_NAMES:
            if (candidate / name).is_file():
                return candidate / name
        raise TokenizerNotFoundError(
            f"data.dataset_kwargs.tokenizer={str(path)!r} is a folder without any of "
            f"{list(_FILE_NAMES)}. {_how_to_get(hub_name)}."
        )
    if not candidate.is_file():
        raise TokenizerNotFoundError(
            f"data.dataset_kwargs.tokenizer={str(path)!r}: no such file. {_how_to_get(hub_name)}."
        )
    return candidate


def _eos_of_json(tokenizer, path: pathlib.Path) -> int:
    for token in ("</s>", "<|endoftext|>", "<eos>", "[SEP]"):
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise ValueError(
        f"tokenizer {str(path)!r} has none of the end-of-document tokens '</s>', "
        "'<|endoftext|>', '<eos>', '[SEP]': add one to the tokenizer."
    )


def _load_json(path: pathlib.Path, hub_name: str) -> SubwordTokenizer:
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # the library raises a bare Exception on malformed files
        raise ValueError(
            f"data.dataset_kwargs.tokenizer={str(path)!r} is not a tokenizers JSON file "
            f"({error}). {_how_to_get(hub_name)}."
        ) from None
    eos = _eos_of_json(tokenizer, path)
    base = tokenizer.get_vocab_size(with_added_tokens=False)
    # An EOS token registered as an added token lies beyond the base vocabulary: keep it.
    vocab_size = max(base, eos + 1)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return SubwordTokenizer(path, encode, vocab_size, eos)


def _load_sentencepiece(path: pathlib.Path) -> SubwordTokenizer:
    try:
        import sentencepiece
    except ImportError:
        raise ImportError(
            f"data.dataset_kwargs.tokenizer={str(path)!r} is a SentencePiece model, which needs "
            "`pip install sentencepiece`; or pass the same tokenizer's tokenizer.json instead."
        ) from None
    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    eos = processor.eos_id()
    if eos < 0:
        raise ValueError(f"SentencePiece model {str(path)!r} defines no EOS piece.")
    return SubwordTokenizer(
        path, lambda text: processor.encode(text), processor.get_piece_size(), eos
    )


def load_tokenizer(path: str | os.PathLike, *, hub_name: str = "t5-base") -> SubwordTokenizer:
    """Load a subword tokenizer from ``tokenizer.json``, a SentencePiece model, or their folder.

    Args:
      path: a ``tokenizer.json`` or ``*.model`` file, or a folder holding one (checked in the
        order tokenizer.json, spiece.model, tokenizer.model, sentencepiece.model).
      hub_name: the Hugging Face model whose tokenizer the run expects (``t5-base`` for C4,
        ``roberta-base`` for GLUE): the error messages say how to download it.

    Returns:
      A :class:`SubwordTokenizer`.

    Raises:
      TokenizerNotFoundError: nothing at ``path``; the message says how to get ``hub_name``'s
        tokenizer.
    """
    resolved = _resolve(path, hub_name)
    stat = resolved.stat()
    return _load_cached(resolved, stat.st_mtime_ns, stat.st_size, hub_name)


@functools.lru_cache(maxsize=8)
def _load_cached(
    resolved: pathlib.Path, mtime_ns: int, size: int, hub_name: str
) -> SubwordTokenizer:
    """One load per file version: the config check, the model build and the data loader all
    ask for the same tokenizer (a 32k-piece tokenizer.json takes a noticeable fraction of a
    second to parse); a rewritten file (new mtime or size) is loaded again."""
    del mtime_ns, size  # the cache key
    if resolved.suffix == ".json":
        return _load_json(resolved, hub_name)
    return _load_sentencepiece(resolved)
