"""Pretrained weights from the Hugging Face safetensors files users already have.

``model.pretrained=PATH_OR_NAME`` loads a checkpoint into ``vit_b16``, ``swin_t`` or
``roberta_base`` before the first round. ``PATH_OR_NAME`` is

* a ``*.safetensors`` file, or a folder holding ``model.safetensors`` (or the shards listed by
  ``model.safetensors.index.json``), e.g. a ``save_pretrained`` folder; or
* a Hugging Face model name (``google/vit-base-patch16-224-in21k``,
  ``microsoft/swin-tiny-patch4-window7-224``, ``roberta-base``) found in the local Hugging Face
  cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``).

Nothing is downloaded at run time; a missing file is a one-line error that says how to get it.

The checkpoint's keys are mapped onto fedorth's parameter tree by explicit rules per
architecture (PyTorch ``Linear.weight`` ``(out, in)`` → Dense ``kernel`` ``(in, out)``;
patch-embedding convolutions ``(d, C, p, p)`` → the ``(p·p·C, d)`` kernel on flattened patches;
LayerNorm ``weight`` → ``scale``). Every parameter must be matched with its exact shape, except the
classification head: a checkpoint without a head (the ImageNet-21k ViT, ``roberta-base``'s
masked-LM head) or with another number of classes keeps fedorth's freshly initialized head, and
the report lists it. Checkpoint entries the model does not use (poolers, masked-LM heads,
buffers the model recomputes) are listed as ignored. Anything else (missing or unexpected keys,
wrong shapes, a checkpoint of another architecture) is an error listing the keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "ARCHITECTURES",
    "PretrainedError",
    "LoadReport",
    "check_checkpoint",
    "load_pretrained",
    "resolve_checkpoint",
]


class PretrainedError(ValueError):
    """A checkpoint that cannot be loaded into the model (one line, naming the fix)."""


def _linear(w: np.ndarray) -> np.ndarray:
    return w.T


def _patch(w: np.ndarray) -> np.ndarray:
    # (d, C, p, p) -> (p, p, C, d) -> (p·p·C, d): patchify's (row, column, channel) order.
    d, c, ph, pw = w.shape
    return w.transpose(2, 3, 1, 0).reshape(ph * pw * c, d)


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _squeeze_rows(w: np.ndarray) -> np.ndarray:
    # (1, 1, d) cls token or (1, N, d) positions or (1, d) token type -> without the unit rows.
    return w.reshape(w.shape[-2:]) if w.ndim == 3 and w.shape[1] > 1 else w.reshape(-1)


# A rule: (regex on the checkpoint key without its model prefix, target path template, transform).
Rule = tuple[str, str, Callable[[np.ndarray], np.ndarray]]


def _dense(src: str, dst: str) -> list[Rule]:
    return [(src + r"\.weight", dst + "/kernel", _linear), (src + r"\.bias", dst + "/bias", _same)]


def _norm(src: str, dst: str) -> list[Rule]:
    return [(src + r"\.weight", dst + "/scale", _same), (src + r"\.bias", dst + "/bias", _same)]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one Hugging Face layout maps onto a fedorth model."""

    model_types: tuple[str, ...]  # config.json "model_type" values of the layout
    prefix: str  # the backbone's key prefix in task checkpoints ("vit.")
    rules: tuple[Rule, ...]
    head: tuple[str, ...]  # fedorth paths of the classification head (re-initialized if absent)
    ignored: tuple[str, ...]  # regexes of checkpoint keys the model does not use
    example: str  # the papers' checkpoint name, for messages


_VIT_LAYER = r"encoder\.layer\.(\d+)\."
_SWIN_BLOCK = r"encoder\.layers\.(\d+)\.blocks\.(\d+)\."
_SWIN_MERGE = r"encoder\.layers\.(\d+)\.downsample\."

ARCHITECTURES: dict[str, Architecture] = {
    "vit_b16": Architecture(
        model_types=("vit",),
        prefix="vit.",
        rules=(
            (r"embeddings\.cls_token", "cls_token", _squeeze_rows),
            (r"embeddings\.position_embeddings", "pos_embedding", _squeeze_rows),
            (r"embeddings\.patch_embeddings\.projection\.weight", "patch_embed/kernel", _patch),
            (r"embeddings\.patch_embeddings\.projection\.bias", "patch_embed/bias", _same),
            *_dense(
                _VIT_LAYER + r"attention\.attention\.(query|key|value)", "layer_{0}/attention/{1}"
            ),
            *_dense(_VIT_LAYER + r"attention\.output\.dense", "layer_{0}/attention/output"),
            *_norm(_VIT_LAYER + r"(layernorm_before|layernorm_after)", "layer_{0}/{1}"),
            *_dense(_VIT_LAYER + r"intermediate\.dense", "layer_{0}/intermediate"),
            *_dense(_VIT_LAYER + r"output\.dense", "layer_{0}/output"),
            *_norm(r"layernorm", "layernorm"),
            *_dense(r"classifier", "head"),
        ),
        head=("head/kernel", "head/bias"),
        ignored=(r"pooler\..*",),
        example="google/vit-base-patch16-224-in21k",
    ),
    "swin_t": Architecture(
        model_types=("swin",),
        prefix="swin.",
        rules=(
            (r"embeddings\.patch_embeddings\.projection\.weight", "patch_embed/kernel", _patch),
            (r"embeddings\.patch_embeddings\.projection\.bias", "patch_embed/bias", _same),
            *_norm(r"embeddings\.norm", "embed_norm"),
            *_dense(
                _SWIN_BLOCK + r"attention\.self\.(query|key|value)",
                "stage_{0}_block_{1}/attention/{2}",
            ),
            (
                _SWIN_BLOCK + r"attention\.self\.relative_position_bias_table",
                "stage_{0}_block_{1}/relative_position_bias_table",
                _same,
            ),
            *_dense(
                _SWIN_BLOCK + r"attention\.output\.dense", "stage_{0}_block_{1}/attention/output"
            ),
            *_norm(_SWIN_BLOCK + r"(layernorm_before|layernorm_after)", "stage_{0}_block_{1}/{2}"),
            *_dense(_SWIN_BLOCK + r"intermediate\.dense", "stage_{0}_block_{1}/intermediate"),
            *_dense(_SWIN_BLOCK + r"output\.dense", "stage_{0}_block_{1}/output"),
            *_norm(_SWIN_MERGE + r"norm", "stage_{0}_merge/norm"),
            (_SWIN_MERGE + r"reduction\.weight", "stage_{0}_merge/reduction/kernel", _linear),
            *_norm(r"layernorm", "layernorm"),
            *_dense(r"classifier", "head"),
        ),
        head=("head/kernel", "head/bias"),
        # Buffers the model recomputes (relative_position_index) or masks (attn_mask).
        ignored=(r".*\.relative_position_index", r".*\.attn_mask"),
        example="microsoft/swin-tiny-patch4-window7-224",
    ),
    "roberta_base": Architecture(
        model_types=("roberta",),
        prefix="roberta.",
        rules=(
            (r"embeddings\.word_embeddings\.weight", "word_embeddings/embedding", _same),
            (r"embeddings\.position_embeddings\.weight", "position_embeddings/embedding", _same),
            (r"embeddings\.token_type_embeddings\.weight", "token_type_embedding", _squeeze_rows),
            *_norm(r"embeddings\.LayerNorm", "embed_norm"),
            *_dense(_VIT_LAYER + r"attention\.self\.(query|key|value)", "layer_{0}/attention/{1}"),
            *_dense(_VIT_LAYER + r"attention\.output\.dense", "layer_{0}/attention/output"),
            *_norm(_VIT_LAYER + r"attention\.output\.LayerNorm", "layer_{0}/attention_norm"),
            *_dense(_VIT_LAYER + r"intermediate\.dense", "layer_{0}/intermediate"),
            *_dense(_VIT_LAYER + r"output\.dense", "layer_{0}/output"),
            *_norm(_VIT_LAYER + r"output\.LayerNorm", "layer_{0}/output_norm"),
            *_dense(r"classifier\.dense", "head_dense"),
            *_dense(r"classifier\.out_proj", "head"),
        ),
        # The sequence-classification head is dense + out_proj; both are task-specific.
        head=("head_dense/kernel", "head_dense/bias", "head/kernel", "head/bias"),
        ignored=(r"embeddings\.position_ids", r"pooler\..*", r"lm_head\..*"),
        example="roberta-base",
    ),
}


@dataclasses.dataclass
class LoadReport:
    """What :func:`load_pretrained` did: the file, the re-initialized head, the unused entries."""

    path: pathlib.Path
    loaded: int
    reinitialized: list[str]
    ignored: list[str]

    def __str__(self) -> str:
        text = f"loaded {self.loaded} tensors from {self.path}"
        if self.reinitialized:
            text += (
                "; head re-initialized (not in the checkpoint, or of another size): "
                f"{self.reinitialized}"
            )
        if self.ignored:
            shown = self.ignored[:6] + (["..."] if len(self.ignored) > 6 else [])
            text += f"; {len(self.ignored)} checkpoint entries unused by the model: {shown}"
        return text


def _hub_cache() -> pathlib.Path:
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return pathlib.Path(home).expanduser() / "hub"


def _files_in(folder: pathlib.Path) -> list[pathlib.Path] | None:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    return None


def _is_hub_name(source: str) -> bool:
    """A Hugging Face name ("roberta-base", "owner/model"), not a path of this machine."""
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source) is not None and not source.startswith(".")


def _how_to_get(source: str, example: str) -> str:
    name = source if _is_hub_name(source) and not pathlib.Path(source).exists() else example
    return (
        f"download it once on a machine with network access (`hf download {name} "
        f"model.safetensors config.json --local-dir DIR`) and pass model.pretrained=DIR, or put "
        f"it in the Hugging Face cache ({_hub_cache()})"
    )


def resolve_checkpoint(source: str, example: str = "NAME") -> list[pathlib.Path]:
    """The safetensors file(s) of ``source`` (a file, a folder, or a cached Hugging Face name).

    Raises:
      PretrainedError: nothing there; the message says where to put the file and how to get it.
    """
    path = pathlib.Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".safetensors":
            raise PretrainedError(
                f"model.pretrained={source!r} is not a .safetensors file (PyTorch .bin files "
                "are not read): use the checkpoint's model.safetensors."
            )
        return [path]
    if path.is_dir():
        files = _files_in(path)
        if files is None:
            raise PretrainedError(
                f"model.pretrained={source!r} is a folder without model.safetensors: "
                + _how_to_get(source, example)
                + "."
            )
        return files
    if not _is_hub_name(source):
        raise PretrainedError(
            f"model.pretrained={source!r}: no such file or folder; "
            + _how_to_get(source, example)
            + "."
        )
    repo = _hub_cache() / ("models--" + source.replace("/", "--"))
    snapshots = repo / "snapshots"
    if snapshots.is_dir():
        ref = repo / "refs" / "main"
        candidates = [snapshots / ref.read_text().strip()] if ref.is_file() else []
        candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        for folder in candidates:
            files = _files_in(folder) if folder.is_dir() else None
            if files:
                return files
    raise PretrainedError(
        f"model.pretrained={source!r}: no such file, folder or cached Hugging Face model "
        f"(looked in {repo}); " + _how_to_get(source, example) + "."
    )


def _read(files: list[pathlib.Path]) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    state: dict[str, np.ndarray] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _model_type(files: list[pathlib.Path], source: str) -> str | None:
    config = files[0].parent / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError, UnicodeDecodeError) as error:
        raise PretrainedError(
            f"model.pretrained={source!r}: {config} is not the checkpoint's JSON config "
            f"({type(error).__name__}: {error}): download the checkpoint's config.json again."
        ) from None


def check_checkpoint(model_name: str, source: str) -> None:
    """Checks, without reading any tensor, that ``source`` holds a checkpoint of ``model_name``.

    The files are found (:func:`resolve_checkpoint`), their config.json (when there is one)
    names the model's architecture, and each safetensors header is readable;
    :func:`load_pretrained` then matches the tensors against the model.

    Raises:
      PretrainedError: one line naming ``model.pretrained`` and the fix.
    """
    from safetensors import safe_open

    if model_name not in ARCHITECTURES:
        raise PretrainedError(
            f"model.pretrained is supported for models {sorted(ARCHITECTURES)}, not "
            f"model.name={model_name!r}."
        )
    arch = ARCHITECTURES[model_name]
    files = resolve_checkpoint(source, arch.example)
    model_type = _model_type(files, source)
    if model_type is not None and model_type not in arch.model_types:
        raise PretrainedError(
            f"model.pretrained={source!r} is a {model_type!r} checkpoint (config.json), but "
            f"model.name={model_name!r} needs a {arch.model_types[0]!r} one such as "
            f"{arch.example!r}."
        )
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as checkpoint:
                checkpoint.keys()
        except Exception as error:  # safetensors raises its own SafetensorError, or OSError
            raise PretrainedError(
                f"model.pretrained={source!r}: {file} is not a readable safetensors file "
                f"({type(error).__name__}: {error}); replace it: "
                + _how_to_get(source, arch.example)
                + "."
            ) from None


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) or hasattr(value, "items"):
            out.update(_flatten(value, path + "/"))
        else:
            out[path] = value
    return out


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _listing(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def load_pretrained(model_name: str, params: Any, source: str) -> tuple[Any, LoadReport]:
    """Replace ``params`` (fedorth's initialized tree) by the checkpoint's tensors.

    Args:
      model_name: ``"vit_b16"``, ``"swin_t"`` or ``"roberta_base"`` (the config's ``model.name``).
      params: the model's freshly initialized parameters (their structure and shapes are the
        contract; the classification head keeps these values when the checkpoint has none of
        the right size).
      source: a file, a folder or a cached Hugging Face name (:func:`resolve_checkpoint`).

    Returns:
      ``(params, report)``: the loaded tree (float32 arrays, same structure) and a
      :class:`LoadReport` listing the re-initialized head and the unused checkpoint entries.

    Raises:
      PretrainedError: the file is missing, belongs to another architecture, or does not match
        the model (the message lists the missing, unexpected and mis-shaped keys).
    """
    check_checkpoint(model_name, source)
    arch = ARCHITECTURES[model_name]
    files = resolve_checkpoint(source, arch.example)
    state = _read(files)
    target = _flatten(params)
    converted: dict[str, np.ndarray] = {}
    ignored, unexpected = [], []
    for key in sorted(state):
        short = key[len(arch.prefix) :] if key.startswith(arch.prefix) else key
        for pattern, template, transform in arch.rules:
            match = re.fullmatch(pattern, short)
            if match:
                converted[template.format(*match.groups())] = transform(np.asarray(state[key]))
                break
        else:
            if any(re.fullmatch(p, short) for p in arch.ignored):
                ignored.append(key)
            else:
                unexpected.append(key)
    reinitialized, wrong_shape = [], []
    loaded = dict(target)
    for path, value in converted.items():
        if path not in target:
            unexpected.append(path)
        elif tuple(value.shape) != tuple(target[path].shape):
            if path in arch.head:
                reinitialized.append(path)
            else:
                wrong_shape.append(f"{path} {tuple(value.shape)} vs {tuple(target[path].shape)}")
        else:
            loaded[path] = np.asarray(value, np.float32)
    missing = [p for p in target if p not in converted and p not in arch.head]
    reinitialized += [p for p in arch.head if p in target and p not in converted]
    if missing or unexpected or wrong_shape:
        parts = []
        if missing:
            parts.append(f"missing {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {_listing(unexpected)}")
        if wrong_shape:
            parts.append(f"wrong shapes {_listing(wrong_shape)}")
        raise PretrainedError(
            f"model.pretrained={source!r} does not fit model.name={model_name!r} with this "
            f"config ({'; '.join(parts)}): check that the checkpoint is a "
            f"{arch.model_types[0]} model like {arch.example!r} and that model.* sizes match it."
        )
    report = LoadReport(
        files[0],
        len(converted) - len(set(reinitialized) & set(converted)),
        sorted(set(reinitialized)),
        ignored,
    )
    return _unflatten(loaded), report
