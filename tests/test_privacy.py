"""Client-level differential privacy (``fedorth.fed.privacy``, ``fedorth.train.privacy``).

* DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models",
  Alg. 1, fixed denominator) against a float64 NumPy transcription of its aggregation, with the
  noise drawn from the same key, under every execution strategy;
* adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive
  Clipping", Alg. 1): the clip norm's geometric update;
* the accountant against ``dp_accounting`` itself and against a published DP-FedAvg epsilon;
* no noise and an unreachable clip norm reproduce the run without privacy bit for bit.
"""

from __future__ import annotations

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedorth import fed
from fedorth.fed import privacy

N, S, K, LR = 5, 3, 2, 0.05
STRATEGIES = [
    ("vmap", None),
    ("sequential", None),
    ("chunked", 2),
    pytest.param("sharded", None, marks=pytest.mark.cpu_devices),
]


def _client_deltas(data, ids, params, algorithm_step=None):
    """Float64 FedAvg-SGD deltas ``x_i^K - x^r`` of clients ``ids`` from ``params``."""
    deltas = []
    for i in ids:
        w, b = params["w"].copy(), params["b"].copy()
        for _ in range(K):
            gw, gb = fp.np_grads(data, i, w, b)
            w, b = w - LR * gw, b - LR * gb
        deltas.append({"w": w - params["w"], "b": b - params["b"]})
    return deltas


def _np_dp_round(data, params, round_index, clip_norm, dp, key=0):
    """DP-FedAvg's server step in float64: clip each upload to ``C`` (one norm over the whole
    upload), add ``sigma_Delta C z`` to the sum, divide by ``D``; and the clip norm's update."""
    ids = fp.sampled_ids(jax.random.key(key), round_index, N, S)
    round_key = jax.random.fold_in(jax.random.key(key), round_index)
    keys = privacy.round_keys(round_key)
    z = privacy.gaussian_noise(keys["noise"], {"delta": fp.zero_params()})["delta"]
    total = {k: np.zeros_like(v) for k, v in params.items()}
    unclipped = 0.0
    for delta in _client_deltas(data, ids, params):
        norm = np.sqrt(sum(np.sum(v**2) for v in delta.values()))
        unclipped += float(norm <= clip_norm) - 0.5
        for k in total:
            total[k] += delta[k] * min(1.0, clip_norm / norm)
    std = dp.update_noise_multiplier * clip_norm
    new = {k: params[k] + (total[k] + std * np.asarray(z[k])) / dp.denominator for k in params}
    count_noise = dp.count_noise_multiplier * float(jax.random.normal(keys["count"], ()))
    fraction = (unclipped + count_noise) / dp.denominator + 0.5
    next_clip = clip_norm
    if dp.adaptive_quantile is not None:
        next_clip = clip_norm * np.exp(-dp.clip_learning_rate * (fraction - dp.adaptive_quantile))
    return new, next_clip


def _run(dp, data, strategy="sequential", chunk_size=None, rounds=2, algorithm=None):
    algorithm = algorithm or fed.get_algorithm("fedavg", {"name": "sgd"})
    return fp.run_rounds(
        algorithm,
        data,
        rounds=rounds,
        num_clients=N,
        clients_per_round=S,
        local_steps=K,
        learning_rate=LR,
        strategy=strategy,
        chunk_size=chunk_size,
        privacy=dp,
    )


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("strategy,chunk_size", STRATEGIES)
def test_dp_fedavg_matches_numpy(strategy, chunk_size):
    """Two rounds of DP-FedAvg (C small enough that some uploads are clipped, sigma = 1.1)
    equal the float64 transcription, noise drawn from the same round key, on every strategy."""
    data = fp.quadratic_clients(N, seed=3)
    dp = privacy.ClientDP(clip_norm=0.3, noise_multiplier=1.1, denominator=S)
    server, history = _run(dp, data, strategy, chunk_size)
    params = {k: np.zeros(np.shape(v)) for k, v in fp.zero_params().items()}
    clip = 0.3
    for r in range(2):
        params, clip = _np_dp_round(data, params, r, clip, dp)
    for k in params:
        np.testing.assert_allclose(server.params[k], params[k], rtol=1e-12, atol=1e-14)
    assert float(history[-1]["dp_clip_norm"]) == 0.3


@pytest.mark.usefixtures("x64")
def test_adaptive_clipping_matches_numpy():
    """Andrew et al. 2021 Alg. 1: the noisy unclipped fraction moves C geometrically towards
    the target quantile; the update noise is sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^-1/2."""
    data = fp.quadratic_clients(N, seed=4)
    dp = privacy.ClientDP(
        clip_norm=0.3,
        noise_multiplier=0.8,
        denominator=S,
        adaptive_quantile=0.5,
        clip_learning_rate=0.2,
        count_noise_multiplier=0.6,
    )
    np.testing.assert_allclose(dp.update_noise_multiplier, (0.8**-2 - 1.2**-2) ** -0.5)
    server, _ = _run(dp, data, rounds=3)
    params = {k: np.zeros(np.shape(v)) for k, v in fp.zero_params().items()}
    clip = 0.3
    for r in range(3):
        params, clip = _np_dp_round(data, params, r, clip, dp)
    assert clip != 0.3
    np.testing.assert_allclose(server.privacy["clip_norm"], clip, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(server.params[k], params[k], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "name,optim",
    [("fedavg", {"name": "sgd"}), ("scaffold", {"name": "sgd"}), ("fedpac", {"name": "adamw"})],
)
@pytest.mark.parametrize(
    "strategy",
    ["sequential", "chunked", "vmap", pytest.param("sharded", marks=pytest.mark.cpu_devices)],
)
def test_no_noise_and_huge_clip_is_the_run_without_dp(name, optim, strategy):
    """sigma = 0 and C = 1e30: every upload (delta, control variates, FedPAC's Theta) passes
    unchanged and S / D = 1, so the run equals the run without privacy bit for bit, under
    every strategy (vmapped clients included: with sigma = 0 no addition of zero noise follows
    the mean, which would change how XLA fuses the mean's sum)."""
    data = fp.quadratic_clients(N, seed=5)
    algorithm = fed.get_algorithm(name, optim)
    dp = privacy.ClientDP(clip_norm=1e30, noise_multiplier=0.0, denominator=S)
    chunk_size = 2 if strategy == "chunked" else None
    plain, _ = _run(None, data, strategy, chunk_size, rounds=3, algorithm=algorithm)
    private, _ = _run(dp, data, strategy, chunk_size, rounds=3, algorithm=algorithm)
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(private.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plain_state = jax.tree.leaves((plain.opt_state, plain.control, plain.clients))
    private_state = jax.tree.leaves((private.opt_state, private.control, private.clients))
    for a, b in zip(plain_state, private_state, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.usefixtures("x64")
def test_whole_upload_is_clipped_jointly():
    """SCAFFOLD uploads its update and its control-variate change: one norm over both."""
    ctx = fed.RoundContext(
        server=fed.ServerState(
            round=jnp.zeros([], jnp.int32),
            params={},
            model_state={},
            opt_state=None,
            global_direction=None,
            control=None,
            server_opt_state=None,
            clients=None,
            key=jax.random.key(0),
            privacy={"clip_norm": jnp.asarray(1.0)},
        ),
        client_ids=jnp.arange(2),
        learning_rate=jnp.asarray(0.1),
        key=jax.random.key(1),
        num_clients=2,
        clients_per_round=2,
        local_steps=1,
    )
    dp = privacy.ClientDP(clip_norm=1.0, noise_multiplier=0.0, denominator=2)
    upload = {"delta": {"w": jnp.array([3.0, 0.0])}, "control_diff": {"w": jnp.array([0.0, 4.0])}}
    clipped = privacy.clip_upload(dp, ctx, {**upload, "loss": jnp.asarray(7.0)}, jnp.asarray(0))
    np.testing.assert_allclose(clipped["delta"]["w"], [0.6, 0.0])
    np.testing.assert_allclose(clipped["control_diff"]["w"], [0.0, 0.8])
    assert float(clipped["loss"]) == 7.0  # a diagnostic, not an upload
    assert float(clipped[privacy.UNCLIPPED]) == -0.5


# ------------------------------------------------------------------------------- accountant


def _config(**dp):
    from configs import base

    config = base.get_base_config()
    config.data.num_clients = 20
    config.fed.clients_per_round = 5
    config.fed.rounds = 30
    config.dp.clip_norm = 1.0
    config.dp.noise_multiplier = 1.2
    for key, value in dp.items():
        section, _, name = key.rpartition(".")
        (config[section] if section else config.dp)[name] = value
    return config


def test_epsilon_is_dp_accountings_for_the_runs_sampling():
    """Fixed-size sampling: S of N without replacement under replace-one (sensitivity 2C, so the
    Gaussian event's multiplier is sigma / 2); Poisson: add-or-remove-one, RDP and PLD."""
    dpa = pytest.importorskip("dp_accounting")
    from fedorth.train import privacy as train_privacy

    relation = dpa.NeighboringRelation
    expected = dpa.rdp.RdpAccountant(neighboring_relation=relation.REPLACE_ONE)
    expected.compose(dpa.SampledWithoutReplacementDpEvent(20, 5, dpa.GaussianDpEvent(0.6)), 30)
    assert train_privacy.epsilon(_config(), 1.2, 30) == expected.get_epsilon(1e-5)
    for name, accountant in (("rdp", dpa.rdp.RdpAccountant()), ("pld", dpa.pld.PLDAccountant())):
        config = _config(sampling="poisson", sampling_rate=0.25, accountant=name)
        accountant.compose(dpa.PoissonSampledDpEvent(0.25, dpa.GaussianDpEvent(1.2)), 30)
        assert train_privacy.epsilon(config, 1.2, 30) == accountant.get_epsilon(1e-5)


def test_published_epsilon_is_reproduced():
    """Bu, Dong, Long & Su 2020, "Deep Learning with Gaussian Differential Privacy" (Harvard Data
    Science Review), Fig. 4: Poisson sampling with p = 256/60000, sigma = 0.7, 70 epochs
    (16406 rounds) give (8.68, 1e-5)-DP with the moments accountant. As DP-FedAvg with Poisson
    sampling of N = 60000 clients (the same subsampled Gaussian mechanism, a client in place of
    an example), the run's accountant composes the RDP curve that, converted as the moments
    accountant does (``eps = min_a RDP(a) + log(1/delta) / (a - 1)`` over TF Privacy's orders),
    gives 8.68; ``dp_accounting``'s tighter conversion, what ``dp_epsilon`` reports, less."""
    pytest.importorskip("dp_accounting")
    from fedorth.train import privacy as train_privacy

    config = _config(sampling="poisson", sampling_rate=256 / 60000, delta=1e-5)
    config.data.num_clients = config.fed.clients_per_round = 60000
    rounds = int(70 * 60000 / 256)
    accountant, event = train_privacy.accountant_and_event(config, 0.7)
    orders = np.concatenate([np.linspace(1.1, 10.9, 99), np.arange(11, 64)])
    accountant = type(accountant)(orders)
    accountant.compose(event, rounds)
    moments = np.min(accountant._rdp + np.log(1 / 1e-5) / (orders - 1))
    assert round(float(moments), 2) == 8.68
    assert 7.5 < train_privacy.epsilon(config, 0.7, rounds) < moments


def test_published_dp_fedavg_setting_is_reproduced():
    """TensorFlow Federated's tutorial "Differential privacy in TFF" (DP-FedAvg on federated
    EMNIST, google-parfait/tensorflow-federated, docs/tutorials/
    federated_learning_with_differential_privacy.ipynb): N = 3383 clients, Poisson sampling of
    S / N, noise multiplier 0.01 S, 100 rounds, delta = 1e-5, RDP accountant. Its search for the
    fewest clients per round reaching (2, 1e-5)-DP gives S = 120 with noise multiplier 1.2, and
    its final model "satisfies (2, 1e-5)-DP". The run's accountant agrees: S = 120 is within
    epsilon 2, S = 119 (noise multiplier 1.19) is not."""
    pytest.importorskip("dp_accounting")
    from fedorth.train import privacy as train_privacy

    def epsilon(expected_clients: int) -> float:
        config = _config(sampling="poisson", sampling_rate=expected_clients / 3383, delta=1e-5)
        config.data.num_clients = config.fed.clients_per_round = 3383
        return train_privacy.epsilon(config, 0.01 * expected_clients, 100)

    assert 1.95 < epsilon(120) <= 2.0 < epsilon(119)


def test_target_epsilon_calibrates_sigma(capsys):
    """The smallest sigma whose epsilon after fed.rounds rounds is at most the target."""
    pytest.importorskip("dp_accounting")
    from fedorth.train import privacy as train_privacy

    config = _config(target_epsilon=3.0)
    sigma = train_privacy.noise_multiplier(config)
    assert train_privacy.epsilon(config, sigma, 30) <= 3.0
    assert train_privacy.epsilon(config, sigma * 0.99, 30) > 3.0
    assert f"noise_multiplier={sigma:.6g}" in capsys.readouterr().err


def test_poisson_sampling_masks_clients_and_divides_by_qn():
    """dp.sampling='poisson': every client runs, each joins with probability q by its own key;
    a left-out client uploads nothing and keeps its control variate; the sum is divided by qN."""
    data = fp.quadratic_clients(N, seed=6)
    dp = privacy.ClientDP(
        clip_norm=1e30, noise_multiplier=0.0, denominator=0.5 * N, sampling="poisson",
        sampling_rate=0.5,
    )  # fmt: skip
    algorithm = fed.get_algorithm("scaffold", {"name": "sgd"})
    server, _, _ = fp.start_rounds(
        algorithm, num_clients=N, clients_per_round=N, local_steps=K, learning_rate=LR,
        strategy="sequential", privacy=dp,
    )  # fmt: skip
    full, _, _ = fp.start_rounds(
        algorithm, num_clients=N, clients_per_round=N, local_steps=K, learning_rate=LR,
        strategy="sequential",
    )  # fmt: skip
    round_key = jax.random.fold_in(server.key, 0)
    mask_key = privacy.round_keys(round_key)["mask"]
    joined = [bool(jax.random.uniform(jax.random.fold_in(mask_key, i)) < 0.5) for i in range(N)]
    assert 0 < sum(joined) < N
    data_j = jax.tree.map(jnp.asarray, data)
    private, _ = fp.start_rounds(
        algorithm, num_clients=N, clients_per_round=N, local_steps=K, learning_rate=LR,
        strategy="sequential", privacy=dp,
    ).round_fn(server, data_j)  # fmt: skip
    params = {k: np.zeros(np.shape(v)) for k, v in fp.zero_params().items()}
    deltas = _client_deltas(data, range(N), params)
    for k in params:
        expected = sum(d[k] for d, j in zip(deltas, joined, strict=True) if j) / (0.5 * N)
        np.testing.assert_allclose(private.params[k], expected, rtol=2e-6, atol=1e-7)
    control = private.clients.control
    for i, j in enumerate(joined):
        row = jax.tree.map(lambda c, i=i: np.asarray(c[i]), control)
        assert any(np.any(v != 0) for v in jax.tree.leaves(row)) == j
    del full


# --------------------------------------------------------------------------- bad input


def _no_dp_accounting(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "dp_accounting", None)


BAD = {
    "`dp.clip_norm=0`": ({"clip_norm": 0.0}, None),
    "`dp.clip_norm=-1`": ({"clip_norm": -1.0}, None),
    "`dp.delta=0.05` with 20 clients (δ ≥ 1/N)": ({"delta": 0.05}, None),
    "`dp.target_epsilon=1e-6` in 30 rounds": ({"target_epsilon": 1e-6}, None),
    "`dp.accountant='pld'` with fixed-size sampling": ({"accountant": "pld"}, None),
    "`dp.sampling='poisson'` with `S < N`": ({"sampling": "poisson", "sampling_rate": 0.1}, None),
    "config.dp without dp-accounting installed": ({}, _no_dp_accounting),
    "FedPAC-SOAP (SOAP's bases averaged by their own rule)": (
        {"fed.algorithm": "fedpac", "optim.name": "soap"},
        None,
    ),
}


def _message(description, monkeypatch) -> str:
    from fedorth.train import validate

    overrides, patch = BAD[description]
    if patch is not None:
        patch(monkeypatch)
    with pytest.raises(validate.ConfigError) as error:
        validate.validate(_config(**overrides))
    return "error: " + str(error.value)


def _doc_row(description: str, message: str) -> str:
    text = message.replace("|", chr(92) + "|").replace("\n", "<br>")
    return f"| {description} | {text} |"


@pytest.mark.parametrize("description", list(BAD))
def test_bad_dp_input_is_one_line(description, monkeypatch):
    pytest.importorskip("dp_accounting")
    message = _message(description, monkeypatch)
    lines = message.splitlines()
    assert lines[0] == "error: Invalid config:" and len(lines) == 2, lines
    assert "Traceback" not in message
    assert "dp" in lines[1]
    assert _doc_row(description, message) in DOC.read_text(), (
        "docs/ERRORS.md lacks (run python tests/test_privacy.py):\n"
        + _doc_row(description, message)
    )


DOC = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "ERRORS.md"
SECTION = "## Differential privacy"
INTRO = """
What a run says of `config.dp` (client-level differential privacy; docs/PRIVACY.md), generated
by `python tests/test_privacy.py` from the cases of that file (the base config with 20 clients,
5 per round, 30 rounds, `dp.clip_norm=1`). Each is a config error (exit code 2, before anything
is loaded).

"""


def write_doc() -> None:
    """Rewrites the section of docs/ERRORS.md that this file's cases give."""
    from helpers import rewrite_doc_section

    rows = []
    for description in BAD:
        with pytest.MonkeyPatch.context() as monkeypatch:
            rows.append(_doc_row(description, _message(description, monkeypatch)))
    body = INTRO + "| bad input | message |\n| --- | --- |\n" + "\n".join(rows) + "\n"
    rewrite_doc_section(DOC, SECTION, body)


# --------------------------------------------------------------------------------- the CLI


def test_cli_run_writes_dp_epsilon(tmp_path):
    """A 2-round DP-FedAvg run from the command line: every evaluated row carries dp_epsilon,
    the accountant's epsilon after that round."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("dp_accounting")
    from test_reliability import TINY_ARGS

    repo = DOC.parents[1]
    command = [
        sys.executable, "-m", "experiments.main", *TINY_ARGS, f"--workdir={tmp_path / 'w'}",
        "--config.fed.rounds=2", "--config.trackers=", "--config.dp.clip_norm=0.5",
        "--config.dp.noise_multiplier=1.0", "--config.dp.delta=0.01",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    from fedorth.train import privacy as train_privacy

    config = _config(delta=0.01, noise_multiplier=1.0)
    config.data.num_clients, config.fed.clients_per_round = 4, 2
    assert [r["round"] for r in rows if "dp_epsilon" in r] == [1, 2]
    for row in rows[1:]:
        assert row["dp_epsilon"] == train_privacy.epsilon(config, 1.0, row["round"])
        assert row["dp_clip_norm"] == 0.5


def test_model_state_is_refused():
    """A model's BatchNorm statistics would reach the server unclipped: refused in one line."""
    privacy.check_model_state({})
    with pytest.raises(ValueError, match="non-trainable state") as error:
        privacy.check_model_state({"bn": {"mean": jnp.zeros(3)}})
    assert "\n" not in str(error.value)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(DOC.parents[1] / "tests"))
    write_doc()


def test_a_sweep_writes_each_replicas_dp_epsilon(tmp_path):
    """A DP sweep over seeds: each replica's evaluated rows carry the accountant's epsilon after
    that round, as a single run's do (test_cli_run_writes_dp_epsilon)."""
    import io
    import json

    pytest.importorskip("dp_accounting")
    from test_sweep import sweep_config

    from fedorth.sweep.grid import Grid
    from fedorth.sweep.runner import run_sweep
    from fedorth.train import privacy as train_privacy

    config = sweep_config(2)
    config.dp.clip_norm, config.dp.noise_multiplier, config.dp.delta = 0.5, 1.0, 0.01
    run_sweep(
        config,
        Grid(config, {"seed": [1, 2]}),
        tmp_path,
        replica_strategy="sequential",
        stream=io.StringIO(),
    )
    for seed in (1, 2):
        folder = tmp_path / f"seed={seed}"
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows if "dp_epsilon" in r] == [1, 2], folder.name
        for row in rows[1:]:
            assert row["dp_epsilon"] == train_privacy.epsilon(config, 1.0, row["round"]) > 0
