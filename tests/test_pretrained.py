"""Pretrained checkpoints (fedorth.models.pretrained) and the fine-tuning models.

The fixtures in tests/fixtures/pretrained are tiny models of each architecture, randomly
initialized by the reference implementation (Hugging Face transformers, versions in
VERSIONS.txt), saved in its safetensors layout with the reference's logits on fixed inputs
(make_fixtures.py). Matching those logits to float32 tolerance proves that the modules compute
what the references compute and that every checkpoint tensor lands where it belongs. Neither
torch nor transformers is needed here.
"""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fast_jit

from fedorth import models
from fedorth.models import pretrained

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "pretrained"

TINY = {
    "vit_b16": dict(
        image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64
    ),
    "swin_t": dict(
        image_size=32,
        patch_size=2,
        embed_dim=16,
        depths=(2, 2),
        num_heads=(2, 4),
        window_size=4,
        mlp_ratio=2.0,
    ),
    "roberta_base": dict(
        vocab_size=120, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64, max_positions=40
    ),
}


def _load(name, fixture, num_classes, **extra):
    reference = np.load(FIXTURES / fixture / "reference.npz")
    model = models.get_model(name, num_classes=num_classes, **TINY[name], **extra)
    if "input_ids" in reference:
        x = reference["input_ids"]
    else:
        x = reference["pixel_values_nchw"].transpose(0, 2, 3, 1)  # NCHW -> NHWC
    params, state = fast_jit(model.init)(jax.random.key(0), x)
    loaded, report = pretrained.load_pretrained(name, params, str(FIXTURES / fixture))
    return model, loaded, state, x, reference, report, params


@pytest.mark.parametrize(
    "name, fixture, num_classes",
    [("vit_b16", "vit", 5), ("swin_t", "swin", 5), ("roberta_base", "roberta", 3)],
)
def test_logits_match_the_reference_implementation(name, fixture, num_classes):
    model, params, state, x, reference, report, _ = _load(name, fixture, num_classes)
    logits = fast_jit(model.predict_fn)(params, state, jnp.asarray(x))
    # float32 end to end on both sides; differences are summation order (~1e-6 relative).
    np.testing.assert_allclose(np.asarray(logits), reference["logits"], rtol=2e-5, atol=2e-5)
    assert report.reinitialized == []
    assert jax.tree.structure(params) == jax.tree.structure(
        jax.eval_shape(model.init, jax.random.key(1), x)[0]
    )


def test_backbone_checkpoint_reinitializes_and_reports_the_head():
    """The ImageNet-21k ViT layout: no prefix, a pooler, no classifier."""
    model, params, state, x, reference, report, init = _load("vit_b16", "vit_backbone", 7)
    assert report.reinitialized == ["head/bias", "head/kernel"]
    assert report.ignored == ["pooler.dense.bias", "pooler.dense.weight"]
    assert "head re-initialized" in str(report) and "pooler.dense.bias" in str(report)
    np.testing.assert_array_equal(params["head"]["kernel"], init["head"]["kernel"])
    # The backbone equals the classifier fixture's backbone: same logits before the head.
    _, full, *_ = _load("vit_b16", "vit", 5)
    for path in ("cls_token", "pos_embedding"):
        np.testing.assert_array_equal(params[path], full[path])


def test_head_of_another_size_is_reinitialized_not_dropped_silently():
    _, params, _, _, _, report, init = _load("roberta_base", "roberta", 2)
    assert report.reinitialized == ["head/bias", "head/kernel"]
    np.testing.assert_array_equal(params["head"]["kernel"], init["head"]["kernel"])
    assert params["head_dense"]["kernel"].shape == (32, 32)  # same size: loaded


def _abstract_params(model):
    """The parameters' shapes and dtypes (jax.eval_shape): the refusals below are decided on
    the checkpoint's keys and shapes before any value is read, so no init is compiled."""
    return jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32))[0]


def test_checkpoint_of_another_architecture_is_a_one_line_error():
    model = models.get_model("vit_b16", num_classes=5, **TINY["vit_b16"])
    params = _abstract_params(model)
    with pytest.raises(pretrained.PretrainedError, match=r"is a 'swin' checkpoint") as error:
        pretrained.load_pretrained("vit_b16", params, str(FIXTURES / "swin"))
    assert "\n" not in str(error.value)


def test_mismatched_shapes_and_foreign_keys_list_the_keys(tmp_path):
    # Without config.json the architecture check cannot help: the key check must.
    shutil.copy(FIXTURES / "swin" / "model.safetensors", tmp_path / "model.safetensors")
    model = models.get_model("vit_b16", num_classes=5, **TINY["vit_b16"])
    params = _abstract_params(model)
    with pytest.raises(pretrained.PretrainedError, match=r"missing .*unexpected .*swin\.") as error:
        pretrained.load_pretrained("vit_b16", params, str(tmp_path))
    assert "\n" not in str(error.value)
    wide = models.get_model("vit_b16", num_classes=5, **{**TINY["vit_b16"], "mlp_dim": 96})
    params = _abstract_params(wide)
    with pytest.raises(pretrained.PretrainedError, match=r"wrong shapes layer_0/intermediate"):
        pretrained.load_pretrained("vit_b16", params, str(FIXTURES / "vit"))


def test_missing_checkpoint_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(pretrained.PretrainedError, match=r"`hf download roberta-base ") as e:
        pretrained.resolve_checkpoint("roberta-base", "roberta-base")
    assert str(tmp_path / "hub") in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(pretrained.PretrainedError, match="folder without model.safetensors"):
        pretrained.resolve_checkpoint(str(tmp_path), "roberta-base")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(pretrained.PretrainedError, match=r"not a \.safetensors file"):
        pretrained.resolve_checkpoint(str(tmp_path / "weights.bin"))


def test_hugging_face_cache_layout_is_found(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--tiny-vit" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for file in ("model.safetensors", "config.json"):
        shutil.copy(FIXTURES / "vit" / file, snapshot / file)
    (tmp_path / "hub" / "models--org--tiny-vit" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny-vit" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert pretrained.resolve_checkpoint("org/tiny-vit") == [snapshot / "model.safetensors"]
    assert json.loads((snapshot / "config.json").read_text())["model_type"] == "vit"


@pytest.mark.parametrize(
    "name, kwargs, published",
    [
        ("vit_b16", dict(num_classes=1000), 86.6e6),
        ("swin_t", dict(num_classes=1000), 28.3e6),
        ("roberta_base", dict(num_classes=2), 124.6e6),
    ],
)
def test_parameter_counts_match_the_published_models(name, kwargs, published):
    """ViT-B/16 86.6M (Dosovitskiy et al. 2020 / timm), Swin-T 28.3M (Liu et al. 2021, Table 1
    rounds to 28M), RoBERTa-base 124.6M with a 2-class head (125M in Liu et al. 2019)."""
    model = models.get_model(name, **kwargs)
    x = np.zeros((1, 8), np.int32) if name == "roberta_base" else np.zeros((1, 224, 224, 3))
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)[0]
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    assert abs(count - published) / published < 0.005, count
