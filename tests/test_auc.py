"""Deep AUC maximization (Fed minimax (Zhang & Gao) Eq. 20), exact ROC AUC, the Zipf text task, the
configs."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fast_jit

from fedorth import data as data_lib
from fedorth import models
from fedorth.data.heavy_tailed import load_zipf_sentiment, zipf_probabilities
from fedorth.models.auc import (
    auc_minimax_loss,
    optimal_auc_variables,
    pooled_positive_ratio,
    roc_auc,
)

# ----------------------------------------------------------------------------- Eq. 20 loss


def _np_eq20(h, y, a, b, alpha, p):
    """Fed minimax (Zhang & Gao) Eq. 20 transcribed with b in {1, -1} (float64)."""
    out = []
    for hi, yi in zip(h, y, strict=True):
        lab = 1 if yi == 1 else -1
        ip, ineg = float(lab == 1), float(lab == -1)
        out.append(
            (1 - p) * (hi - a) ** 2 * ip
            + p * (hi - b) ** 2 * ineg
            + 2 * (1 + alpha) * (p * hi * ineg - (1 - p) * hi * ip)
            - p * (1 - p) * alpha**2
        )
    return np.array(out)


def test_auc_loss_is_eq20():
    h = np.array([0.1, 0.9, 0.4, 0.55, 0.3])
    y = np.array([0, 1, 0, 1, 0])
    got = auc_minimax_loss(jnp.asarray(h), jnp.asarray(y), 0.3, -0.2, 0.7, 0.25)
    np.testing.assert_allclose(got, _np_eq20(h, y, 0.3, -0.2, 0.7, 0.25), rtol=1e-6, atol=1e-7)


def test_auc_saddle_value_is_pairwise_square_loss():
    """With p the batch's positive ratio, the saddle point is (E[h|+], E[h|-], E[h|-] - E[h|+]),
    grad_(a, b, alpha) mean f = 0 there, and the value is p(1-p)(mean_{+,-}(1 - h+ + h-)^2 - 1)."""
    rng = np.random.default_rng(0)
    h = rng.uniform(size=40)
    y = (rng.uniform(size=40) < 0.3).astype(np.int32)
    p = y.mean()
    a, b, alpha = optimal_auc_variables(h, y)
    with jax.enable_x64(True):

        def mean_f(v):
            return jnp.mean(auc_minimax_loss(jnp.asarray(h), jnp.asarray(y), v[0], v[1], v[2], p))

        v = jnp.array([a, b, alpha])
        value = float(mean_f(v))
        np.testing.assert_allclose(jax.grad(mean_f)(v), 0.0, atol=1e-12)
        # min over (a, b), max over alpha: moving a or b raises f, moving alpha lowers it.
        for i, sign in ((0, 1), (1, 1), (2, -1)):
            e = jnp.zeros(3).at[i].set(0.1)
            assert sign * (float(mean_f(v + e)) - value) > 0
    pos, neg = h[y == 1], h[y == 0]
    pairwise = np.mean((1.0 - pos[:, None] + neg[None, :]) ** 2)
    np.testing.assert_allclose(value, p * (1 - p) * (pairwise - 1.0), rtol=1e-12)


# -------------------------------------------------------------------------------- ROC AUC


def _brute_auc(s, y):
    pos, neg = s[y == 1], s[y == 0]
    d = pos[:, None] - neg[None, :]
    return np.mean((d > 0) + 0.5 * (d == 0))


@pytest.mark.parametrize(
    "scores,labels,expected",
    [
        ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75),  # the textbook example
        ([0.5, 0.5, 0.2, 0.9], [1, 0, 0, 1], 0.875),  # one tie counts 1/2
        ([1, 2, 3, 4], [0, 0, 1, 1], 1.0),
        ([4, 3, 2, 1], [0, 0, 1, 1], 0.0),
        ([7, 7, 7, 7, 7], [1, 0, 1, 0, 0], 0.5),
    ],
)
def test_roc_auc_hand_cases(scores, labels, expected):
    assert roc_auc(scores, labels) == pytest.approx(expected, abs=1e-15)


def test_roc_auc_matches_pairwise_with_ties_and_mask():
    rng = np.random.default_rng(1)
    s = np.round(rng.normal(size=301), 1)  # many ties
    y = (rng.uniform(size=301) < 0.2).astype(np.int32)
    assert roc_auc(s, y) == pytest.approx(_brute_auc(s, y), abs=1e-13)
    mask = rng.uniform(size=301) < 0.7
    assert roc_auc(s, y, mask=mask) == pytest.approx(_brute_auc(s[mask], y[mask]), abs=1e-13)
    assert np.isnan(roc_auc(s, np.zeros_like(y)))


# ---------------------------------------------------------------------------- the wrapper


def _tiny_auc_model(p=0.3):
    return models.get_model(
        "auc", base="rnn", positive_ratio=p, hidden_size=8, num_layers=1, embed_dim=4,
        vocab_size=50, num_classes=2,
    )  # fmt: skip


def test_auc_model_loss_and_eval_agree_with_eq20():
    model = _tiny_auc_model()
    x = np.random.default_rng(0).integers(0, 50, (6, 5)).astype(np.int32)
    y = np.array([1, 0, 0, 1, 0, 0], np.int32)
    mask = np.array([1.0, 1.0, 0.0, 1.0, 1.0, 0.0], np.float32)
    # The init's bits do not matter here (a, b, alpha are set below): one compiled program.
    params, state = fast_jit(model.init)(jax.random.key(1), x)
    assert set(params) == {"net", "a", "b", "dual"} and set(params["dual"]) == {"alpha"}
    params = {**params, "a": jnp.float32(0.2), "b": jnp.float32(0.6), "dual": {"alpha": 0.1}}

    @fast_jit
    def run(params, state):  # the four functions in one program
        batch = {"x": x, "y": y}
        return (
            model.predict_fn(params, state, x),
            model.base.predict_fn(params["net"], state, x),
            model.loss_fn(params, state, batch, None)[0],
            model.eval_fn(params, state, {**batch, "mask": mask}),
        )

    h, logits, loss, out = run(params, state)
    h, logits = np.asarray(h, np.float64), np.asarray(logits, np.float64)
    softmax = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(h, softmax[:, 1] / softmax.sum(-1), rtol=1e-5)
    ref = _np_eq20(h, y, 0.2, 0.6, 0.1, 0.3)
    np.testing.assert_allclose(loss, ref.mean(), rtol=1e-5)
    np.testing.assert_allclose(out["loss_sum"], (ref * np.asarray(mask)).sum(), rtol=1e-5)
    assert float(out["count"]) == 4.0
    np.testing.assert_allclose(out["per_example"]["score"], h, rtol=1e-5)
    with pytest.raises(ValueError, match="positive_ratio"):
        _tiny_auc_model(p=1.0)


def test_pooled_positive_ratio():
    """Equal negatives m per client, r_i m/(1 - r_i) positives: pooled ratio by counting."""
    ratios = (0.05, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25)
    m = 10_000
    pos = sum(r * m / (1 - r) for r in ratios)
    assert pooled_positive_ratio(ratios) == pytest.approx(pos / (pos + 8 * m), rel=1e-12)
    assert pooled_positive_ratio([0.1] * 8) == pytest.approx(0.1, rel=1e-12)


# -------------------------------------------------------------------------- the Zipf task


def test_zipf_sentiment_data():
    """Shapes, right padding, balanced labels, determinism, and Zipf's rank-frequency law."""
    x, y, xt, yt, meta = load_zipf_sentiment(seed=0)
    assert x.dtype == np.int32 and x.shape == (8000, 8) and xt.shape == (2000, 8)
    assert set(np.unique(y)) == {0, 1} and abs(y.mean() - 0.5) < 0.01
    assert np.all(np.diff((x > 0).astype(int), axis=1) <= 0)  # words first, then padding 0
    assert np.array_equal(x, load_zipf_sentiment(seed=0)[0])
    assert not np.array_equal(x, load_zipf_sentiment(seed=1)[0])
    counts = np.bincount(x[x > 0] - 2, minlength=998).astype(np.float64)
    probs = zipf_probabilities(998, 1.1)
    # Top-50 ranks: each count within 5 binomial standard deviations of n P(k).
    n = counts.sum()
    top = slice(0, 50)
    sd = np.sqrt(n * probs[top] * (1 - probs[top]))
    assert np.all(np.abs(counts[top] - n * probs[top]) < 5 * sd)
    slope = np.polyfit(np.log(np.arange(1, 51)), np.log(counts[top]), 1)[0]
    assert slope == pytest.approx(-1.1, abs=0.1)
    assert "zipf_sentiment" in data_lib.DATASETS


def test_zipf_words_make_embedding_gradient_noise_heavier():
    """Rare words give rare, large gradients: the per-coordinate noise of the embedding gradient
    (mini-batch minus full gradient, pooled over coordinates) has a far heavier tail with Zipf
    word frequencies than with uniform ones (same model, same seed). Measured kurtosis ~270 vs
    ~80; the check asks for 2x."""
    model = models.get_model(
        "auc", base="rnn", positive_ratio=0.5, hidden_size=8, num_layers=1, embed_dim=8,
        vocab_size=1000, num_classes=2,
    )  # fmt: skip
    x0, _, _, _, _ = load_zipf_sentiment(seed=0, num_train=2000)
    params, state = model.init(jax.random.key(0), x0[:2])
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 2000, size=(60, 64)))

    @fast_jit
    def embedding_noise(x, y):
        def grad(rows):
            batch = {"x": x[rows], "y": y[rows]}
            g = jax.grad(lambda q: model.loss_fn(q, state, batch, None)[0])(params)
            return g["net"]["Embed_0"]["embedding"]

        full = grad(jnp.arange(x.shape[0]))
        return jax.vmap(grad)(idx) - full[None]

    kurtosis = {}
    for exponent in (1.1, 0.0):
        x, y, *_ = load_zipf_sentiment(seed=0, num_train=2000, zipf_exponent=exponent)
        d = np.asarray(embedding_noise(jnp.asarray(x), jnp.asarray(y)), np.float64)
        kurtosis[exponent] = np.mean((d - d.mean()) ** 4) / np.var(d) ** 2
    assert kurtosis[1.1] > 2.0 * kurtosis[0.0], kurtosis


# ------------------------------------------------------------------- the runner and configs

MINIMAX_CONFIGS = (
    "fed_nsgda_m",
    "fedmuon_da",
    "fedsgda_clip",
    "local_sgda",
    "local_sgdam",
    "fedsgda_m",
    "f_sagda",
    "fess_gda",
)


def test_config_presets():
    """Every config builds its algorithm; paper presets follow Fed minimax (Zhang & Gao) §5."""
    from fedorth import fed

    for name in MINIMAX_CONFIGS:
        module = importlib.import_module(f"configs.{name}")
        config = module.get_config()
        assert config.fed.algorithm == name and config.data.name == "zipf_sentiment"
        fed.get_algorithm(name, config.optim.to_dict(), **config.fed.options.to_dict())
        paper = module.get_config("sst2_hetero_p16")
        assert paper.data.name == "glue/sst2" and paper.fed.local_steps == 16
        assert paper.fed.batch_size == 64 and paper.data.num_clients == 8
        assert tuple(paper.data.partition_kwargs.ratios) == (
            0.05, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25,
        )  # fmt: skip
        assert paper.model.hidden_size == 4096 and paper.model.embed_dim == 300
        homo = module.get_config("sentiment140_homo_p8")
        assert homo.data.partition_kwargs.ratios == 0.1 and homo.model.positive_ratio == 0.1
    with pytest.raises(ValueError, match="sentiment140_homo_p4"):
        importlib.import_module("configs.fed_nsgda_m").get_config("sst2_homo_p5")


def _small(config, rounds=2):
    config.fed.rounds = rounds
    config.eval_every = rounds
    config.data.dataset_kwargs.num_train = 1000
    config.data.dataset_kwargs.num_test = 300
    config.eval_batch_size = 128  # 300 = 2 * 128 + 44: the padded last batch is masked
    return config


# Every AUC config's default preset trains two rounds (tests/test_configs.py::
# test_default_preset_trains_two_rounds), and a run of one through fedorth.train.run writes
# test_auc in every metrics.jsonl row (test_a_default_run_writes_the_outputs_of_the_contract).


def test_eval_fn_reports_exact_test_auc():
    """The runner's eval: test_auc is the exact ROC AUC of all test scores (padding masked)."""
    from fedorth.train import builders

    experiment = builders.build(_small(importlib.import_module("configs.fed_nsgda_m").get_config()))
    server = builders.init_server(experiment)
    out = builders.make_eval_fn(experiment)(server.params, server.model_state)
    data = experiment.data
    predict = fast_jit(experiment.model.predict_fn)  # one program, not op by op
    scores = np.asarray(predict(server.params, server.model_state, data.x_test), np.float64)
    assert set(out) == {"test_loss", "test_accuracy", "test_auc"}
    assert out["test_auc"] == pytest.approx(roc_auc(scores, data.y_test), abs=1e-6)
    # Eq. 20 at the initial a = b = alpha = 0, p = 0.1, in float64 NumPy.
    values = _np_eq20(scores, np.asarray(data.y_test), 0.0, 0.0, 0.0, 0.1)
    assert float(out["test_loss"]) == pytest.approx(float(np.mean(values)), rel=1e-4, abs=1e-6)
