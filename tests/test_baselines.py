"""The baselines against float64 NumPy re-implementations of their updates.

Each reference follows the paper's update rules (as stated in the algorithm's module docstring)
for a few rounds on heterogeneous quadratic clients (tests/fed_problems.py) with partial
participation (S = 3 of N = 5), using the engine's sampled client ids. Gradients are the
clients' full-batch gradients, so the engine and the reference see the same numbers.

The last part holds baselines against float64 transcriptions of the outside sources found for
them: docs/FIDELITY.md ("Baselines") lists what each baseline was checked against. Where the
paper's own box could not be read but an implementation was, the test transcribes that
implementation, on the same quadratic clients, or (FAFED) on least-squares mini-batches whose
rows the transcription draws with the engine's keys (its STORM correction takes two gradients
on one batch).
"""

import dataclasses

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedorth import fed
from fedorth.optim import federated as fed_optim
from fedorth.optim.fafed import FafedState, fafed_aggregate_mask

N, S, K, R = 5, 3, 3, 4
LR = 0.05
TOL = {"rtol": 1e-10, "atol": 1e-12}


pytestmark = pytest.mark.usefixtures("x64")


def _run(alg, data, *, rounds=R, lr=LR, params=None, strategy="auto"):
    settings = dict(num_clients=N, clients_per_round=S, local_steps=K, learning_rate=lr)
    return fp.run_rounds(alg, data, rounds=rounds, params=params, strategy=strategy, **settings)[0]


# ---- float64 helpers on {"w", "b"} dicts ---------------------------------------------------


def _zeros():
    return {"w": np.zeros((4, 3)), "b": np.zeros(3)}


def _grad(data, i, x):
    gw, gb = fp.np_grads(data, i, x["w"], x["b"])
    return {"w": gw, "b": gb}


def _map(fn, *trees):
    return {k: fn(*(t[k] for t in trees)) for k in trees[0]}


def _mean(trees):
    return _map(lambda *xs: np.mean(xs, axis=0), *trees)


def _norm(x):
    return np.sqrt(sum(np.sum(v**2) for v in x.values()))


def _ids(r):
    return fp.sampled_ids(jax.random.key(0), r, N, S)


def _close(actual, expected, what, tol=TOL):
    for k in expected:
        np.testing.assert_allclose(actual[k], expected[k], err_msg=f"{what}[{k}]", **tol)


# ---- Cheng et al. 2024: FedAvg-M/-VR, SCAFFOLD-M/-VR ---------------------------------------


@pytest.mark.parametrize(
    "name,vr,cv",
    [
        ("fedavg_m", False, False),
        ("fedavg_vr", True, False),
        ("scaffold_m", False, True),
        ("scaffold_vr", True, True),
    ],
)
def test_cheng_momentum_family_matches_numpy(name, vr, cv):
    """u = b g + (1-b) g^r (+ b(c - c_i)); VR: g - (1-b) grad(x^{r-1}) + (1-b) g^r (+ b(c-c_i));
    g^{r+1} = mean(x^r - x_i^K)/(K eta), x^{r+1} = x^r - gamma g^{r+1}, c_i+ = mean raw grad."""
    beta, gamma, wd = 0.3, 0.12, 0.01
    data = fp.quadratic_clients(N, seed=11)
    alg = fed.get_algorithm(name, {"name": "sgd", "weight_decay": wd}, beta=beta, server_lr=gamma)
    server = _run(alg, data)

    x, g, x_prev, c = _zeros(), _zeros(), _zeros(), _zeros()
    ci = [_zeros() for _ in range(N)]
    for r in range(R):
        deltas, new_c = [], {}
        for i in _ids(r):
            y, gsum = dict(x), _zeros()
            cc = _map(lambda a, b: a - b, c, ci[i]) if cv else _zeros()
            for _ in range(K):
                gr = _grad(data, i, y)
                if vr:
                    gp = _grad(data, i, x_prev)
                    u = _map(
                        lambda a, p, d, e: a - (1 - beta) * p + (1 - beta) * d + beta * e,
                        gr,
                        gp,
                        g,
                        cc,
                    )
                else:
                    u = _map(lambda a, d, e: beta * (a + e) + (1 - beta) * d, gr, g, cc)
                y = _map(lambda a, b: a - LR * (b + wd * a), y, u)
                gsum = _map(np.add, gsum, gr)
            deltas.append(_map(np.subtract, y, x))
            new_c[i] = _map(lambda s: s / K, gsum)
        g = _map(lambda d: -d / (K * LR), _mean(deltas))
        x_prev, x = x, _map(lambda a, d: a - gamma * d, x, g)
        if cv:
            c = _map(
                lambda a, *d: a + sum(d) / N,
                c,
                *[_map(np.subtract, new_c[i], ci[i]) for i in new_c],
            )
            for i in new_c:
                ci[i] = new_c[i]

    _close(server.params, x, "x")
    _close(server.global_direction, g, "g")
    if vr:
        _close(server.extra["prev_params"], x_prev, "x^{r-1}")
    if cv:
        _close(server.control, c, "c")
        for i in range(N):  # absent clients keep their c_i
            _close(jax.tree.map(lambda a: a[i], server.clients.control), ci[i], f"c_{i}")


# ---- Li et al. 2020: FedProx --------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["vmap", "sequential"])
def test_fedprox_matches_li_alg2(strategy):
    """FedProx (Li et al. 2020, Alg. 2), K SGD steps on h_i(w) = f_i(w) + mu/2 ||w - x^r||^2
    (decoupled weight decay after the direction), x^{r+1} = x^r + server_lr mean_i(x_i^K - x^r)."""
    mu, wd, server_lr = 0.4, 0.01, 0.8
    data = fp.quadratic_clients(N, seed=13)
    alg = fed.get_algorithm("fedprox", {"name": "sgd", "weight_decay": wd}, mu=mu,
                            server_lr=server_lr)  # fmt: skip
    server = _run(alg, data, strategy=strategy)

    x = _zeros()
    for r in range(R):
        deltas = []
        for i in _ids(r):
            y = dict(x)
            for _ in range(K):
                g = _map(lambda a, w, x0: a + mu * (w - x0), _grad(data, i, y), y, x)
                y = _map(lambda w, d: w - LR * (d + wd * w), y, g)
            deltas.append(_map(np.subtract, y, x))
        x = _map(lambda a, d: a + server_lr * d, x, _mean(deltas))
    _close(server.params, x, "x")


def test_fedprox_with_mu_zero_is_fedavg():
    data = fp.quadratic_clients(N, seed=13)
    a = _run(fed.get_algorithm("fedprox", {"name": "sgd"}, mu=0.0), data)
    b = _run(fed.get_algorithm("fedavg", {"name": "sgd"}), data)
    for leaf_a, leaf_b in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(leaf_a, leaf_b)


def test_fedavg_m_with_averaging_server_is_fedcm():
    """Without a server lr (gamma = K eta) FedAvg-M is FedCM (Xu et al. 2021) with alpha = beta."""
    data = fp.quadratic_clients(N, seed=12)
    a = _run(fed.get_algorithm("fedavg_m", {"name": "sgd"}, beta=0.3), data)
    b = _run(fed.get_algorithm("fedcm", {"name": "sgd"}, alpha=0.3), data)
    _close(a.params, b.params, "x", tol={"rtol": 1e-13, "atol": 1e-14})


# ---- PAdaMFed / PAdaMFed-VR ---------------------------------------------------------------


@pytest.mark.parametrize("name,vr", [("padamfed", False), ("padamfed_vr", True)])
def test_padamfed_matches_numpy(name, vr):
    """x <- x - eta v/||v||, v = b(g - c_i) + d (VR: g - (1-b) grad(x^{r-1}) + d - b c_i),
    d = b c + (1-b) g_s; g_s+ = b(c + mean_S dc) + (1-b) g_s;
    x+ = x - gamma mean(x - x_i)/(K eta)."""
    beta, gamma = 0.4, 0.1
    data = fp.quadratic_clients(N, seed=13)
    server = _run(fed.get_algorithm(name, {"name": "sgd"}, beta=beta, server_lr=gamma), data)

    x, gs, x_prev, c = _zeros(), _zeros(), _zeros(), _zeros()
    ci = [_zeros() for _ in range(N)]
    for r in range(R):
        deltas, new_c = [], {}
        d = _map(lambda a, b: beta * a + (1 - beta) * b, c, gs)
        for i in _ids(r):
            y, gsum = dict(x), _zeros()
            for _ in range(K):
                gr = _grad(data, i, y)
                if vr:
                    gp = _grad(data, i, x_prev)
                    v = _map(
                        lambda a, p, dd, e: a - (1 - beta) * p + dd - beta * e, gr, gp, d, ci[i]
                    )
                else:
                    v = _map(lambda a, dd, e: beta * (a - e) + dd, gr, d, ci[i])
                n = _norm(v)
                y = _map(lambda a, b: a - LR * b / n, y, v)
                gsum = _map(np.add, gsum, gr)
            deltas.append(_map(np.subtract, y, x))
            new_c[i] = _map(lambda s: s / K, gsum)
        dcs = [_map(np.subtract, new_c[i], ci[i]) for i in new_c]
        gs = _map(lambda a, m, b: beta * (a + m) + (1 - beta) * b, c, _mean(dcs), gs)
        c = _map(lambda a, *e: a + sum(e) / N, c, *dcs)
        for i in new_c:
            ci[i] = new_c[i]
        x_prev = x
        x = _map(lambda a, m: a + gamma * m / (K * LR), x, _mean(deltas))

    _close(server.params, x, "x")
    _close(server.control, c, "c")
    _close(server.extra["padamfed_momentum"], gs, "server momentum")


# ---- FedLADA ------------------------------------------------------------------------------


def test_fedlada_matches_numpy():
    """Options bias_correction=True, decoupled weight decay: local Adam (m reset, v from the
    server, global step count) amended by (1 - alpha) Delta; the server averages x and v only."""
    alpha, b1, b2, eps, wd, slr = 0.6, 0.9, 0.99, 1e-8, 0.01, 0.9
    data = fp.quadratic_clients(N, seed=14)
    optim = {"name": "adamw", "b1": b1, "b2": b2, "eps": eps, "weight_decay": wd}
    alg = fed.get_algorithm(
        "fedlada",
        optim,
        alpha=alpha,
        server_lr=slr,
        bias_correction=True,
        coupled_weight_decay=False,
    )
    server = _run(alg, data)

    x, vbar, delta_g, count = _zeros(), _zeros(), _zeros(), 0
    for r in range(R):
        deltas, vs = [], []
        for i in _ids(r):
            y, m, v = dict(x), _zeros(), dict(vbar)
            for k in range(K):
                t = count + k + 1
                gr = _grad(data, i, y)
                m = _map(lambda a, b: b1 * a + (1 - b1) * b, m, gr)
                v = _map(lambda a, b: b2 * a + (1 - b2) * b * b, v, gr)
                u = _map(
                    lambda mm, vv: (mm / (1 - b1**t)) / (np.sqrt(vv / (1 - b2**t)) + eps), m, v
                )
                y = _map(
                    lambda a, uu, dg: a - LR * (alpha * uu + (1 - alpha) * dg + wd * a),
                    y,
                    u,
                    delta_g,
                )
            deltas.append(_map(np.subtract, y, x))
            vs.append(v)
        count += K
        mean_delta = _mean(deltas)
        delta_g = _map(lambda d: -d / (K * LR), mean_delta)
        x = _map(lambda a, d: a + slr * d, x, mean_delta)
        vbar = _mean(vs)

    _close(server.params, x, "x")
    _close(server.global_direction, delta_g, "Delta")
    adam = server.opt_state[0]
    _close(adam.nu, vbar, "v-bar")
    assert int(adam.count) == R * K


def _moments(m, v, gr, b1, b2):
    m = _map(lambda a, b: b1 * a + (1 - b1) * b, m, gr)
    return m, _map(lambda a, b: b2 * a + (1 - b2) * b * b, v, gr)


def _released_code_rounds(data, clip, step):
    """The round loop of the released main_FedAdamW.py (FedLADA and FedAdamW): each sampled
    client starts with m = 0 and v = v-bar, takes K steps ``step(y, m, v, g, t, delta_g) ->
    (y, m, v)`` on its (optionally clipped) gradients, t = r K + k + 1; the server averages x
    and v, and delta_g = -mean(dx) / (K lr). Returns x, v-bar, delta_g, the clipped count."""
    x, vbar, delta_g, clipped = _zeros(), _zeros(), _zeros(), 0
    for r in range(R):
        deltas, vs = [], []
        for i in _ids(r):
            y, m, v = dict(x), _zeros(), dict(vbar)
            for k in range(K):
                gr = _grad(data, i, y)
                n = _norm(gr)
                if clip is not None and n > clip:
                    clipped += 1
                    gr = _map(lambda a: a * clip / n, gr)
                y, m, v = step(y, m, v, gr, r * K + k + 1, delta_g)
            deltas.append(_map(np.subtract, y, x))
            vs.append(v)
        mean_delta = _mean(deltas)
        delta_g = _map(lambda d: -d / (K * LR), mean_delta)
        x = _map(np.add, x, mean_delta)
        vbar = _mean(vs)
    assert clip is None or clipped > 0, "the clipping must bind at least once"
    return x, vbar, delta_g


def _check_released_code_server(server, x, vbar, delta_g):
    _close(server.params, x, "x")
    _close(server.global_direction, delta_g, "Delta")
    is_adam = lambda n: isinstance(n, optax.ScaleByAdamState)  # noqa: E731
    (adam,) = [n for n in jax.tree.leaves(server.opt_state, is_leaf=is_adam) if is_adam(n)]
    _close(adam.nu, vbar, "v-bar")
    return adam


def test_fedlada_defaults_match_the_released_code():
    """The defaults follow the FedMuon (Liu et al.) authors' released FedLADA (junkangLiu0/
    FedAdamW main_FedAdamW.py): torch Adam at lr (1 - 0.9) with step 10^6 (no bias correction),
    m restarted, v from the server, coupled weight decay g + lambda x, then p += 0.9 lr/K *
    mean(dx)/lr; here also the optional gradient clipping (its clip_grad_norm_), on a norm small
    enough to bind."""
    b1, b2, eps, wd, clip = 0.9, 0.999, 1e-8, 0.001, 2.0
    alpha = 0.1  # the default
    data = fp.quadratic_clients(N, seed=18)
    optim = {"name": "adamw", "b1": b1, "b2": b2, "eps": eps, "weight_decay": wd}
    server = _run(fed.get_algorithm("fedlada", optim, clip_norm=clip), data)

    def step(y, m, v, gr, t, delta_g):
        del t  # step 10^6: no bias correction
        gr = _map(lambda a, p: a + wd * p, gr, y)  # coupled weight decay
        m, v = _moments(m, v, gr, b1, b2)
        y = _map(
            lambda p, mm, vv, dg: p - LR * (alpha * mm / (np.sqrt(vv) + eps) + (1 - alpha) * dg),
            y,
            m,
            v,
            delta_g,
        )
        return y, m, v

    _check_released_code_server(server, *_released_code_rounds(data, clip, step))


@pytest.mark.parametrize("clip", [None, 2.0])
def test_fedadamw_defaults_match_the_released_code(clip):
    """FedAdamW as the authors' released code runs it (junkangLiu0/FedAdamW main_FedAdamW.py,
    update_FedAdamW): torch AdamW at the full lr with decoupled weight decay, m restarted, v
    from the server's mean, bias correction at the global step t = r K + k + 1 (its step
    counter grows by K a round), then p += 0.5 lr/K * mean(dx)/lr; the server averages x and v.
    Unlike FedLADA's code (test above): AdamW's step is not scaled by (1 - gamma), and it is
    bias-corrected. With clip, the optional clip_grad_norm_ binds."""
    b1, b2, eps, wd, gamma = 0.9, 0.99, 1e-8, 0.01, 0.5
    data = fp.quadratic_clients(N, seed=19)
    optim = {"name": "adamw", "b1": b1, "b2": b2, "eps": eps, "weight_decay": wd}
    server = _run(fed.get_algorithm("fedadamw", optim, clip_norm=clip), data)

    def step(y, m, v, gr, t, delta_g):
        m, v = _moments(m, v, gr, b1, b2)
        u = _map(lambda mm, vv: (mm / (1 - b1**t)) / (np.sqrt(vv / (1 - b2**t)) + eps), m, v)
        y = _map(lambda p, uu: p * (1 - LR * wd) - LR * uu, y, u)  # torch AdamW
        y = _map(lambda p, dg: p - gamma * LR * dg, y, delta_g)  # p += g lr/K momen_m
        return y, m, v

    adam = _check_released_code_server(server, *_released_code_rounds(data, clip, step))
    assert int(adam.count) == R * K


# ---- FAFED --------------------------------------------------------------------------------


def test_fafed_matches_numpy():
    """STORM momentum u and second moment v averaged every round; A = sqrt(v-bar) + rho from
    the averaged v the round starts with, frozen for the round; x <- x - eta u / A; each client's
    previous STORM iterate kept across rounds; the run starts from u-bar, v-bar = the means of
    the sampled clients' first gradients and of their squares and x_1 = x_0 - eta u-bar
    (test_fafed_matches_the_reference_loop below)."""
    a, b2, rho = 0.3, 0.9, 0.1
    data = fp.quadratic_clients(N, seed=15)
    server = _run(fed.get_algorithm("fafed", {"name": "sgd"}, a=a, b2=b2, rho=rho), data)

    first = [_grad(data, i, _zeros()) for i in _ids(0)]
    ubar, vbar = _mean(first), _mean([_map(np.square, g) for g in first])
    x = _map(lambda u: -LR * u, ubar)
    prevs = {}  # each client's own previous iterate (x_0 until it first joins)
    for r in range(R):
        deltas, us, vs = [], [], []
        for i in _ids(r):
            y, prev, u, v = dict(x), prevs.get(i, _zeros()), dict(ubar), dict(vbar)
            for _ in range(K):
                gr, gp = _grad(data, i, y), _grad(data, i, prev)
                u = _map(lambda g0, m, g1: g0 + (1 - a) * (m - g1), gr, u, gp)
                v = _map(lambda n, g0: b2 * n + (1 - b2) * g0 * g0, v, gr)
                prev = y
                y = _map(lambda p, uu, pc: p - LR * uu / (np.sqrt(pc) + rho), y, u, vbar)
            prevs[i] = prev
            deltas.append(_map(np.subtract, y, x))
            us.append(u)
            vs.append(v)
        x = _map(np.add, x, _mean(deltas))
        ubar, vbar = _mean(us), _mean(vs)

    _close(server.params, x, "x")
    _close(server.opt_state[0].mu, ubar, "u-bar")
    _close(server.opt_state[0].nu, vbar, "v-bar")


# ---- Adam-BiClip --------------------------------------------------------------------------


def test_adam_biclip_matches_numpy():
    """Clients: x <- x - eta sign(g) clip(|g|, d, u); server: Adam on -mean(dx) (FedAdam)."""
    lower, upper, slr, sb1, sb2, tau = 0.3, 1.5, 0.05, 0.9, 0.99, 1e-3
    data = fp.quadratic_clients(N, seed=16)
    alg = fed.get_algorithm(
        "adam_biclip",
        {"name": "sgd"},
        lower=lower,
        upper=upper,
        server_lr=slr,
        server_b1=sb1,
        server_b2=sb2,
        server_tau=tau,
    )
    server = _run(alg, data)

    x, m, v = _zeros(), _zeros(), _zeros()
    clipped = {"low": 0, "high": 0}
    for r in range(R):
        deltas = []
        for i in _ids(r):
            y = dict(x)
            for _ in range(K):
                gr = _grad(data, i, y)
                for leaf in gr.values():
                    clipped["low"] += int(np.sum(np.abs(leaf) < lower))
                    clipped["high"] += int(np.sum(np.abs(leaf) > upper))
                y = _map(
                    lambda p, gg: p - LR * np.sign(gg) * np.clip(np.abs(gg), lower, upper), y, gr
                )
            deltas.append(_map(np.subtract, y, x))
        # The outer Adam is FedAdam's (Reddi et al. 2021, Alg. 2): no bias correction.
        x, m, v = _reddi_adam_step(x, m, v, _mean(deltas), slr, sb1, sb2, tau)
    assert clipped["low"] > 0 and clipped["high"] > 0, "both thresholds must be exercised"
    _close(server.params, x, "x")


def _reddi_adam_step(x, m, v, delta, lr, b1, b2, tau):
    """Reddi et al. 2021, Alg. 2 (FedAdam), lines 11-13: m <- b1 m + (1 - b1) Delta,
    v <- b2 v + (1 - b2) Delta^2, x <- x + eta m / (sqrt(v) + tau); no bias correction."""
    m = _map(lambda a, d: b1 * a + (1 - b1) * d, m, delta)
    v = _map(lambda a, d: b2 * a + (1 - b2) * d * d, v, delta)
    x = _map(lambda p, mm, vv: p + lr * mm / (np.sqrt(vv) + tau), x, m, v)
    return x, m, v


def test_fedadam_matches_reddi_alg2_without_bias_correction():
    """FedAdam's server Adam is Reddi et al.'s Alg. 2 (as Flower's FedAdam): the bias-corrected
    optax.adam would take 0.47-1 times these steps (b1 = 0.9, b2 = 0.99), so a test against it
    fails after round 1 (checked below: the two differ by > 10% in round R)."""
    slr, sb1, sb2, tau, wd = 0.05, 0.9, 0.99, 1e-3, 0.01
    data = fp.quadratic_clients(N, seed=17)
    alg = fed.get_algorithm(
        "fedadam",
        {"name": "sgd", "momentum": 0.5, "weight_decay": wd},
        server_lr=slr,
        server_b1=sb1,
        server_b2=sb2,
        server_tau=tau,
    )
    server = _run(alg, data)

    x, m, v = _zeros(), _zeros(), _zeros()
    for r in range(R):
        deltas = []
        for i in _ids(r):
            y, mom = dict(x), _zeros()  # local momentum SGD, reset every round
            for _ in range(K):
                gr = _grad(data, i, y)
                mom = _map(lambda a, g: 0.5 * a + g, mom, gr)
                y = _map(lambda p, u: p - LR * (u + wd * p), y, mom)
            deltas.append(_map(np.subtract, y, x))
        delta = _mean(deltas)
        x_prev = x
        x, m, v = _reddi_adam_step(x, m, v, delta, slr, sb1, sb2, tau)
    _close(server.params, x, "x")
    # The bias-corrected step of the last round (t = R) is measurably different.
    t = R
    corrected = _map(
        lambda p, mm, vv: p + slr * (mm / (1 - sb1**t)) / (np.sqrt(vv / (1 - sb2**t)) + tau),
        x_prev,
        m,
        v,
    )
    step, step_c = _map(np.subtract, x, x_prev), _map(np.subtract, corrected, x_prev)
    assert _norm(_map(np.subtract, step, step_c)) > 0.1 * _norm(step)


def _local_momentum_sgd_deltas(data, x, r, wd, mu=0.5):
    """The sampled clients' ``x_i^K - x^r`` of round ``r``: local momentum SGD, reset each round."""
    deltas = []
    for i in _ids(r):
        y, mom = dict(x), _zeros()
        for _ in range(K):
            gr = _grad(data, i, y)
            mom = _map(lambda a, g: mu * a + g, mom, gr)
            y = _map(lambda p, u: p - LR * (u + wd * p), y, mom)
        deltas.append(_map(np.subtract, y, x))
    return _mean(deltas)


@pytest.mark.parametrize("server_opt", ["yogi", "adagrad"])
def test_fedyogi_and_fedadagrad_match_reddi_alg2(server_opt):
    """FedYogi and FedAdagrad (Reddi et al. 2021, Alg. 2) are FedAvg with
    ``fed.options.server_opt``: ``m <- b1 m + (1 - b1) Delta``, ``v <- v + Delta^2`` (Adagrad)
    or ``v <- v - (1 - b2) Delta^2 sign(v - Delta^2)`` (Yogi), ``x <- x + eta m / (sqrt(v) +
    tau)``, no bias correction, ``v`` from 0 as FedAdam's."""
    slr, sb1, sb2, tau, wd = 0.05, 0.9, 0.9, 1e-3, 0.01
    data = fp.quadratic_clients(N, seed=17)
    server_options = {"server_lr": slr, "server_b1": sb1, "server_tau": tau}
    if server_opt == "yogi":
        server_options["server_b2"] = sb2
    optim = {"name": "sgd", "momentum": 0.5, "weight_decay": wd}
    server = _run(fed.get_algorithm("fedavg", optim, server_opt=server_opt, **server_options), data)

    x, m, v = _zeros(), _zeros(), _zeros()
    signs = set()
    for r in range(R):
        delta = _local_momentum_sgd_deltas(data, x, r, wd)
        m = _map(lambda a, d: sb1 * a + (1 - sb1) * d, m, delta)
        if server_opt == "adagrad":
            v = _map(lambda a, d: a + d * d, v, delta)
        else:
            signs |= {s for k in v for s in np.sign(v[k] - delta[k] ** 2).ravel()}
            v = _map(lambda a, d: a - (1 - sb2) * d * d * np.sign(a - d * d), v, delta)
        x = _map(lambda p, mm, vv: p + slr * mm / (np.sqrt(vv) + tau), x, m, v)
    _close(server.params, x, "x")
    if server_opt == "yogi":  # both branches of Yogi's sign: it is not Adam's nor Adagrad's
        assert {-1.0, 1.0} <= signs, signs


def test_server_opt_adam_is_fedadam():
    """``server_opt="adam"`` on FedAvg is FedAdam's server, bit for bit."""
    data = fp.quadratic_clients(N, seed=3)
    optim = {"name": "sgd", "momentum": 0.5}
    want = _run(fed.get_algorithm("fedadam", optim, server_lr=0.05), data).params
    got = _run(fed.get_algorithm("fedavg", optim, server_opt="adam", server_lr=0.05), data).params
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_nesterov_server_matches_diloco_alg1():
    """DiLoCo (Douillard et al. 2023, Alg. 1): the outer gradient ``Delta = x - mean_i x_i``
    goes through Nesterov momentum SGD (PyTorch's: ``v <- mu v + Delta``, ``x <- x - lr (Delta
    + mu v)``), here with FedAvg's local momentum SGD as the inner optimizer."""
    slr, mu, wd = 0.7, 0.9, 0.01
    data = fp.quadratic_clients(N, seed=11)
    optim = {"name": "sgd", "momentum": 0.5, "weight_decay": wd}
    alg = fed.get_algorithm(
        "fedavg", optim, server_opt="nesterov", server_lr=slr, server_momentum=mu
    )
    server = _run(alg, data)

    x, buf = _zeros(), _zeros()
    for r in range(R):
        outer = _map(np.negative, _local_momentum_sgd_deltas(data, x, r, wd))
        buf = _map(lambda b, g: mu * b + g, buf, outer)
        x = _map(lambda p, g, b: p - slr * (g + mu * b), x, outer, buf)
    _close(server.params, x, "x")


def test_every_algorithm_takes_a_server_optimizer():
    """``fed.options.server_opt`` replaces any registered algorithm's server optimizer (MuLoCo:
    Muon inside, Nesterov outside), keeping its rule and combine; its keys are refused where
    they do not apply, in one line."""
    for name in fed.ALGORITHMS:
        for optim in ({"name": o} for o in ("sgd", "adamw", "muon", "soap", "sophia", "lmo")):
            try:  # the local optimizer the algorithm runs (local_soap runs SOAP only)
                base = fed.get_algorithm(name, optim)
                break
            except ValueError:
                continue
        alg = fed.get_algorithm(name, optim, server_opt="nesterov", server_lr=0.5)
        assert alg.server.rule == base.server.rule, name
        assert (alg.server.combine is None) == (base.server.combine is None), name
        assert alg.server.tx is not base.server.tx, name
    with pytest.raises(
        ValueError,
        match=r"fed.options.server_b2 does not apply to fed.options.server_opt='adagrad'; its keys",
    ):
        fed.get_algorithm("fedavg", {"name": "sgd"}, server_opt="adagrad", server_b2=0.9)
    with pytest.raises(ValueError, match=r"fed.options.server_opt='lamb'; valid: \('sgd'"):
        fed.get_algorithm("fedmuon", {"name": "muon"}, server_opt="lamb")


# ---- FedNova ------------------------------------------------------------------------------


def _fednova_steps(r, i, min_steps):
    """Client ``i``'s ``tau_i`` in round ``r``: drawn with its step-0 optimizer key (the
    engine's keys: round ``fold_in(key(0), r)``, client ``fold_in(., i)``, step ``fold_in(.,
    0)`` split into batch, model and optimizer keys)."""
    from fedorth.optim.fednova import draw_steps

    client_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), r), i)
    opt_key = jax.random.split(jax.random.fold_in(client_key, 0), 3)[2]
    return int(draw_steps(opt_key, min_steps, K))


@pytest.mark.parametrize("rho", [0.0, 0.6])
def test_fednova_matches_normalized_averaging_with_heterogeneous_steps(rho):
    """FedNova (Wang et al. 2020, Eq. (3)-(4)) with client-dependent tau_i: client i runs tau_i
    heavy-ball steps, ||a_i||_1 = sum_{j<=tau_i} (1 - rho^j)/(1 - rho), and
    x <- x + tau_eff mean_i (x_i - x)/||a_i||_1, tau_eff = mean_i ||a_i||_1 (p_i = 1/S)."""
    data = fp.quadratic_clients(N, seed=21)
    optim = {"name": "sgd", "momentum": rho}
    server = _run(fed.get_algorithm("fednova", optim, min_local_steps=1), data)

    x, taus = _zeros(), set()
    for r in range(R):
        normalized, norms = [], []
        for i in _ids(r):
            tau = _fednova_steps(r, int(i), 1)
            taus.add(tau)
            y, mom = dict(x), _zeros()
            for _ in range(tau):
                mom = _map(lambda a, g: rho * a + g, mom, _grad(data, i, y))
                y = _map(lambda p, u: p - LR * u, y, mom)
            a_norm = sum((1 - rho**j) / (1 - rho) for j in range(1, tau + 1))
            norms.append(a_norm)
            normalized.append(_map(lambda p, q: (p - q) / a_norm, y, x))
        tau_eff = np.mean(norms)
        x = _map(lambda p, d: p + tau_eff * d, x, _mean(normalized))
    assert len(taus) > 1, taus  # the clients' step counts differ: not FedAvg
    _close(server.params, x, "x")
    fedavg = _run(fed.get_algorithm("fedavg", optim), data).params
    assert _norm(_map(np.subtract, server.params, fedavg)) > 1e-3


def test_fednova_with_equal_steps_is_fedavg():
    """Every client running the same K steps of the same momentum SGD: all ||a_i||_1 equal
    tau_eff, and FedNova's step is FedAvg's mean update (Wang et al. 2020, Sec. 4)."""
    data = fp.quadratic_clients(N, seed=22)
    optim = {"name": "sgd", "momentum": 0.6}
    nova = _run(fed.get_algorithm("fednova", optim), data).params
    avg = _run(fed.get_algorithm("fedavg", optim), data).params
    _close(nova, avg, "x")


# ---- Fed-Sophia / FedPM -------------------------------------------------------------------


def _diagonal_clients(seed):
    """Quadratic clients with diagonal H_i: Hutchinson's u * (H u) is then exactly diag(H)."""
    rng = np.random.default_rng(seed)
    data = fp.quadratic_clients(N, seed=seed)
    data["H"] = np.stack([np.diag(rng.uniform(0.5, 2.5, size=4)) for _ in range(N)])
    return data


@pytest.mark.parametrize("name", ["fed_sophia", "fedpm"])
def test_fed_sophia_and_fedpm_match_numpy(name):
    """Persistent per-device Sophia (FedPAC (Liu et al.) Alg. 8 form); server: mean (Fed-Sophia) or
    sum_i P_i dx_i / sum_i P_i with P_i = max(h_i, eps) (FedPM)."""
    b1, b2, rho, eps, wd, interval = 0.9, 0.8, 1.0, 1e-12, 0.01, 2
    data = _diagonal_clients(17)
    optim = {
        "name": "sophia",
        "b1": b1,
        "b2": b2,
        "rho": rho,
        "eps": eps,
        "update_interval": interval,
        "weight_decay": wd,
    }
    server = _run(fed.get_algorithm(name, optim), data)

    x = _zeros()
    m = [_zeros() for _ in range(N)]
    h = [_zeros() for _ in range(N)]
    count = [0] * N
    for r in range(R):
        deltas, precs = [], []
        for i in _ids(r):
            y = dict(x)
            hess = {"w": np.repeat(np.diag(data["H"][i])[:, None], 3, axis=1), "b": np.ones(3)}
            for _ in range(K):
                gr = _grad(data, i, y)
                count[i] += 1
                m[i] = _map(lambda a, b: b1 * a + (1 - b1) * b, m[i], gr)
                if count[i] % interval == 0:
                    h[i] = _map(lambda a, e: b2 * a + (1 - b2) * e, h[i], hess)
                step = _map(lambda mm, hh: np.clip(mm / np.maximum(hh, eps), -rho, rho), m[i], h[i])
                y = _map(lambda p, s: p - LR * (s + wd * p), y, step)
            deltas.append(_map(np.subtract, y, x))
            precs.append(_map(lambda hh: np.maximum(hh, eps), h[i]))
        if name == "fedpm":
            num = _map(
                lambda *ts: sum(ts),
                *[_map(np.multiply, p, d) for p, d in zip(precs, deltas, strict=True)],
            )
            den = _map(lambda *ts: sum(ts), *precs)
            x = _map(lambda a, nn, dd: a + nn / dd, x, num, den)
        else:
            x = _map(np.add, x, _mean(deltas))

    _close(server.params, x, "x")
    sophia_C = server.clients.opt_state[0]
    for i in range(N):  # absent devices keep their m, h and step count
        _close(jax.tree.map(lambda t: t[i], sophia_C.mu), m[i], f"m_{i}")
        _close(jax.tree.map(lambda t: t[i], sophia_C.nu), h[i], f"h_{i}")
        assert int(sophia_C.count[i]) == count[i]


def test_aggregate_delta_hook_mean_is_fedavg():
    """A ``combine`` returning the engine's client mean reproduces FedAvg bit for bit.

    With ``vmap`` the engine averages the client-stacked updates with ``mean_over_clients``, so
    the hook that receives the same stack and returns the same mean must give identical bits
    (the sequential engine accumulates a running mean instead: equal up to rounding)."""
    data = fp.quadratic_clients(N, seed=18)
    base = fed.get_algorithm("fedavg", {"name": "sgd"})
    hooked = dataclasses.replace(
        base,
        server=dataclasses.replace(
            base.server,
            combine=lambda ctx, deltas_C, reports_C: jax.tree.map(
                fed_optim.mean_over_clients, deltas_C
            ),
        ),
    )
    want = _run(base, data, strategy="vmap").params["w"]
    np.testing.assert_array_equal(_run(hooked, data, strategy="vmap").params["w"], want)
    got = _run(hooked, data, strategy="sequential").params["w"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# ---- communication ------------------------------------------------------------------------

# (up, down) per participating client per round, in models (|x| floats).
BYTES = {
    "fedavg_m": ("sgd", 1, 2),  # dx | x, g
    "fedavg_vr": ("sgd", 1, 3),  # dx | x, g, x^{r-1}
    "scaffold_m": ("sgd", 2, 3),  # dx, c_i | x, c, g
    "scaffold_vr": ("sgd", 2, 4),  # dx, c_i | x, c, g, x^{r-1}
    "padamfed": ("sgd", 2, 3),  # dx, c_i | x, c, g
    "padamfed_vr": ("sgd", 2, 4),  # dx, c_i | x, c, g, x^{r-1}
    "fafed": ("sgd", 3, 3),  # x, u, v | x, u, v
    "adam_biclip": ("sgd", 1, 1),
    "fedlada": ("adamw", 2, 3),  # dx, v | x, v, Delta
    "fed_sophia": ("sophia", 1, 1),
    "fedpm": ("sophia", 2, 1),  # dx, P_i | x
}


@pytest.mark.parametrize("name", sorted(BYTES))
def test_communication_bytes(name):
    """The engine counts what each baseline actually sends (float32 model of 15 numbers)."""
    optimizer, up, down = BYTES[name]
    alg = fed.get_algorithm(name, {"name": optimizer})
    params = {"w": jnp.zeros((4, 3), jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    server = fed.init_server(alg, params, {}, num_clients=N, key=jax.random.key(0))
    model = 15 * 4
    assert fed.communication_bytes(alg, server) == {
        "bytes_up": up * model,
        "bytes_down": down * model,
    }


@pytest.mark.parametrize(
    "name,optim,options,match",
    [
        ("fedavg_m", {"name": "sgd"}, {"beta": 0.0}, "beta"),
        ("scaffold_vr", {"name": "adamw"}, {}, "optim.name='sgd'"),
        ("scaffold_m", {"name": "sgd", "momentum": 0.9}, {}, "without optim.momentum"),
        ("padamfed", {"name": "sgd"}, {"beta": 1.5}, "beta"),
        ("fedlada", {"name": "sgd"}, {}, "adamw"),
        ("fedlada", {"name": "adamw"}, {"alpha": 0.0}, "alpha"),
        ("fafed", {"name": "adamw"}, {}, "own local step"),
        ("fafed", {"name": "sgd"}, {"a": 0.0}, "a=0.0"),
        ("adam_biclip", {"name": "sgd"}, {"lower": 2.0, "upper": 1.0}, "upper"),
        ("fed_sophia", {"name": "sophia"}, {"client_state": "global"}, "client_state"),
        ("fedpm", {"name": "adamw"}, {}, "sophia"),
    ],
)
def test_bad_settings_raise(name, optim, options, match):
    with pytest.raises(ValueError, match=match):
        fed.get_algorithm(name, optim, **options)


# ---- the new transforms on their own --------------------------------------------------------


def test_scale_by_storm_matches_numpy():
    """u_0 = g_0, u_k = g_k + (1 - a)(u_{k-1} - g(x_{k-1}; xi_k)) with both gradients on batch k."""
    import optax

    from fedorth.optim import scale_by_storm

    a, lr = 0.3, 0.1
    rng = np.random.default_rng(0)
    targets = rng.normal(size=(5, 3))
    scales = rng.uniform(0.5, 2.0, size=(5, 3))

    def loss(p, k):
        return 0.5 * jnp.sum(scales[k] * (p - targets[k]) ** 2)

    tx = scale_by_storm(a)
    x = jnp.zeros(3)
    state = tx.init(x)
    xn, xn_prev, un = np.zeros(3), np.zeros(3), None
    for k in range(5):
        g = jax.grad(loss)(x, k)
        u, state = tx.update(g, state, x, obj_fn=lambda p, k=k: loss(p, k))
        x = optax.apply_updates(x, jax.tree.map(lambda v: -lr * v, u))
        gk = scales[k] * (xn - targets[k])
        un = gk if k == 0 else gk + (1 - a) * (un - scales[k] * (xn_prev - targets[k]))
        xn_prev, xn = xn, xn - lr * un
        np.testing.assert_allclose(u, un, **TOL)
    np.testing.assert_allclose(x, xn, **TOL)


def test_biclip_identities():
    """lower = 0: coordinate clipping; lower = upper: upper * sign; zeros stay zero."""
    from fedorth.optim import biclip

    x = jnp.array([-3.0, -0.5, -1e-3, 0.0, 2e-3, 0.7, 5.0])
    np.testing.assert_array_equal(biclip(x, 0.0, 1.0), jnp.clip(x, -1.0, 1.0))
    np.testing.assert_array_equal(biclip(x, 0.5, 0.5), 0.5 * jnp.sign(x))
    np.testing.assert_array_equal(
        biclip(x, 0.01, 1.0), jnp.array([-1.0, -0.5, -0.01, 0.0, 0.01, 0.7, 1.0])
    )


def test_normalize_by_global_norm_is_unit_over_all_leaves():
    from fedorth.optim import normalize_by_global_norm

    tx = normalize_by_global_norm()
    u = {"w": jnp.full((4, 3), 2.0), "b": jnp.array([1.0, -2.0, 2.0])}
    out, _ = tx.update(u, tx.init(u))
    norm = np.sqrt(4 * 3 * 4 + 9)
    np.testing.assert_allclose(out["w"], 2.0 / norm, **TOL)
    np.testing.assert_allclose(out["b"], np.array([1.0, -2.0, 2.0]) / norm, **TOL)
    zero, _ = tx.update(jax.tree.map(jnp.zeros_like, u), tx.init(u))
    assert all(np.all(np.asarray(v) == 0) for v in zero.values())


# ---- against the released sources ------------------------------------------------------


def test_fedavg_m_matches_the_fedtorch_reimplementation_when_k_eta_is_one():
    """FedAvg-M as NPCLEI/fedtorch (fedtorchPRO/ultra/avgM, commit ad16901) writes it.

    Client: after each backward, grad <- beta grad + (1 - beta) G, then an SGD step; server:
    plain averaging, then G <- mean_i (x^r - x_i^K) (the raw model difference), G = 0 at the
    start. fedorth's g^{r+1} is that difference divided by K eta, so the two coincide when
    K eta = 1, which this test uses (K = 4, eta = 0.25); with plain SGD as the local step.
    """
    k, lr, beta, rounds = 4, 0.25, 0.1, 3
    data = fp.quadratic_clients(N, seed=21)
    alg = fed.get_algorithm("fedavg_m", {"name": "sgd"}, beta=beta)
    settings = dict(num_clients=N, clients_per_round=S, local_steps=k, learning_rate=lr)
    server, _ = fp.run_rounds(alg, data, rounds=rounds, **settings)

    w, b = np.zeros((4, 3)), np.zeros(3)
    gw, gb = np.zeros((4, 3)), np.zeros(3)  # the reimplementation's G (ZeroNET at the start)
    for r in range(rounds):
        finals = []
        for i in fp.sampled_ids(jax.random.key(0), r, N, S):
            yw, yb = w.copy(), b.copy()
            for _ in range(k):
                dw, db = fp.np_grads(data, i, yw, yb)
                yw = yw - lr * (beta * dw + (1 - beta) * gw)
                yb = yb - lr * (beta * db + (1 - beta) * gb)
            finals.append((yw, yb))
        mw = np.mean([f[0] for f in finals], axis=0)
        mb = np.mean([f[1] for f in finals], axis=0)
        gw, gb = w - mw, b - mb  # pm.grad = sum_i weight_i (x^r - x_i^K), equal weights
        w, b = mw, mb

    np.testing.assert_allclose(server.params["w"], w, err_msg="x[w]", **TOL)
    np.testing.assert_allclose(server.params["b"], b, err_msg="x[b]", **TOL)
    # fedorth's g^{r+1} = mean_i (x^r - x_i^K) / (K eta) is G itself at K eta = 1.
    np.testing.assert_allclose(server.global_direction["w"], gw, err_msg="g[w]", **TOL)
    np.testing.assert_allclose(server.global_direction["b"], gb, err_msg="g[b]", **TOL)


# ---- FAFED as released: naya0000/FaFed code/Image/FAFED.py and code/NLP/FAFED.py (fd3e4c1) --

FA_ROWS, FA_BATCH, FA_DIM, FA_OUT = 8, 3, 4, 2
FA_A, FA_B2, FA_RHO, FA_LR = 0.3, 0.9, 0.1, 0.1


def _lsq_clients(n, seed):
    """Per-client least squares ``0.5 mean_rows |A w + b - Y|^2`` over ``FA_ROWS`` rows each."""
    rng = np.random.default_rng(seed)
    return {
        "A": rng.normal(size=(n, FA_ROWS, FA_DIM)),
        "Y": rng.normal(size=(n, FA_ROWS, FA_OUT)) + 1.0,
    }


def _lsq_rows(batch_key):
    return jax.random.choice(batch_key, FA_ROWS, (FA_BATCH,), replace=False)


def _lsq_batch_fn(data, client_id, key):
    rows = _lsq_rows(key)
    return jax.tree.map(lambda x: x[client_id][rows], data)


def _lsq_loss_fn(params, model_state, batch, key):
    del key
    r = batch["A"] @ params["w"] + params["b"][None, :] - batch["Y"]
    return 0.5 * jnp.mean(jnp.sum(r * r, axis=-1)), (model_state, {})


def _lsq_grad(data, i, rows, x):
    a, y = data["A"][i][rows], data["Y"][i][rows]
    r = a @ x["w"] + x["b"] - y
    return {"w": a.T @ r / len(rows), "b": r.mean(0)}


@jax.jit  # one program for every call (the same bits as op-by-op: integer key arithmetic)
def _step_rows_jit(key, r, i, step):
    client_key = jax.random.fold_in(jax.random.fold_in(key, r), i)
    return _lsq_rows(jax.random.split(jax.random.fold_in(client_key, step), 3)[0])


def _step_rows(key, r, i, step):
    """The rows the engine's batch_fn draws for client ``i``'s local step ``step`` of round ``r``
    (fedorth.fed.round: round key fold_in(key, r), client fold_in(., i), step fold_in(., step),
    split in three, the first for the batch)."""
    return np.asarray(_step_rows_jit(key, r, i, step))


def _run_fafed(data, n, s, k, rounds, strategy="auto"):
    alg = fed.get_algorithm("fafed", {"name": "sgd"}, a=FA_A, b2=FA_B2, rho=FA_RHO)
    server, _ = fp.run_rounds(
        alg,
        data,
        rounds=rounds,
        num_clients=n,
        clients_per_round=s,
        local_steps=k,
        learning_rate=FA_LR,
        params={"w": jnp.zeros((FA_DIM, FA_OUT)), "b": jnp.zeros(FA_OUT)},
        strategy=strategy,
        loss_fn=_lsq_loss_fn,
        batch_fn=_lsq_batch_fn,
    )
    return server


def _prepass_rows(key, i, k):
    """The rows of client ``i``'s pre-pass batch on round 0 (local step index ``K``, the key
    split in two)."""
    return np.asarray(_prepass_rows_jit(key, i, k))


@jax.jit
def _prepass_rows_jit(key, i, k):
    client_key = jax.random.fold_in(jax.random.fold_in(key, 0), i)
    return _lsq_rows(jax.random.split(jax.random.fold_in(client_key, k))[0])


def _fafed_reference(data, n, s, k, rounds, correct_boundary=True):
    """The reference code's loop in float64, on the engine's sampled clients and batches.

    Start (its "Initialization" block): ``m_t`` and ``v_t`` are the means over the clients of
    their first gradient at ``x_0`` and of its square, everyone steps ``x_1 = x_0 - lr m_t``
    (no ``H``), ``H = sqrt(v_t) + rho``, and ``model_`` is ``x_0``. Per local step (``x_para``
    the point before it, ``model_`` the client's previous iterate): ``m = g(x) + (1 - alpha)(m -
    g(model_))`` on one batch, ``v = beta v + (1 - beta) g(x)^2``, ``x -= lr m / H``, ``model_ <-
    x_para``; every ``inLoop = K`` steps ``x``, ``m``, ``v`` averaged and ``H = sqrt(v-bar) +
    rho``; ``model_`` is never reset (``ext = 1``, the NLP script's value). The start's batch is
    the engine's pre-pass batch and it averages over round 0's sampled clients.
    ``correct_boundary=False``: each round restarts the recursion at ``x-bar`` (fedorth before
    issue 23's fix).
    """
    key = jax.random.key(0)
    x0 = {"w": np.zeros((FA_DIM, FA_OUT)), "b": np.zeros(FA_OUT)}
    first = [_lsq_grad(data, i, _prepass_rows(key, i, k), x0) for i in fp.sampled_ids(key, 0, n, s)]
    mbar = {q: np.mean([g[q] for g in first], axis=0) for q in x0}
    vbar = {q: np.mean([g[q] ** 2 for g in first], axis=0) for q in x0}
    x = {q: x0[q] - FA_LR * mbar[q] for q in x0}
    model_ = [dict(x0) for _ in range(n)]  # copy.deepcopy(model) before the start
    for r in range(rounds):
        hbar = {q: np.sqrt(vbar[q]) + FA_RHO for q in x}
        finals = []
        for i in fp.sampled_ids(key, r, n, s):
            y, m, v = dict(x), mbar, vbar
            prev = model_[i] if correct_boundary or r == 0 else dict(x)
            for step in range(k):
                rows = _step_rows(key, r, i, step)
                g, gp = _lsq_grad(data, i, rows, y), _lsq_grad(data, i, rows, prev)
                m = {q: g[q] + (1 - FA_A) * (m[q] - gp[q]) for q in g}
                v = {q: FA_B2 * v[q] + (1 - FA_B2) * g[q] ** 2 for q in g}
                prev = y  # model_.load_state_dict(x_para)
                y = {q: y[q] - FA_LR * m[q] / hbar[q] for q in g}
            model_[i] = prev
            finals.append((y, m, v))
        x, mbar, vbar = (
            {q: np.mean([f[j][q] for f in finals], axis=0) for q in x} for j in range(3)
        )
    return x, mbar, vbar, model_


def test_fafed_matches_the_reference_loop():
    """FAFED's rounds as the reference code runs them (N = 3 clients, all communicating, K = 1
    local step, 3 rounds, mini-batches of a per-client least-squares problem; K = 2 with 4 of 5
    clients: test_fafed_kept_iterates_with_partial_participation): the averaged start
    (the engine's round-0 pre-pass; its step x_1 = x_0 - eta m_0 is folded into round 0's
    first local step), and the first STORM correction of a round uses each client's own
    previous iterate, kept across the averaging (``start.Global(keep=...)``). With K = 1
    that correction is all the variance reduction there is: the round-restarting recursion
    (fedorth before the fix) is far from it."""
    n, k, rounds = 3, 1, 3
    data = _lsq_clients(n, seed=23)
    server = _run_fafed(data, n, n, k, rounds)
    x, mbar, vbar, model_ = _fafed_reference(data, n, n, k, rounds)
    (state,) = [s for s in server.opt_state if isinstance(s, FafedState)]
    for q in x:
        np.testing.assert_allclose(server.params[q], x[q], err_msg=f"x[{q}]", **TOL)
        np.testing.assert_allclose(state.mu[q], mbar[q], err_msg=f"m[{q}]", **TOL)
        np.testing.assert_allclose(state.nu[q], vbar[q], err_msg=f"v[{q}]", **TOL)
    # The clients' own previous iterates: ServerState.clients.opt_state lists FafedState's
    # prev_params leaves (b, w in key order), stacked over the clients.
    kept_b, kept_w = server.clients.opt_state
    np.testing.assert_allclose(kept_w, [p["w"] for p in model_], err_msg="model_[w]", **TOL)
    np.testing.assert_allclose(kept_b, [p["b"] for p in model_], err_msg="model_[b]", **TOL)
    old, _, _, _ = _fafed_reference(data, n, n, k, rounds, correct_boundary=False)
    gap = np.max(np.abs(old["w"] - x["w"]))
    assert gap > 1e-3, f"without the boundary correction K = 1 differs by {gap} only"


def test_fafed_kept_iterates_with_partial_participation():
    """S = 4 of N = 5, K = 2: the round gathers and scatters the sampled clients' previous
    iterates and matches the reference loop (x, the averaged m and v, the kept iterates), which
    leaves the clients not sampled untouched. Run with the
    CPU's default strategy (sequential); tests/test_fed_golden.py runs FAFED with 4 of 6
    clients under vmap, chunked, sequential and sharded, requires the strategies to agree at
    float32 rounding and each to keep its recorded bits: each gathers and scatters alike."""
    n, s, k, rounds = 5, 4, 2, 3
    data = _lsq_clients(n, seed=24)
    server = _run_fafed(data, n, s, k, rounds, strategy="sequential")
    x, mbar, vbar, model_ = _fafed_reference(data, n, s, k, rounds)
    (state,) = [st for st in server.opt_state if isinstance(st, FafedState)]
    for q in x:
        np.testing.assert_allclose(server.params[q], x[q], err_msg=f"x[{q}]", **TOL)
        np.testing.assert_allclose(state.mu[q], mbar[q], err_msg=f"m[{q}]", **TOL)
        np.testing.assert_allclose(state.nu[q], vbar[q], err_msg=f"v[{q}]", **TOL)
    kept_b, kept_w = server.clients.opt_state
    np.testing.assert_allclose(kept_w, [p["w"] for p in model_], err_msg="model_[w]", **TOL)
    np.testing.assert_allclose(kept_b, [p["b"] for p in model_], err_msg="model_[b]", **TOL)


def test_persistent_mask_is_checked():
    """A kept leaf sits next to averaged ones (only a Global start keeps leaves) and is never
    averaged."""
    alg = fed.get_algorithm("fafed", {"name": "sgd"})
    with pytest.raises(TypeError, match="keep"):
        fed.start.Reset(keep=alg.start.keep)
    both = dataclasses.replace(alg, start=dataclasses.replace(alg.start, keep=fafed_aggregate_mask))
    params = {"w": jnp.zeros((2, 2))}
    with pytest.raises(ValueError, match="select the same leaves"):
        fed.init_server(both, params, {}, num_clients=2, key=jax.random.key(0))
