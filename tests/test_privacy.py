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
@pytest.mark.parametrize("strategy", ["sequential"])
def test_no_noise_and_huge_clip_is_the_run_without_dp(name, optim, strategy):
    """sigma = 0 and C = 1e30: every upload (delta, control variates, FedPAC's Theta) passes
    unchanged and S / D = 1, so the run equals the run without privacy bit for bit (one client
    at a time, the CPU default; vmapped clients compile with the clipping fused in, whose
    layouts agree only to float32 rounding, as the strategies do with each other)."""
    data = fp.quadratic_clients(N, seed=5)
    algorithm = fed.get_algorithm(name, optim)
    dp = privacy.ClientDP(clip_norm=1e30, noise_multiplier=0.0, denominator=S)
    plain, _ = _run(None, data, strategy, rounds=3, algorithm=algorithm)
    private, _ = _run(dp, data, strategy, rounds=3, algorithm=algorithm)
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
