"""The accuracy of Shakespeare's and StackOverflow's next-token models leaves the padding id 0
out, as TFF reports it (``MaskedCategoricalAccuracy(masked_tokens=[pad])``), while the loss
counts every target, as TFF's ``SparseCategoricalCrossentropy`` does
(``fedorth.models.Model.pad_id``, set by ``fedorth.train.builders.build_model``)."""

from __future__ import annotations

import jax
import numpy as np
import optax

from fedorth.train import builders
from tests.test_data_natural import SNIPPETS, write_fedjax_sqlite
from tests.test_reliability import tiny_config


def shakespeare_experiment(tmp_path, name: str = "shakespeare"):
    clients = {c: {"snippets": np.array(s, dtype=object)} for c, s in SNIPPETS.items()}
    for split in ("train", "test"):
        write_fedjax_sqlite(tmp_path / f"shakespeare_{split}.sqlite", clients)
    config = tiny_config(
        **{
            "data.name": name,
            "data.data_dir": str(tmp_path),
            "data.partition": "natural",
            "data.num_clients": 2,
            "data.dataset_kwargs": {"sequence_length": 10},
            "eval_per_client": True,
            "eval_batch_size": 3,
        }
    )
    config.model = {"name": "llama", "size": "tiny"}
    return builders.build(config)


def test_shakespeare_accuracy_leaves_the_padding_out_and_the_loss_keeps_it(tmp_path):
    experiment = shakespeare_experiment(tmp_path)
    assert experiment.model.pad_id == 0
    params, state = experiment.init_params, experiment.init_model_state
    out = builders.make_eval_fn(experiment)(params, state)
    x = np.asarray(experiment.data.x_test)
    targets = x[:, 1:]
    logits = np.asarray(experiment.model.predict_fn(params, state, x[:, :-1]), np.float64)
    scored = targets != 0
    assert 0 < scored.mean() < 1, "the fixture's windows hold padding"
    correct = logits.argmax(-1) == targets
    np.testing.assert_allclose(out["test_accuracy"], correct[scored].mean(), rtol=1e-6)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    np.testing.assert_allclose(out["test_loss"], np.mean(losses), rtol=1e-5)
    owner = np.asarray(experiment.data.test_client)
    per_client = [correct[owner == c][scored[owner == c]].mean() for c in range(2)]
    np.testing.assert_allclose(out["test_accuracy_client_mean"], np.mean(per_client), rtol=1e-6)
    # The training metric too: the accuracy over the batch's unpadded targets.
    batch = {"x": x}
    _, (_, metrics) = experiment.model.loss_fn(params, state, batch, jax.random.key(0))
    np.testing.assert_allclose(metrics["accuracy"], correct[scored].mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], np.mean(losses), rtol=1e-5)


def test_other_language_models_count_every_target():
    """Only the natural next-token datasets: a model built for any other keeps pad_id None."""
    config = tiny_config(**{"data.name": "c4"})
    config.model = {"name": "llama", "size": "tiny"}
    model = builders.build_model(config, type("Data", (), {"num_classes": 257})())
    assert model.task == "lm" and model.pad_id is None
