"""LoRA (fedorth.models.lora): adapters + head are the federated model, the base stays frozen.

The base is the tiny RoBERTa fixture (tests/fixtures/pretrained/roberta, the reference's logits
in reference.npz), so the adapted model starts exactly at the pretrained one.
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import fast_jit

from fedorth import data as data_lib
from fedorth import fed, models
from fedorth.fed import local
from fedorth.models import lora, pretrained

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "pretrained" / "roberta"
TINY = dict(vocab_size=120, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64, max_positions=40)
RANK = 4


@functools.cache
def _built():
    """The adapted fixture model, built once per test process (one init compile)."""
    reference = dict(np.load(FIXTURE / "reference.npz"))
    base = models.get_model("roberta_base", num_classes=3, dropout=0.0, **TINY)
    full, state = fast_jit(base.init)(jax.random.key(0), reference["input_ids"])
    full, _ = pretrained.load_pretrained("roberta_base", full, str(FIXTURE))
    model = lora.lora(base, rank=RANK)
    trainable, frozen = model.split(full, jax.random.key(1))
    return model, full, trainable, frozen, state, reference


def _model_and_params():
    """(model, full, trainable, frozen, state, reference): fresh containers around the shared
    arrays (jax arrays are immutable), so a test may set a leaf without the next one seeing it."""
    model, *trees, reference = _built()
    return model, *(jax.tree.map(lambda leaf: leaf, tree) for tree in trees), dict(reference)


def test_trainable_count_is_r_times_in_plus_out_per_matrix_plus_the_head():
    model, full, trainable, frozen, _, _ = _model_and_params()
    adapted = sorted(trainable["adapters"])
    assert adapted == [
        f"layer_{i}.attention.{p}.kernel" for i in range(2) for p in ("query", "value")
    ]
    head = 32 * 32 + 32 + 32 * 3 + 3  # head_dense + head (RoBERTa's classification head)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable))
    assert count == len(adapted) * RANK * (32 + 32) + head
    # Nothing is both trainable and frozen, and nothing is lost.
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(full))
    frozen_count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(frozen))
    assert frozen_count + head == total and "head" not in frozen


def test_adapted_model_starts_at_the_pretrained_one():
    model, _, trainable, frozen, state, reference = _model_and_params()
    assert all(float(jnp.abs(a["b"]).max()) == 0.0 for a in trainable["adapters"].values())
    logits = fast_jit(model.predict_fn)(trainable, state, reference["input_ids"], frozen)
    np.testing.assert_allclose(np.asarray(logits), reference["logits"], rtol=2e-5, atol=2e-5)


def test_merge_adds_the_scaled_low_rank_product():
    model, full, trainable, frozen, _, _ = _model_and_params()
    key = "layer_1.attention.value.kernel"
    b = jax.random.normal(jax.random.key(2), (RANK, 32))
    trainable["adapters"][key]["b"] = b
    merged = model.merge(trainable, frozen)
    a = np.asarray(trainable["adapters"][key]["a"], np.float64)
    expected = np.asarray(full["layer_1"]["attention"]["value"]["kernel"], np.float64)
    expected += (model.alpha / model.rank) * a @ np.asarray(b, np.float64)
    np.testing.assert_allclose(
        merged["layer_1"]["attention"]["value"]["kernel"], expected, rtol=1e-5
    )
    np.testing.assert_array_equal(
        merged["layer_1"]["attention"]["key"]["kernel"],
        full["layer_1"]["attention"]["key"]["kernel"],
    )


def test_a_federated_round_trains_only_adapters_and_head_and_uploads_only_them():
    model, full, trainable, frozen, state, reference = _model_and_params()
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 120, (24, 12)).astype(np.int32)
    ids[:, 0] = 0
    labels = rng.integers(0, 3, 24).astype(np.int32)
    fed_data = data_lib.make_federated(
        ids, labels, ids[:6], labels[:6], [np.arange(i, 24, 4) for i in range(4)], "toy", 3
    ).replace(frozen_params=frozen)
    algorithm = fed.get_algorithm("fedavg", {"name": "muon", "beta": 0.9})
    # Muon acts on the adapter matrices A (in, r) and B (r, out); the head's bias goes to AdamW.
    labels_tree = local.matrix_labels(trainable)
    assert all(v == "matrix" for v in jax.tree.leaves(labels_tree["adapters"]))

    def batch_fn(data, client, key):
        return data_lib.sample_batch(data, client, key, 4)

    round_config = fed.RoundConfig(
        num_clients=4, clients_per_round=2, local_steps=2, learning_rate=0.05, strategy="vmap"
    )
    round_fn = fed.make_round_fn(algorithm, model.loss_fn, batch_fn, round_config)
    server = fed.init_server(algorithm, trainable, state, num_clients=4, key=jax.random.key(3))
    frozen_before = jax.tree.map(np.asarray, frozen)
    server, metrics = round_fn(server, fed_data)
    # The server holds exactly the trainable tree; the frozen base is bit-identical.
    assert jax.tree.structure(server.params) == jax.tree.structure(trainable)
    jax.tree.map(np.testing.assert_array_equal, frozen_before, fed_data.frozen_params)
    moved = [
        float(jnp.abs(new - old).max())
        for new, old in zip(jax.tree.leaves(server.params), jax.tree.leaves(trainable), strict=True)
    ]
    assert min(moved) > 0.0  # every adapter and head leaf trained
    # Uploads: the trainable tree's float32 bytes, nothing of the frozen base.
    up = fed.communication_bytes(algorithm, server)["bytes_up"]
    assert up == 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable))
    assert np.isfinite(float(metrics["train_loss"]))


def test_bad_targets_and_head_names_are_one_line_errors():
    base = models.get_model("roberta_base", num_classes=3, **TINY)
    full, _ = jax.eval_shape(base.init, jax.random.key(0), np.zeros((1, 8), np.int32))
    with pytest.raises(ValueError, match=r"model.lora_targets=\['qq'\] match no Dense kernel"):
        lora.lora(base, targets=("qq",)).split(full, jax.random.key(0))
    with pytest.raises(ValueError, match=r"model.lora_trainable=\['classifier'\] matches no"):
        lora.lora(base, trainable=("classifier",)).split(full, jax.random.key(0))


def test_freeze_optimizer_is_optax_partition_with_zero_updates_for_the_base():
    model, full, *_ = _model_and_params()
    tx = lora.freeze_optimizer(optax.sgd(0.1), model)
    state = tx.init(full)
    grads = jax.tree.map(jnp.ones_like, full)
    updates, _ = tx.update(grads, state, full)
    assert float(jnp.abs(updates["layer_0"]["attention"]["query"]["kernel"]).max()) == 0.0
    np.testing.assert_allclose(updates["head"]["kernel"], -0.1 * np.ones((32, 3)))


def test_builders_wrap_any_model_and_put_the_base_beside_the_data():
    """model.lora_rank on the embedded-digits MLP: the experiment's parameters are the adapters
    and the chosen head; the frozen base rides in FederatedData.frozen_params."""
    from configs import base as base_config
    from fedorth.train import builders

    config = base_config.get_base_config()
    config.model.hidden_sizes = (16, 16)
    config.model.lora_rank = 2
    config.model.lora_targets = ("Dense_[01]",)
    config.model.lora_trainable = ("Dense_2",)
    experiment = builders.build(config)
    assert sorted(experiment.init_params) == ["Dense_2", "adapters"]
    assert sorted(experiment.init_params["adapters"]) == ["Dense_0.kernel", "Dense_1.kernel"]
    frozen = experiment.data.frozen_params
    assert sorted(frozen) == ["Dense_0", "Dense_1"] and frozen["Dense_0"]["kernel"].shape == (
        64,
        16,
    )
    # The same draws as the model's own init (adapters and head), with nothing loaded.
    params, _ = experiment.model.init(
        jax.random.split(jax.random.key(config.seed))[0], experiment.data.x_train[:2]
    )
    jax.tree.map(np.testing.assert_array_equal, params, experiment.init_params)
