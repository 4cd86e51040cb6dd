"""The seeds' federated algorithms against float64 NumPy re-implementations of their boxes."""

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedorth import fed

N, S, K, R = 5, 3, 3, 4
LR = 0.05


pytestmark = pytest.mark.usefixtures("x64")


def _run(alg, data, *, rounds=R, clients_per_round=S, local_steps=K, lr=LR, num_clients=N, **kw):
    """The server state after ``rounds`` rounds (fed_problems.run_rounds) and the last metrics."""
    settings = dict(num_clients=num_clients, clients_per_round=clients_per_round)
    server, history = fp.run_rounds(
        alg, data, rounds=rounds, local_steps=local_steps, learning_rate=lr, **settings, **kw
    )
    return server, history[-1]


def test_fedavg_k1_full_participation_is_gradient_descent():
    """FedAvg, SGD, K = 1, S = N: one round is one GD step on the union of the clients' data."""
    data = fp.quadratic_clients(N)
    server, _ = _run(
        fed.get_algorithm("fedavg", {"name": "sgd"}),
        data,
        rounds=1,
        clients_per_round=N,
        local_steps=1,
    )
    w, b = np.zeros((4, 3)), np.zeros(3)
    gw = np.mean([fp.np_grads(data, i, w, b)[0] for i in range(N)], axis=0)
    gb = np.mean([fp.np_grads(data, i, w, b)[1] for i in range(N)], axis=0)
    np.testing.assert_allclose(server.params["w"], w - LR * gw, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(server.params["b"], b - LR * gb, rtol=1e-13, atol=1e-15)


def test_scaffold_matches_numpy_option_ii():
    """SCAFFOLD (Karimireddy et al. 2020, Alg. 1, option II) with partial participation."""
    data = fp.quadratic_clients(N, seed=1)
    server, _ = _run(fed.get_algorithm("scaffold", {"name": "sgd"}), data)
    w, b, c, ci = fp.np_scaffold(
        data, rounds=R, num_clients=N, clients_per_round=S, local_steps=K, lr=LR
    )
    np.testing.assert_allclose(server.params["w"], w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(server.params["b"], b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(server.control["w"], c[0], rtol=1e-10, atol=1e-12)
    for i in range(N):  # absent clients keep their c_i unchanged
        np.testing.assert_allclose(server.clients.control["w"][i], ci[i][0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm,steps", [("spectral", 5), ("sign", 0)])
def test_fedmuon_bc_matches_numpy_alg1(norm, steps):
    """FedMuon-LMO Alg. 1: persistent M_i, C_i <- M_i, lmo(M_i - C_i + C), X <- (n-S)/n X + ...

    The norm only chooses the direction function inside the local optimizer; the round around
    it is the same. Each direction (spectral with 0 and 5 steps, frobenius, sign) is checked
    against NumPy by tests/test_muon.py::test_lmo_directions_match_numpy; here the spectral
    LMO and the sign LMO (no normalization) run through the round."""
    alpha, other = 0.3, 0.5
    data = fp.quadratic_clients(N, seed=2)
    alg = fed.get_algorithm(
        "fedmuon_bc",
        {"name": "lmo", "norm": norm, "ns_steps": steps},
        alpha=alpha,
        other_lr_ratio=other,
    )
    server, _ = _run(alg, data)

    def lmo(u):
        if norm == "sign":
            return np.sign(u)
        if norm == "frobenius":
            return u / (np.linalg.norm(u) + 1e-7)
        return fp.np_newton_schulz(u, steps)

    w, b = np.zeros((4, 3)), np.zeros(3)
    m = [[np.zeros((4, 3)), np.zeros(3)] for _ in range(N)]
    ci = [[np.zeros((4, 3)), np.zeros(3)] for _ in range(N)]
    c = [np.zeros((4, 3)), np.zeros(3)]
    for r in range(R):
        ids = fp.sampled_ids(jax.random.key(0), r, N, S)
        xs, dcs = [], []
        for i in ids:
            xw, xb = w.copy(), b.copy()
            mw, mb = m[i]
            for _ in range(K):
                gw, gb = fp.np_grads(data, i, xw, xb)
                mw = (1 - alpha) * mw + alpha * gw
                mb = (1 - alpha) * mb + alpha * gb
                xw = xw - LR * lmo(mw - ci[i][0] + c[0])
                xb = xb - LR * other * (mb - ci[i][1] + c[1])
            m[i] = [mw, mb]
            dcs.append([mw - ci[i][0], mb - ci[i][1]])
            ci[i] = [mw, mb]
            xs.append([xw, xb])
        w = (N - S) / N * w + sum(x[0] for x in xs) / N
        b = (N - S) / N * b + sum(x[1] for x in xs) / N
        c = [c[0] + sum(d[0] for d in dcs) / N, c[1] + sum(d[1] for d in dcs) / N]

    np.testing.assert_allclose(server.params["w"], w, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(server.params["b"], b, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(server.control["w"], c[0], rtol=1e-9, atol=1e-11)
    for i in range(N):  # persistent state of absent clients untouched
        np.testing.assert_allclose(
            server.clients.opt_state[0][0].mu["w"][i], m[i][0], rtol=1e-9, atol=1e-11
        )
        np.testing.assert_allclose(server.clients.control["b"][i], ci[i][1], rtol=1e-9, atol=1e-11)


def test_fedmuon_matches_numpy_alg2():
    """FedMuon (Liu et al.) Alg. 2: M-bar warm start, M <- beta M + G, x -= eta[(1-a)UV^T + l x + a
    D_G]."""
    beta, alpha, wd = 0.9, 0.4, 0.01
    data = fp.quadratic_clients(N, seed=3)
    params = {"w": jnp.zeros((4, 3))}
    optim = {
        "name": "muon",
        "beta": beta,
        "nesterov": False,
        "ns_steps": 5,
        "shape_scaling": "none",
        "weight_decay": wd,
    }
    alg = fed.get_algorithm("fedmuon", optim, alpha=alpha)
    server, _ = _run(alg, data, params=params)

    jordan = (3.4445, -4.7750, 2.0315)
    w, mbar, dg = np.zeros((4, 3)), np.zeros((4, 3)), np.zeros((4, 3))
    for r in range(R):
        ids = fp.sampled_ids(jax.random.key(0), r, N, S)
        deltas, moms = [], []
        for i in ids:
            x, mom = w.copy(), mbar.copy()
            for _ in range(K):
                g = fp.np_grads(data, i, x, np.zeros(3))[0]
                mom = beta * mom + g
                u = fp.np_newton_schulz(mom, 5, jordan)
                x = x - LR * ((1 - alpha) * u + alpha * dg + wd * x)
            deltas.append(x - w)
            moms.append(mom)
        dg = -np.mean(deltas, axis=0) / (K * LR)
        w = w + np.mean(deltas, axis=0)
        mbar = np.mean(moms, axis=0)

    np.testing.assert_allclose(server.params["w"], w, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(server.global_direction["w"], dg, rtol=1e-8, atol=1e-10)


def test_degenerate_settings_reduce_to_parents():
    """FedPAC(beta=0, no alignment) == Local-X; FedMuon(alpha=0, no aggregation) == Local Muon.

    That FedMuon's flags do something (with alpha > 0 and the momentum aggregation it is not
    Local Muon) is test_fedmuon_matches_numpy_alg2's box: from round 2 on its steps carry
    alpha * D_G and start from the averaged momentum M-bar, both nonzero."""
    data = fp.quadratic_clients(N, seed=4)
    adamw = {"name": "adamw", "weight_decay": 0.01}
    a, _ = _run(fed.get_algorithm("fedpac", adamw, beta=0.0, align=False), data)
    b, _ = _run(fed.get_algorithm("local_adamw", adamw), data)
    np.testing.assert_array_equal(a.params["w"], b.params["w"])
    muon = {"name": "muon", "beta": 0.9}
    a, _ = _run(fed.get_algorithm("fedmuon", muon, alpha=0.0, momentum_aggregation=False), data)
    b, _ = _run(fed.get_algorithm("local_muon", muon), data)
    np.testing.assert_array_equal(a.params["w"], b.params["w"])


def test_localmuon_stalls_where_fedmuon_bc_converges():
    """FedMuon-LMO Theorem 1 (Appendix D): n = 2, d = 1, f_1 = x^2/2, f_2 = (x + a)^2/2, x_0 = -a/4.

    The normalized (LMO) steps of the two clients cancel, so Local Muon stays at x_0 forever,
    while FedMuon's control variates remove the bias and reach x* = -a/2.
    """
    a = 2.0
    data = {"H": np.ones((2, 1, 1)), "B": np.array([[[0.0]], [[-a]]])}
    params = {"w": jnp.full((1, 1), -a / 4)}
    lr = lambda r: 0.2 / jnp.sqrt(1.0 + r)  # decaying steps: the LMO step has a fixed length
    optim = {"name": "lmo", "norm": "frobenius", "ns_steps": 0}
    local, _ = _run(
        fed.get_algorithm("local_lmo", {**optim, "momentum": 0.5}),
        data,
        rounds=200,
        clients_per_round=2,
        local_steps=1,
        lr=lr,
        params=params,
        num_clients=2,
    )
    bc, _ = _run(
        fed.get_algorithm("fedmuon_bc", optim, alpha=0.5),
        data,
        rounds=200,
        clients_per_round=2,
        local_steps=1,
        lr=lr,
        params=params,
        num_clients=2,
    )
    x_star = -a / 2
    # The LMO is u / (|u| + eps) with eps = 1e-7, so the two clients' steps cancel up to
    # ~eps * lr per round (exactly with eps = 0, as in the theorem): over 200 rounds < 1e-5.
    local_x = float(local.params["w"][0, 0])
    assert abs(local_x - (-a / 4)) < 1e-5, f"Local Muon moved to {local_x}"
    assert abs(local_x - x_star) > a / 4 - 1e-5
    assert abs(float(bc.params["w"][0, 0]) - x_star) < 0.05 * a


def test_fedmuon_zg_matches_numpy_alg1_over_rounds():
    """FedMuon (Zhang & Gao) Alg. 1, full participation, over R rounds of tau = K steps:
    M_0 = grad f(X_0); X_{t+1} = X_t - eta (NS(M_t) + lambda X_t);
    M_{t+1} = (1 - beta) M_t + beta grad f(X_{t+1}) (line 5: the gradient at the point reached,
    each worker's own X before averaging); every tau steps average X and M (line 7).
    The previous order (update M at X_t, then step) drifted 1.4e-2 from this after round 1."""
    beta, wd, n, rounds = 0.3, 0.01, 4, 3
    data = fp.quadratic_clients(n, seed=5)
    optim = {"name": "muon", "ns_steps": 5, "weight_decay": wd}
    alg = fed.get_algorithm("fedmuon_zg", optim, beta=beta)
    server, _ = _run(alg, data, rounds=rounds, clients_per_round=n, num_clients=n)

    jordan = (3.4445, -4.7750, 2.0315)

    def direction(m):
        return {
            "w": fp.np_newton_schulz(m["w"], 5, jordan),
            "b": m["b"] / (np.linalg.norm(m["b"]) + 1e-7),
        }

    def grad(i, x):
        gw, gb = fp.np_grads(data, i, x["w"], x["b"])
        return {"w": gw, "b": gb}

    xs = [{"w": np.zeros((4, 3)), "b": np.zeros(3)} for _ in range(n)]
    ms = [grad(i, xs[i]) for i in range(n)]  # line 1
    for t in range(rounds * K):
        for i in range(n):
            d = direction(ms[i])
            xs[i] = {k: xs[i][k] - LR * (d[k] + wd * xs[i][k]) for k in xs[i]}  # lines 3-4
            g = grad(i, xs[i])
            ms[i] = {k: (1 - beta) * ms[i][k] + beta * g[k] for k in g}  # line 5
        if (t + 1) % K == 0:  # line 7
            xbar = {k: np.mean([x[k] for x in xs], axis=0) for k in xs[0]}
            mbar = {k: np.mean([m[k] for m in ms], axis=0) for k in ms[0]}
            xs = [dict(xbar) for _ in range(n)]
            ms = [dict(mbar) for _ in range(n)]

    for k in ("w", "b"):
        np.testing.assert_allclose(server.params[k], xs[0][k], rtol=1e-9, atol=1e-11, err_msg=k)
        np.testing.assert_allclose(
            server.opt_state.mu[k], ms[0][k], rtol=1e-9, atol=1e-11, err_msg=k
        )
    assert int(server.opt_state.count) == rounds * K


@pytest.mark.parametrize("client_state,server_rule", [("reset", "mean"), ("persistent", "partial")])
def test_scaffold_with_momentum_corrects_the_gradient(client_state, server_rule):
    """SCAFFOLD with momentum SGD (FedMuon-LMO's "SCAFFOLD" baseline): the correction acts on
    the gradient before the momentum, m <- mu m + (g - c_i + c), y <- y - eta (m + wd y);
    c_i+ = (1/K) sum_k g_k (option II's value under plain SGD); c <- c + (1/N) sum (c_i+ - c_i).
    persistent/partial: each client keeps m between its rounds (FedMuon-LMO Alg. 4 line 5) and
    X <- (n-S)/n X + 1/n sum_i X_i (Alg. 3 line 10)."""
    mu, wd = 0.9, 0.01
    data = fp.quadratic_clients(N, seed=6)
    optim = {"name": "sgd", "momentum": mu, "weight_decay": wd}
    alg = fed.get_algorithm("scaffold", optim, client_state=client_state, server_rule=server_rule)
    server, _ = _run(alg, data)

    zeros = lambda: {"w": np.zeros((4, 3)), "b": np.zeros(3)}  # noqa: E731
    x, c = zeros(), zeros()
    ci = [zeros() for _ in range(N)]
    mom = [zeros() for _ in range(N)]
    for r in range(R):
        ids = fp.sampled_ids(jax.random.key(0), r, N, S)
        ys, new_c = [], {}
        for i in ids:
            y, gsum = dict(x), zeros()
            m = mom[i] if client_state == "persistent" else zeros()
            for _ in range(K):
                gw, gb = fp.np_grads(data, i, y["w"], y["b"])
                g = {"w": gw, "b": gb}
                m = {k: mu * m[k] + g[k] - ci[i][k] + c[k] for k in g}
                y = {k: y[k] - LR * (m[k] + wd * y[k]) for k in y}
                gsum = {k: gsum[k] + g[k] for k in g}
            mom[i] = m
            new_c[i] = {k: gsum[k] / K for k in gsum}
            ys.append(y)
        if server_rule == "partial":
            x = {k: (N - S) / N * x[k] + sum(y[k] for y in ys) / N for k in x}
        else:
            x = {k: np.mean([y[k] for y in ys], axis=0) for k in x}
        c = {k: c[k] + sum(new_c[i][k] - ci[i][k] for i in new_c) / N for k in c}
        for i in new_c:
            ci[i] = new_c[i]

    for k in ("w", "b"):
        np.testing.assert_allclose(server.params[k], x[k], rtol=1e-10, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(server.control[k], c[k], rtol=1e-10, atol=1e-12, err_msg=k)
        for i in range(N):  # absent clients keep their c_i
            np.testing.assert_allclose(
                server.clients.control[k][i], ci[i][k], rtol=1e-10, atol=1e-12
            )


def test_fedavg_and_localmuon_follow_lmo_paper_alg3_alg4():
    """FedMuon-LMO (bias-corrected LMO) Alg. 4 (LocalMuon): M_i^(r,0) <- M_i^(r-1,K) (each
    client keeps its momentum; absent ones keep theirs), M <- (1-a) M + a grad,
    X <- X + eta lmo(M), X <- (n-S)/n X + 1/n sum_i X_i; and Alg. 3 (FedAvg) with the same
    server rule, here with momentum SGD kept per client (the paper's experiments' optimizer)."""
    a, mu = 0.3, 0.9
    data = fp.quadratic_clients(N, seed=7)
    opts = {"client_state": "persistent", "server_rule": "partial"}
    lmo = {"name": "lmo", "norm": "spectral", "ns_steps": 5, "momentum": 1 - a}
    local_muon, _ = _run(
        fed.get_algorithm("local_lmo", lmo, **opts), data, params={"w": jnp.zeros((4, 3))}
    )
    fedavg, _ = _run(fed.get_algorithm("fedavg", {"name": "sgd", "momentum": mu}, **opts), data)

    def reference(step, params):
        x = {k: np.zeros_like(np.asarray(v)) for k, v in params.items()}
        m = [{k: np.zeros_like(v) for k, v in x.items()} for _ in range(N)]
        for r in range(R):
            ids = fp.sampled_ids(jax.random.key(0), r, N, S)
            xs = []
            for i in ids:
                y = dict(x)
                for _ in range(K):
                    gw, gb = fp.np_grads(data, i, y["w"], y.get("b", np.zeros(3)))
                    g = {"w": gw, "b": gb}
                    m[i], y = step(m[i], y, {k: g[k] for k in y})
                xs.append(y)
            x = {k: (N - S) / N * x[k] + sum(y[k] for y in xs) / N for k in x}
        return x, m

    def muon_step(m, y, g):
        m = {k: (1 - a) * m[k] + a * g[k] for k in g}
        return m, {k: y[k] - LR * fp.np_newton_schulz(m[k], 5) for k in y}

    def sgd_step(m, y, g):
        m = {k: mu * m[k] + g[k] for k in g}
        return m, {k: y[k] - LR * m[k] for k in y}

    x, m = reference(muon_step, {"w": np.zeros((4, 3))})
    np.testing.assert_allclose(local_muon.params["w"], x["w"], rtol=1e-9, atol=1e-11)
    for i in range(N):
        np.testing.assert_allclose(
            local_muon.clients.opt_state[0][0].mu["w"][i], m[i]["w"], rtol=1e-9, atol=1e-11
        )
    x, m = reference(sgd_step, {"w": np.zeros((4, 3)), "b": np.zeros(3)})
    for k in ("w", "b"):
        np.testing.assert_allclose(fedavg.params[k], x[k], rtol=1e-10, atol=1e-12, err_msg=k)
