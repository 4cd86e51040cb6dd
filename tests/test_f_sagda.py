"""F-SAGDA (Yang et al. 2022a, SAGDA) and the engine's pass over the sampled clients.

SAGDA's round (``fedorth.fed.algorithms.minimax_baselines``): every sampled client sends ``q_i``,
its stochastic gradient at the server point; the server returns ``v = mean_i q_i``; each runs
``K`` steps along ``grad f_i - q_i + v`` (descent on ``x``, ascent on ``y``); the server steps
``x += gamma_x mean(dx)``, ``y += gamma_y mean(dy)``. Clients are the deterministic nonconvex-PL
toy of ``fedorth.theory.minimax_toy`` (``noise="none"``), so the box is followed step by step in
float64 NumPy, here with partial participation (``S < N``): the sampled ids come from the
engine's ``sample_clients``.
"""

import functools

import fed_problems as fp
import jax
import numpy as np
import pytest

from fedorth import fed
from fedorth.theory.minimax_toy import make_minimax_toy

N, S, K, R = 5, 3, 3, 3
LR, RATIO, GAMMA_X, GAMMA_Y = 0.07, 1.5, 0.8, 0.6


def _toy():
    return make_minimax_toy(num_clients=N, noise="none", nonconvexity=0.8, quadratic=0.3, seed=4)


def _x0(toy):
    rng = np.random.default_rng(11)
    return rng.normal(size=toy.x_shape), rng.normal(size=toy.y_shape)


def _algorithm():
    return fed.get_algorithm(
        "f_sagda",
        {"name": "sgd"},
        dual_lr_ratio=RATIO,
        server_lr=GAMMA_X,
        dual_server_lr=GAMMA_Y,
    )


def _start(local_steps=K):
    """The server state at ``_x0`` and the engine's F-SAGDA round (sequential, the CPU's
    default), ``fed_problems.start_rounds`` on the toy (float64 under the ``x64`` fixture)."""
    toy = _toy()
    return fp.start_rounds(
        _algorithm(),
        num_clients=N,
        clients_per_round=S,
        local_steps=local_steps,
        learning_rate=LR,
        params=toy.init_params(*_x0(toy)),
        strategy="sequential",
        loss_fn=toy.loss_fn,
        batch_fn=toy.batch_fn,
    )


@functools.cache
def _round_fn(local_steps=K):
    """The round, built once per ``local_steps`` and shared by the tests: compiled once."""
    return _start(local_steps).round_fn


def _engine(local_steps=K, *, rounds=R, data=None):
    """The server state after ``rounds`` rounds from ``_x0`` (a fresh state each time: the
    round donates its input)."""
    server, round_fn = _start(local_steps).server, _round_fn(local_steps)
    data = _toy().data() if data is None else data
    for _ in range(rounds):
        server, _ = round_fn(server, data)
    assert round_fn._cache_size() == 1, "one compiled call serves every round"
    return server


def _np_box(toy, x0, y0, key, *, rounds=R, k=K):
    """SAGDA's round, float64 NumPy, over the engine's sampled ids."""
    x, y = x0.copy(), y0.copy()
    ey = RATIO * LR
    for t in range(rounds):
        ids = fp.sampled_ids(jax.random.key(key), t, N, S)
        # Stage 1: the sampled clients' gradients at the server point, and their mean v.
        q = {i: toy.client_grads(i, x, y) for i in ids}
        vx = np.mean([q[i][0] for i in ids], 0)
        vy = np.mean([q[i][1] for i in ids], 0)
        # Stage 2: K corrected local GDA steps per sampled client, then the server step.
        dxs, dys = [], []
        for i in ids:
            xi, yi = x.copy(), y.copy()
            for _ in range(k):
                gx, gy = toy.client_grads(i, xi, yi)
                xi, yi = xi - LR * (gx - q[i][0] + vx), yi + ey * (gy - q[i][1] + vy)
            dxs.append(xi - x)
            dys.append(yi - y)
        x, y = x + GAMMA_X * np.mean(dxs, 0), y + GAMMA_Y * np.mean(dys, 0)
    return x, y


def test_f_sagda_matches_numpy_box_with_partial_participation(x64):
    """The engine follows the float64 box over 3 rounds of S = 3 of N = 5 clients (the CPU's
    default strategy, sequential). tests/test_fed_golden.py runs F-SAGDA under vmap, chunked,
    sequential and sharded (where v is all-reduced over the devices), requires the strategies to
    agree at float32 rounding and each to keep its recorded bits."""
    toy = _toy()
    x0, y0 = _x0(toy)
    x, y = _np_box(toy, x0, y0, key=0)
    server = _engine()
    np.testing.assert_allclose(server.params["x"], x, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(server.params["dual"]["y"], y, rtol=1e-13, atol=1e-14)
    # Nothing is kept per client: no persistent states, no server control variate.
    assert server.clients is None and server.control is None


def test_prepass_is_at_the_server_point_over_the_sampled_clients_only(x64):
    """With K = 1 and exact gradients, the local direction g_i(x_t) - q_i + v is v itself, so a
    round is one GDA step along the mean gradient of the sampled clients at (x_t, y_t):
    x+ = x - gamma_x eta_x v_x (this checks that q_i is taken at the server point). A client
    not sampled this round has no influence: changing its data leaves the round bit-identical
    (K = 1 and K = 3)."""
    toy = _toy()
    x0, y0 = _x0(toy)
    ids = fp.sampled_ids(jax.random.key(0), 0, N, S)
    others = np.asarray(sorted(set(range(N)) - set(ids.tolist())))
    vx = np.mean([toy.client_grads(i, x0, y0)[0] for i in ids], 0)
    vy = np.mean([toy.client_grads(i, x0, y0)[1] for i in ids], 0)
    v_all = np.mean([toy.client_grads(i, x0, y0)[0] for i in range(N)], 0)
    data = toy.data()
    changed = dict(data)
    changed["B"] = data["B"].at[others].multiply(-3.0)
    changed["c"] = data["c"].at[others].add(5.0)
    for local_steps in (1, K):
        a = _engine(local_steps, rounds=1, data=data)
        b = _engine(local_steps, rounds=1, data=changed)
        for u, w in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
            np.testing.assert_array_equal(u, w)
        if local_steps == 1:
            x1, y1 = a.params["x"], a.params["dual"]["y"]
            np.testing.assert_allclose(x1, x0 - GAMMA_X * LR * vx, rtol=1e-13, atol=1e-15)
            np.testing.assert_allclose(y1, y0 + GAMMA_Y * RATIO * LR * vy, rtol=1e-13, atol=1e-15)
            # The mean over all N clients would give another step.
            assert np.max(np.abs(x1 - (x0 - GAMMA_X * LR * v_all))) > 1e-3


def test_f_sagda_communication():
    """Per sampled client and round: the update dx and q_i up, the model and v down, each one
    pytree like the params; Local SGDA sends dx and receives x only."""
    toy = _toy()
    params = toy.init_params()
    size = (np.prod(toy.x_shape) + np.prod(toy.y_shape)) * 4  # float32 bytes of (x, y)
    sagda = _algorithm()
    server = fed.init_server(sagda, params, {}, num_clients=N, key=jax.random.key(0))
    assert fed.communication_bytes(sagda, server) == {"bytes_up": 2 * size, "bytes_down": 2 * size}
    local = fed.get_algorithm("local_sgda", {"name": "sgd"})
    server = fed.init_server(local, params, {}, num_clients=N, key=jax.random.key(0))
    assert fed.communication_bytes(local, server) == {"bytes_up": size, "bytes_down": size}


def test_prepass_floats_needs_a_prepass():
    """The pre-pass's accounting belongs to the pre-pass: there is nothing to set without one."""
    with pytest.raises(TypeError, match="prepass_floats"):
        fed.FedAlgorithm(name="x", local_tx=_algorithm().local_tx, prepass_floats=1.0)
    assert _algorithm().corrections.prepass.floats == 1.0


@pytest.mark.parametrize("per_client", [True, False])
def test_prepass_per_client_hands_out_the_own_results_only_when_asked(x64, per_client):
    """``Prepass(per_client=False)`` (FAFED's start): the local optimizer gets the sampled
    clients' mean only, and the engine stacks nothing per client; the mean is the same."""
    import optax

    seen = set()

    def update_fn(updates, state, params=None, **extra):
        seen.update(k for k in extra if k.startswith("q"))
        return jax.tree.map(lambda q: -LR * q, extra["q_mean"]), state

    def prepass(ctx, client):
        return {"q": client.grad_fn(ctx.params)}

    algorithm = fed.FedAlgorithm(
        name="mean_of_prepass",
        local_tx=optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn),
        corrections=fed.corrections.Corrections(
            prepass=fed.corrections.Prepass(prepass, per_client=per_client)
        ),
    )
    toy = _toy()
    x0, y0 = _x0(toy)
    server, _ = fp.run_rounds(
        algorithm,
        toy.data(),
        rounds=1,
        num_clients=N,
        clients_per_round=S,
        local_steps=1,
        learning_rate=LR,
        params=toy.init_params(x0, y0),
        loss_fn=toy.loss_fn,
        batch_fn=toy.batch_fn,
    )
    ids = fp.sampled_ids(jax.random.key(0), 0, N, S)
    gx, gy = (np.mean([toy.client_grads(i, x0, y0)[j] for i in ids], 0) for j in (0, 1))
    assert seen == ({"q", "q_mean"} if per_client else {"q_mean"})
    # One step of this optimizer along the mean of the sampled clients' gradients (both
    # variables descend: no ascent transform in this test's optimizer).
    np.testing.assert_allclose(server.params["x"], x0 - LR * gx, rtol=1e-12)
    np.testing.assert_allclose(server.params["dual"]["y"], y0 - LR * gy, rtol=1e-12)
