"""Reddi et al. 2021's tasks ("Adaptive Federated Optimization"): its models' sizes, the presets'
tuned rates, and one run of each task's preset through the command line on fixture files."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
import test_data_natural as natural_files

from configs import fedadagrad, fedadam, fedavg, fedavgm, fedpac_muon, fedyogi, presets
from fedorth import catalog, models

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name,kwargs,x,count",
    [
        # conv 320 + conv 18,496 + dense 1,179,776 (12*12*64*128 + 128) + dense 7,998.
        ("emnist_cnn", {}, np.zeros((2, 28, 28, 1), np.float32), 1_206_590),
        # embedding 720 + LSTMs 271,360 + 525,312 + dense 23,130 (TFF's 90 character ids).
        ("lstm_lm", {}, np.zeros((2, 81), np.int32), 820_522),
        # embedding 960,384 + LSTM 2,055,560 + dense 64,416 + dense 970,388 (10,004 word ids).
        (
            "lstm_lm",
            {"num_classes": 10004, "embed_dim": 96, "hidden_sizes": (670,), "projection": 96},
            np.zeros((2, 21), np.int32),
            4_050_748,
        ),
        # StackOverflow tags: dense 10,000 -> 500 (5,000,000 weights + 500 biases).
        ("multilabel_lr", {}, np.zeros((2, 10000), np.float32), 5_000_500),
    ],
)
def test_reddi_models_have_the_papers_layers(name, kwargs, x, count):
    model = models.get_model(name, **kwargs)
    params, _ = jax.eval_shape(model.init, jax.random.key(0), x)
    assert sum(np.prod(a.shape) for a in jax.tree.leaves(params)) == count
    shapes = jax.eval_shape(
        model.predict_fn, params, {}, x[:, :-1] if model.task == "lm" else x
    ).shape
    vocab = kwargs.get("num_classes", 90)
    expected = {"classification": (2, 62), "multilabel": (2, 500)}
    assert shapes == expected.get(model.task, (2, x.shape[1] - 1, vocab))


def test_tag_model_loss_and_recall_at_5_match_numpy_float64():
    """Keras's BinaryCrossentropy (mean over the tags of each example) averaged over the
    unmasked examples, and Recall(top_k=5): true tags among each example's 5 largest scores over
    all true tags, pooled over the examples."""
    rng = np.random.default_rng(0)
    model = models.get_model("multilabel_lr", num_classes=12)
    x = rng.random((6, 9)).astype(np.float32)
    x /= x.sum(1, keepdims=True)
    y = (rng.random((6, 12)) < 0.3).astype(np.float32)
    y[0] = 0.0  # an example without tags counts in the loss, not in the recall
    mask = np.array([1, 1, 1, 1, 1, 0], np.float32)
    params, _ = model.init(jax.random.key(0), x)
    params = jax.tree.map(lambda a: a + rng.normal(size=a.shape).astype(np.float32), params)
    batch = {"x": x, "y": y, "mask": mask}
    w = np.asarray(params["Dense_0"]["kernel"], np.float64)
    logits = x.astype(np.float64) @ w + np.asarray(params["Dense_0"]["bias"], np.float64)
    p = 1.0 / (1.0 + np.exp(-logits))
    per_example = -(y * np.log(p) + (1 - y) * np.log(1 - p)).mean(axis=1)
    top5 = np.argsort(-logits, axis=1, kind="stable")[:, :5]
    hits = np.take_along_axis(y, top5, axis=1).sum(axis=1)
    loss = (per_example * mask).sum() / mask.sum()
    recall = (hits * mask).sum() / (y.sum(axis=1) * mask).sum()
    value, (_, metrics) = model.loss_fn(params, {}, batch, None)
    np.testing.assert_allclose(float(value), loss, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["recall_at_5"]), recall, rtol=1e-6)
    sums = model.eval_fn(params, {}, batch)
    np.testing.assert_allclose(float(sums["loss_sum"]), (per_example * mask).sum(), rtol=1e-6)
    assert float(sums["count"]) == 5.0
    assert float(sums["recall_hits"]) == (hits * mask).sum()
    assert float(sums["recall_count"]) == (y.sum(axis=1) * mask).sum()


def test_presets_carry_the_tuned_rates_and_say_their_weighting():
    """google-research/federated optimization/docs/hyperparameters.md (log10 rates)."""
    cases = [
        (fedadam, "reddi_emnist_examples", -1.5, {"server_lr": -2.5, "server_tau": -4}),
        (fedyogi, "reddi_shakespeare_examples", 0, {"server_lr": -2, "server_tau": -3}),
        (fedadagrad, "reddi_stackoverflow_examples", -0.5, {"server_lr": -1.5, "server_tau": -4}),
        (fedavgm, "reddi_emnist_examples", -1.5, {"server_lr": -0.5}),
        (fedavg, "reddi_shakespeare_examples", 0, {}),
        # Stack Overflow LR: client rate 10^2 for a loss summed over the batch of 100 (Keras
        # Reduction.SUM), 10^4 for fedorth's mean over the batch.
        (fedadagrad, "reddi_stackoverflow_tags_examples", 4, {"server_lr": 1, "server_tau": -2}),
        (fedyogi, "reddi_stackoverflow_tags_examples", 4, {"server_lr": -0.5, "server_tau": -5}),
        (fedavgm, "reddi_stackoverflow_tags_examples", 4, {"server_lr": 0}),
    ]
    for module, preset, client, server in cases:
        config = module.get_config(preset)
        assert config.fed.aggregation == "examples", preset
        np.testing.assert_allclose(np.log10(config.optim.learning_rate), client)
        for key, value in server.items():
            np.testing.assert_allclose(np.log10(config.fed.options[key]), value, err_msg=key)
    assert fedyogi.get_config("reddi_shakespeare_examples").fed.options.server_opt == "yogi"
    assert fedavgm.get_config("reddi_emnist_examples").fed.options.server_momentum == 0.9
    seed = fedpac_muon.get_config("reddi_stackoverflow_uniform")
    default = fedpac_muon.get_config()
    assert seed.fed.aggregation == "uniform" and seed.optim == default.optim
    assert (seed.fed.clients_per_round, seed.fed.batch_size, seed.fed.rounds) == (50, 16, 1500)
    tags = fedadam.get_config("reddi_stackoverflow_tags_examples")
    assert (tags.data.name, tags.model.name) == ("stackoverflow_tags", "multilabel_lr")
    assert (tags.fed.clients_per_round, tags.fed.batch_size, tags.fed.rounds) == (10, 100, 1500)
    listing = catalog.listing(ROOT / "configs")
    for task in presets.REDDI_TASKS:
        assert f"reddi_{task}_examples" in listing and f"reddi_{task}_uniform" in listing


def _write_fixtures(folder: pathlib.Path) -> None:
    rng = np.random.default_rng(0)
    sizes = {"f0001_00": 6, "f0002_00": 3, "f0003_00": 5}
    for split in ("train", "test"):
        clients = natural_files.emnist_clients(rng, sizes)
        natural_files.write_fedjax_sqlite(folder / f"federated_emnist_{split}.sqlite", clients)
        snippets = {
            c: {"snippets": np.array(list(s), dtype=object)}
            for c, s in natural_files.SNIPPETS.items()
        }
        natural_files.write_fedjax_sqlite(folder / f"shakespeare_{split}.sqlite", snippets)
        stack = natural_files.stack_clients()
        natural_files.write_fedjax_sqlite(folder / f"stackoverflow_{split}.sqlite", stack)
    natural_files.write_stack_tag_count(folder)


RUNS = [
    ("fedadam", "reddi_emnist_examples", []),
    ("fedavgm", "reddi_shakespeare_examples", ["--config.model.hidden_sizes=(16, 16)"]),
    ("fedpac_muon", "reddi_stackoverflow_uniform", ["--config.model.hidden_sizes=(16,)"]),
    # The tag model at its full 10,000 x 500 size, with per-client recall@5.
    ("fedadagrad", "reddi_stackoverflow_tags_examples", ["--config.eval_per_client=true"]),
]


@pytest.mark.slow
def test_each_task_preset_runs_through_the_command_line(tmp_path):
    """``python -m experiments.main --config=configs/<algorithm>.py:reddi_<task>_<rule>`` on
    FedJAX SQLite fixture files, with the federation cut down by overrides."""
    _write_fixtures(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_NUM_CPU_DEVICES": "1"}
    for algorithm, preset, extra in RUNS:
        workdir = tmp_path / preset
        args = [
            sys.executable,
            "-m",
            "experiments.main",
            f"--config=configs/{algorithm}.py:{preset}",
            f"--workdir={workdir}",
            f"--config.data.data_dir={tmp_path}",
            "--config.data.num_clients=2",
            "--config.fed.clients_per_round=2",
            "--config.fed.local_steps=1",
            "--config.fed.rounds=1",
            "--config.fed.batch_size=2",
            "--config.eval_every=1",
            "--config.checkpoint_every=0",
            *extra,
        ]
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{preset}: {done.stderr[-2000:]}"
        rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        losses = [r["train_loss"] for r in rows if "train_loss" in r]
        assert losses and np.isfinite(losses).all(), (preset, rows)
        if "tags" in preset:  # Reddi et al.'s metric for tag prediction
            evals = [r for r in rows if "test_loss" in r]
            assert evals and all(0 <= r["test_recall_at_5"] <= 1 for r in evals), rows
            assert all(0 <= r["test_recall_at_5_client_mean"] <= 1 for r in evals), rows
            assert np.isfinite([r["test_loss"] for r in evals]).all(), rows
            assert "test_recall_at_5" in done.stdout + done.stderr  # the progress, the summary


def test_tag_input_spec_follows_the_loader_options():
    """The shapes a run's memory estimate reads without loading the data."""
    from fedorth.train import builders

    shape, dtype, tags = builders.input_spec("stackoverflow_tags")
    assert (shape, np.dtype(dtype), tags) == ((10000,), np.float32, 500)
    small = builders.input_spec("stackoverflow_tags", {"vocab_size": 7, "tag_vocab_size": 3})
    assert (small[0], small[2]) == ((7,), 3)
