"""GLUE through TFDS, tokenized with a subword tokenizer (RoBERTa's), for fine-tuning.

FedMuon (Liu et al.) Table 4 fine-tunes RoBERTa-base with LoRA on CoLA, RTE, SST-2, QQP, MRPC,
QNLI and MNLI (4 clients, Dir-0.8 label splits). Each task is read from its prepared TFDS
``glue/<task>`` files (``fedorth.data.tfds.open_data_source``: nothing is downloaded) and encoded
by the tokenizer the model was pretrained with, loaded from its ``tokenizer.json`` through the
``tokenizers`` library: RoBERTa's post-processor writes a single sentence as ``<s> A </s>`` and a
pair as ``<s> A </s></s> B </s>``; sequences longer than ``max_len`` are truncated (longest
first, as the reference tokenizer's ``truncation=True``) and shorter ones right-padded with the
tokenizer's pad id (1 for RoBERTa), which the model masks out.

GLUE's test labels are hidden: the validation split (MNLI: ``validation_matched``) is the test
split, as in the papers' tables. STS-B (a regression task) is not included.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedorth.data import tfds as T


class GlueTask(NamedTuple):
    keys: tuple[str, ...]  # the text features: one sentence or a pair
    num_classes: int
    test_split: str


GLUE_TASKS: dict[str, GlueTask] = {
    "cola": GlueTask(("sentence",), 2, "validation"),
    "sst2": GlueTask(("sentence",), 2, "validation"),
    "mrpc": GlueTask(("sentence1", "sentence2"), 2, "validation"),
    "qqp": GlueTask(("question1", "question2"), 2, "validation"),
    "mnli": GlueTask(("premise", "hypothesis"), 3, "validation_matched"),
    "qnli": GlueTask(("question", "sentence"), 2, "validation"),
    "rte": GlueTask(("sentence1", "sentence2"), 2, "validation"),
}


def _tokenizer(path: str, max_len: int):
    from fedorth.data.tokenizer import load_tokenizer

    # One-line errors for missing or malformed files, naming RoBERTa's tokenizer.
    subword = load_tokenizer(path, hub_name="roberta-base")
    if subword.path.suffix != ".json":
        raise ValueError(
            f"data.dataset_kwargs.tokenizer={path!r}: GLUE needs the model's tokenizer.json "
            "(its post-processor writes <s> A </s></s> B </s>), not a SentencePiece model."
        )
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(subword.path))
    pad = tokenizer.token_to_id("<pad>")
    if pad is None:
        raise ValueError(
            f"tokenizer {str(subword.path)!r} has no '<pad>' token: use the RoBERTa tokenizer."
        )
    tokenizer.enable_truncation(max_len)
    return tokenizer, pad, tokenizer.get_vocab_size(with_added_tokens=True)


def _split(task: GlueTask, name: str, split: str, data_dir, limit, rng, tokenizer, pad, max_len):
    source = T.open_data_source(name, split, data_dir=data_dir)
    indices = T._subset(len(source), limit, rng)
    ids = np.full((len(indices), max_len), pad, np.int32)
    labels = np.empty(len(indices), np.int32)
    for row, example in enumerate(T._read(source, indices)):
        texts = [T._as_text(example[key]) for key in task.keys]
        encoding = tokenizer.encode(*texts)
        ids[row, : len(encoding.ids)] = encoding.ids
        labels[row] = int(example["label"])
    return ids, labels


def load_glue(
    task: str,
    *,
    tokenizer: str | None = None,
    data_dir=None,
    seed: int = 0,
    max_len: int = 128,
    max_train: int | None = None,
    max_test: int | None = None,
):
    """Token ids and labels of a GLUE task, encoded with the model's subword tokenizer.

    Args:
      task: ``cola``, ``sst2``, ``mrpc``, ``qqp``, ``mnli``, ``qnli`` or ``rte``.
      tokenizer: path of the model's ``tokenizer.json`` (or its folder), e.g. ``roberta-base``'s.
      data_dir: TFDS data folder.
      seed: NumPy seed for the optional subsampling.
      max_len: sequence length (truncated / right-padded with the pad id).
      max_train: keep a uniform random subset of this many training examples.
      max_test: likewise for the test (validation) split.

    Returns:
      ``(x_train, y_train, x_test, y_test, meta)``: int32 ids ``[M, max_len]``, int32 labels;
      ``meta`` holds ``num_classes``, ``pad_id`` and ``vocab_size``.
    """
    if task not in GLUE_TASKS:
        raise ValueError(f"GLUE task {task!r} is unknown; valid: {sorted(GLUE_TASKS)}.")
    if not tokenizer:
        raise ValueError(
            f"data.name='glue/{task}' with subword tokens needs data.dataset_kwargs.tokenizer="
            "PATH (the model's tokenizer.json, e.g. from `hf download roberta-base "
            "tokenizer.json --local-dir DIR`)."
        )
    spec = GLUE_TASKS[task]
    encoder, pad, vocab_size = _tokenizer(tokenizer, int(max_len))
    rng = np.random.default_rng(seed)
    name = f"glue/{task}"
    x_train, y_train = _split(
        spec, name, "train", data_dir, max_train, rng, encoder, pad, int(max_len)
    )
    x_test, y_test = _split(
        spec, name, spec.test_split, data_dir, max_test, rng, encoder, pad, int(max_len)
    )
    meta = {
        "name": name,
        "num_classes": spec.num_classes,
        "task": "classification",
        "input_shape": (int(max_len),),
        "pad_id": pad,
        "vocab_size": vocab_size,
        "tokenizer": str(tokenizer),
    }
    return x_train, y_train, x_test, y_test, meta


def _sst2(*, tokenizer: str | None = None, **kwargs):
    """``glue/sst2``: subword ids with ``tokenizer``, else fedorth's word vocabulary
    (``fedorth.data.tfds.load_text``, the RNN setting)."""
    if tokenizer:
        return load_glue("sst2", tokenizer=tokenizer, **kwargs)
    return T.load_text("glue/sst2", **kwargs)


def _task_loader(task: str):
    def load(**kwargs):
        return load_glue(task, **kwargs)

    load.__name__ = f"load_glue_{task}"
    load.__doc__ = f"Load GLUE {task!r} with :func:`load_glue`."
    return load


LOADERS = {
    "glue/sst2": _sst2,
    **{f"glue/{task}": _task_loader(task) for task in GLUE_TASKS if task != "sst2"},
}
