"""FedPAC uploads, averages and warm-starts Θ only (FedPAC (Liu et al.) Alg. 2 lines 3, 12, 16).

§3.2: SOAP ``Θ = {L, R}``, Sophia ``Θ = {h}``. The rest of the optimizer state restarts from
``init`` each round, as in Local-X (``fedorth.fed.algorithms.fedpac``). Float64 NumPy
transcriptions of Alg. 2 with Alg. 9 (Sophia) and Alg. 5 (SOAP, with the reference SOAP's
first step and refresh, ``fedorth.optim.soap``) follow the engine round for round, for the
default ``aligned="theta"`` and for ``aligned="state"`` (the whole state, the behaviour before).

The clients' quadratics have diagonal Hessians ``H_i`` (rows of ``W``), so Hutchinson's estimate
``u ⊙ (∇²f u)`` is exactly ``diag(∇²f)`` whatever the probes: the transcription needs no
random numbers.
"""

from __future__ import annotations

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedorth import fed
from fedorth.optim import federated
from fedorth.optim.soap import SoapState

N, S, K, ROUNDS, LR, BETA, WD = 4, 3, 3, 3, 0.05, 0.5, 0.01
# The initial point: not 0, so that weight decay moves x on SOAP's update-free first step and the
# second gradient differs from the first (else its rotation into the first one's eigenbasis is
# diagonal, and the off-diagonal rounding noise divided by sqrt(v) + eps is an O(1e-8) update).
X0 = [np.random.default_rng(9).normal(size=(4, 4)), np.random.default_rng(10).normal(size=4)]


def _diagonal_clients(seed: int = 3):
    """``fed_problems``' quadratics with diagonal ``H_i`` (distinct per client) and square ``W``.

    Square: a generic gradient then has full rank, so no factor of SOAP's first step has a null
    space, whose basis (and the update along it) would be rounding noise (``fedorth.optim.soap``).
    """
    rng = np.random.default_rng(seed)
    return {
        "H": np.stack([np.diag(rng.uniform(0.5, 3.0, size=4)) for _ in range(N)]),
        "B": rng.normal(size=(N, 4, 4)) * 2.0,
        "c": rng.normal(size=(N, 4)),
    }


def _x0():
    return {"w": jnp.asarray(X0[0]), "b": jnp.asarray(X0[1])}


def _engine(name: str, optim: dict, data, strategy: str = "vmap", **options):
    """Params, global direction and per-round metrics after ROUNDS rounds (float64 under the
    ``x64`` fixture)."""
    alg = fed.get_algorithm(name, optim, **options)
    settings = dict(num_clients=N, clients_per_round=S, local_steps=K, learning_rate=LR)
    server, history = fp.run_rounds(
        alg, data, rounds=ROUNDS, params=_x0(), strategy=strategy, **settings
    )
    return server, [{k: float(v) for k, v in m.items()} for m in history]


def _fedpac(data, client_round, server_average, state0):
    """Alg. 2: clients start from the server's state (line 3), run K steps with the correction
    ``x <- x - eta [(1 - beta) P(g) + beta g_G + lambda x]`` (line 9, weight decay in the
    bracket), the server averages x and the states (lines 14-16). Returns (w, b, g_G, drifts)."""
    x = [a.copy() for a in X0]
    dg = [np.zeros((4, 4)), np.zeros(4)]
    state = state0
    drifts = []
    for r in range(ROUNDS):
        deltas, states = [], []
        for i in fp.sampled_ids(jax.random.key(0), r, N, S):
            y = [a.copy() for a in x]
            st = state
            for k in range(K):
                g = fp.np_grads(data, i, *y)
                hdiag = [np.repeat(np.diag(data["H"][i])[:, None], 4, axis=1), np.ones(4)]
                d, st = client_round(st, g, hdiag, r * K + k)
                y = [
                    a - LR * ((1 - BETA) * u + BETA * c + WD * a)
                    for a, u, c in zip(y, d, dg, strict=True)
                ]
            deltas.append([a - b for a, b in zip(y, x, strict=True)])
            states.append(st)
        mean = [np.mean([dl[j] for dl in deltas], axis=0) for j in range(2)]
        dg = [-m / (K * LR) for m in mean]
        x = [a + m for a, m in zip(x, mean, strict=True)]
        state, drift = server_average(states, r)
        drifts.append(drift)
    return x, dg, drifts


def _eq7(leaves_C):
    """FedPAC (Liu et al.) Eq. 7: (1/S) sum_i sum_leaves ||Θ_i - Θ-bar||_F^2."""
    return sum(np.sum((np.stack(c) - np.mean(c, axis=0)) ** 2) / len(c) for c in leaves_C)


# Golden values: server params after 3 rounds of ``fedpac_soap`` / ``fedpac_sophia`` on
# ``_diagonal_clients()`` (float64, the options of the tests below), produced by fedorth's
# whole-state FedPAC before Θ-only alignment (commit 64c3736). ``aligned="state"`` must give them.
GOLDEN = {
    "fedpac_sophia": [
        -0.7011120140918163, 0.30679209558361625, -1.4867656913070455, 0.5942131458773572,
        1.016516464344581, -0.29068906740445843, 0.31230789013876215, 0.09029365165072559,
        -0.23502080088729657, -0.820566816071618, -1.8605793747574164, 1.2424082304829707,
        -0.07535589936480724, 2.3472385553807835, 0.7055228613550328, 0.24161500737019484,
        -0.9372767791297869, -0.6090076556857589, -0.6710110049237217, 0.18727574700235508,
    ],
    "fedpac_soap": [
        -0.7666113450535145, 0.3034021930359614, -1.443649983685576, 0.4248951657392792,
        0.8096667732170463, -0.24264040406640386, 0.24393541006544747, 0.3522342867278305,
        -0.38650727674598906, -0.953737377738398, -1.854449411537872, 1.1131782512283945,
        -0.16222432655226282, 2.340624849263217, 0.7649769772093866, 0.08824300259664214,
        -0.8323378807718264, -0.5916832732560431, -0.6743356894516513, 0.15038867807616352,
    ],
}  # fmt: skip


def _check_golden(name, server):
    """``aligned="state"`` is the previous FedPAC: the old code path's params (``GOLDEN``)."""
    got = np.concatenate([np.ravel(server.params["w"]), server.params["b"]])
    np.testing.assert_allclose(got, GOLDEN[name], rtol=1e-10, atol=1e-13)


# ----------------------------------------------------------------------------- Sophia

SOPHIA = {"name": "sophia", "b1": 0.9, "b2": 0.99, "rho": 0.5, "update_interval": 2}
SOPHIA["weight_decay"] = WD


def _np_sophia(data, aligned: str):
    """Alg. 9 (clip_mode="paper"): m <- b1 m + (1 - b1) g; h refreshed when (rK + k) mod f_h = 0
    (line 9: k counted from 1, over the whole training); D = clip(m / max(h, eps), +-rho)."""
    b1, b2, rho, f_h, eps = 0.9, 0.99, 0.5, 2, 1e-12

    def client_round(st, g, hdiag, step):
        m, h = st
        m = [b1 * a + (1 - b1) * b for a, b in zip(m, g, strict=True)]
        if (step + 1) % f_h == 0:
            h = [b2 * a + (1 - b2) * np.maximum(e, 0) for a, e in zip(h, hdiag, strict=True)]
        return [np.clip(a / np.maximum(c, eps), -rho, rho) for a, c in zip(m, h, strict=True)], (
            m,
            h,
        )

    zeros = ([np.zeros((4, 4)), np.zeros(4)],) * 2

    def server_average(states, r):
        h = [np.mean([st[1][j] for st in states], axis=0) for j in range(2)]
        m = [np.mean([st[0][j] for st in states], axis=0) for j in range(2)]
        drift = _eq7([[st[1][j] for st in states] for j in range(2)])
        # Θ = {h} (Alg. 2 line 16); m restarts from zero (Local Sophia, Alg. 8) unless "state".
        return ((m if aligned == "state" else zeros[0]), h), drift

    return _fedpac(data, client_round, server_average, zeros)


@pytest.mark.parametrize("aligned", ["theta", "state"])
def test_fedpac_sophia_matches_alg2_with_alg9(x64, aligned):
    """FedPAC_Sophia, 3 rounds of 3 of 4 clients, K = 3, f_h = 2: params, g_G and the logged
    preconditioner drift (Eq. 7 over h, the streamed path) equal the NumPy transcription to
    ~1e-12. ``"theta"``: h averaged, m from zero each round; ``"state"``: m averaged too. The
    two differ (m's warm start matters), so each transcription pins its own mode; ``"state"``
    also gives the old code path's params (``GOLDEN``)."""
    data = _diagonal_clients()
    server, metrics = _engine("fedpac_sophia", SOPHIA, data, beta=BETA, aligned=aligned)
    if aligned == "state":
        _check_golden("fedpac_sophia", server)
    (w, b), (dg_w, _), drifts = _np_sophia(data, aligned)
    np.testing.assert_allclose(server.params["w"], w, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(server.params["b"], b, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(server.global_direction["w"], dg_w, rtol=1e-11, atol=1e-12)
    got = [m["precond_drift"] for m in metrics]
    np.testing.assert_allclose(got, drifts, rtol=1e-10, atol=1e-15)
    other = _np_sophia(data, "state" if aligned == "theta" else "theta")[0][0]
    assert np.max(np.abs(other - w)) > 1e-4, "the modes must differ on this problem"


# ----------------------------------------------------------------------------- SOAP

SOAP = {"name": "soap", "b1": 0.9, "b2": 0.95, "precondition_frequency": 4, "weight_decay": WD}


def _eigh_desc(gg):
    return np.linalg.eigh(gg + 1e-30 * np.eye(len(gg)))[1][:, ::-1]


def _np_soap(data, aligned: str):
    """Alg. 5's SOAP step as the reference runs it (``fedorth.optim.soap``), per leaf: w (4 x 4)
    rotated by Q_L, Q_R; b (4,) plain Adam. Step ``c`` (global, from 0): the first step since
    the moments were zero (c = 0; under ``"theta"`` every round's first, c mod K = 0, as in
    Local SOAP and the authors' code) adds G to L, R, builds Q = eigh (descending) and returns
    0; else G' = Q_Lᵀ G Q_R, m, v Adam moments with bias
    correction at t (Adam steps since the moments were zero), L, R EMAs (β_s = b2), and when
    c mod f = 0 the QR refresh (power step, columns sorted by the estimated eigenvalues, v
    permuted, m moved to the new basis)."""
    b1, b2, eps, f = 0.9, 0.95, 1e-8, 4

    def client_round(st, g, hdiag, step):
        del hdiag
        (mw, vw, mb, vb, t), (gl, gr), (ql, qr) = st
        gw, gb = g
        if step == 0 or (aligned == "theta" and step % K == 0):
            gl = b2 * gl + (1 - b2) * gw @ gw.T
            gr = b2 * gr + (1 - b2) * gw.T @ gw
            return [np.zeros((4, 4)), np.zeros(4)], (
                (mw, vw, mb, vb, t),
                (gl, gr),
                (_eigh_desc(gl), _eigh_desc(gr)),
            )
        t += 1
        corr = np.sqrt(1 - b2**t) / (1 - b1**t)
        rot = ql.T @ gw @ qr
        mw, vw = b1 * mw + (1 - b1) * rot, b2 * vw + (1 - b2) * rot**2
        mb, vb = b1 * mb + (1 - b1) * gb, b2 * vb + (1 - b2) * gb**2
        dw = ql @ (mw / (np.sqrt(vw) + eps)) @ qr.T * corr
        db = mb / (np.sqrt(vb) + eps) * corr
        gl = b2 * gl + (1 - b2) * gw @ gw.T
        gr = b2 * gr + (1 - b2) * gw.T @ gw
        if step % f == 0:
            original = ql @ mw @ qr.T
            new = []
            for axis, (gg, q) in enumerate(((gl, ql), (gr, qr))):
                mo = gg @ q
                order = np.argsort(-np.sum(q * mo, axis=0), kind="stable")
                vw = np.take(vw, order, axis=axis)
                new.append(np.linalg.qr(mo[:, order])[0])
            ql, qr = new
            mw = ql.T @ original @ qr
        return [dw, db], ((mw, vw, mb, vb, t), (gl, gr), (ql, qr))

    fresh = (np.zeros((4, 4)), np.zeros((4, 4)), np.zeros(4), np.zeros(4), 0)
    zero = np.zeros((4, 4))
    state0 = (fresh, (zero, zero), (zero, zero))

    def server_average(states, r):
        gl = np.mean([st[1][0] for st in states], axis=0)
        gr = np.mean([st[1][1] for st in states], axis=0)
        ql, qr = _eigh_desc(gl), _eigh_desc(gr)  # Q rebuilt from the averaged Θ
        drift = _eq7([[st[1][j] for st in states] for j in range(2)])
        if aligned == "theta":  # m, v (and their step count) restart with the next round
            return (fresh, (gl, gr), (ql, qr)), drift
        # "state": m averaged in the original space and rotated into the new basis, v averaged
        # as is, the moment count shared.
        mw = ql.T @ np.mean([s[2][0] @ s[0][0] @ s[2][1].T for s in states], axis=0) @ qr
        avg = [np.mean([s[0][j] for s in states], axis=0) for j in (1, 2, 3)]
        return ((mw, *avg, states[0][0][4]), (gl, gr), (ql, qr)), drift

    return _fedpac(data, client_round, server_average, state0)


@pytest.mark.parametrize("aligned", ["theta", "state"])
def test_fedpac_soap_matches_alg2_with_alg5(x64, aligned):
    """FedPAC_SOAP, 3 rounds of 3 of 4 clients, K = 3, f = 4 (refreshes at global steps 4 and
    8, inside rounds 1 and 2): params, g_G and the drift (Eq. 7 over L, R; the stacked path of
    SOAP's averaging rule) equal the NumPy transcription. ``"theta"``: L, R averaged (the server
    rebuilds no Q, which no client reads), m and v from zero, each round's first step update-free
    (it adds the gradient to L, R and rebuilds Q by eigh, as Local SOAP's first step does) and t
    restarting at 1 on the second, the refresh counted over the whole training; ``"state"``: m, v
    averaged too (the only update-free step is training's first), and the old code path's params
    (``GOLDEN``).
    """
    data = _diagonal_clients()
    server, metrics = _engine("fedpac_soap", SOAP, data, beta=BETA, aligned=aligned)
    if aligned == "state":
        _check_golden("fedpac_soap", server)
    (w, b), (dg_w, _), drifts = _np_soap(data, aligned)
    np.testing.assert_allclose(server.params["w"], w, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(server.params["b"], b, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(server.global_direction["w"], dg_w, rtol=1e-10, atol=1e-11)
    got = [m["precond_drift"] for m in metrics]
    # The stacked path's drift is summed in float32 (fed.metrics.preconditioner_drift).
    np.testing.assert_allclose(got, drifts, rtol=1e-6)
    (soap_state,) = [
        x
        for x in jax.tree.leaves(server.opt_state, is_leaf=lambda x: isinstance(x, SoapState))
        if isinstance(x, SoapState)
    ]
    assert int(soap_state.count) == ROUNDS * K  # the shared counter runs over rounds
    other = _np_soap(data, "state" if aligned == "theta" else "theta")[0][0]
    assert np.max(np.abs(other - w)) > 1e-4, "the modes must differ on this problem"


@pytest.mark.parametrize("strategy", ["sequential", "vmap"])
def test_theta_rounds_without_the_servers_bases_give_the_same_parameters(monkeypatch, strategy):
    """Under Θ alignment the server's average leaves SOAP's bases and moments at zeros
    (``Global.read_mask``: a client starts them from ``init``, and its update-free call rebuilds
    Q): three rounds give bit for bit the parameters, g_G and metrics of rounds whose server
    rebuilds Q by eigh and rotates the moments as with the whole state (``read_mask`` -> None),
    float32 as users run it."""
    from fedorth.fed import start

    data = _diagonal_clients()

    def rounds():
        with jax.enable_x64(False):
            alg = fed.get_algorithm("fedpac_soap", SOAP, beta=BETA)
            settings = dict(num_clients=N, clients_per_round=S, local_steps=K, learning_rate=LR)
            x0 = {k: jnp.asarray(v, jnp.float32) for k, v in _x0().items()}
            return fp.run_rounds(alg, data, rounds=ROUNDS, params=x0, strategy=strategy, **settings)

    skipped, skipped_metrics = rounds()
    monkeypatch.setattr(start.Global, "read_mask", lambda self, opt_state: None)
    whole, whole_metrics = rounds()
    for name in ("params", "global_direction"):
        for a, b in zip(
            jax.tree.leaves(getattr(skipped, name)),
            jax.tree.leaves(getattr(whole, name)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    for got, want in zip(skipped_metrics, whole_metrics, strict=True):
        assert got.keys() == want.keys()
        for key in got:
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), key)

    def soap_of(server):
        (state,) = [
            x
            for x in jax.tree.leaves(server.opt_state, is_leaf=lambda x: isinstance(x, SoapState))
            if isinstance(x, SoapState)
        ]
        return state

    for a, b in zip(
        jax.tree.leaves(soap_of(skipped).GG), jax.tree.leaves(soap_of(whole).GG), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not any(np.any(np.asarray(q)) for q in jax.tree.leaves(soap_of(skipped).Q))
    assert all(np.any(np.asarray(q)) for q in jax.tree.leaves(soap_of(whole).Q))


def test_light_upload_compresses_theta_only():
    """FedPAC_SOAP_light under Θ alignment: the upload (``fed.round._compress_state`` with the
    algorithm's aggregate mask) truncates L and R and leaves m, v and Q untouched to the bit; the
    whole-state variant truncates m and v too."""
    from fedorth.fed.round import _compress_state

    params = {"w": jnp.zeros((20, 30))}
    rng = np.random.default_rng(4)
    for aligned, moments_kept in (("theta", True), ("state", False)):
        alg = fed.get_algorithm("fedpac_soap_light", {"name": "soap"}, aligned=aligned)
        state = jax.tree.map(
            lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype) if x.ndim else x,
            alg.local_tx.init(params)[0],  # the SoapState of the local chain
        )
        # Jitted: one program instead of op-by-op dispatch; a leaf passed through keeps its bits.
        compress = jax.jit(lambda st: _compress_state(st, alg.start.compression, alg.start.mask))
        out = compress(state)
        for a, b in zip(jax.tree.leaves(out.Q), jax.tree.leaves(state.Q), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(out.GG), jax.tree.leaves(state.GG), strict=True):
            assert np.linalg.matrix_rank(np.asarray(a)) < np.linalg.matrix_rank(np.asarray(b))
        for field in ("exp_avg", "exp_avg_sq"):
            same = np.array_equal(getattr(out, field)["w"], getattr(state, field)["w"])
            assert same == moments_kept, (aligned, field)


def test_theta_upload_bytes_by_hand():
    """``fed.communication_bytes`` (float32) counts Θ only: a (3, 3, 8, 16) conv kernel, a
    (16,) bias and a (10, 5000) matrix whose 5000 axis exceeds max_precond_dim = 1000.
    |x| = 1152 + 16 + 50000 = 51168. SOAP: the kernel's factors 3² + 3² + 8² + 16² = 338, the
    matrix's left factor 10² = 100 (its right axis is not rotated: no factor), the bias none
    (1-D, no precondition_1d): 51168 + 438. Sophia: |x| + |h| = 2|x| (FedPAC (Liu et al.)
    Table 11). AdamW declares no Θ and is aligned whole: |x| + |m| + |v| = 3|x|."""
    params = {
        "k": jnp.zeros((3, 3, 8, 16)),
        "b": jnp.zeros(16),
        "m": jnp.zeros((10, 5000)),
    }
    x = 1152 + 16 + 50000

    def up(name, optim):
        alg = fed.get_algorithm(name, optim)
        server = fed.init_server(alg, params, {}, num_clients=2, key=jax.random.key(0))
        return fed.communication_bytes(alg, server)

    soap = up("fedpac_soap", {"name": "soap", "max_precond_dim": 1000})
    assert soap["bytes_up"] == 4 * (x + 338 + 100)
    # Down: x, Θ-bar and g_G (clients rebuild nothing: Q is sent neither way).
    assert soap["bytes_down"] == 4 * (2 * x + 338 + 100)
    assert up("fedpac_sophia", {"name": "sophia"})["bytes_up"] == 4 * 2 * x
    assert up("fedpac", {"name": "adamw"})["bytes_up"] == 4 * 3 * x


def test_sophia_optax_form_is_refused_under_theta_alignment():
    """clip_mode="optax" bias-corrects m by the shared count, which Θ alignment keeps across
    rounds while m restarts: refused with the fix named; allowed with aligned="state"."""
    optim = {"name": "sophia", "clip_mode": "optax"}
    with pytest.raises(ValueError, match="optim.clip_mode='paper'.*fed.options.aligned='state'"):
        fed.get_algorithm("fedpac_sophia", optim)
    assert fed.get_algorithm("fedpac_sophia", optim, aligned="state").start.mask is None
    with pytest.raises(ValueError, match=r"fed.options.aligned='all'; valid: \('theta', 'state'\)"):
        fed.get_algorithm("fedpac_soap", {"name": "soap"}, aligned="all")
    assert fed.get_algorithm("fedpac_soap", {"name": "soap"}).start.mask is federated.align_mask


@pytest.mark.parametrize(
    "name",
    [f"fedpac_{o}{light}" for o in ("soap", "sophia", "muon") for light in ("", "_light")],
)
def test_every_fedpac_preset_names_what_it_aligns(name):
    """Every preset of the FedPAC configs sets fed.options.aligned to Alg. 2's "theta", so that
    `--config.fed.options.aligned=state` can switch a paper preset to the whole-state extension
    (ml_collections refuses to override a key the config does not have)."""
    import importlib

    module = importlib.import_module(f"configs.{name}")
    for preset in ["", *module.PRESETS]:
        config = module.get_config(preset)
        assert config.fed.options.aligned == "theta", (name, preset)
        config.fed.options.aligned = "state"  # the override the command line performs


def test_local_soap_and_fedpac_soap_take_the_same_update_free_steps(monkeypatch):
    """Local SOAP and Θ-only FedPAC_SOAP take the same number of update-free steps: one per
    client per round (the reference's first call, which builds Q by eigh; the authors' code
    does it on every round's first step for both methods), so both take K - 1 Adam steps per
    round. Counted on the directions SOAP returns in the engine (all-zero = update-free), with
    the CPU's default strategy (sequential): tests/test_fed_golden.py requires both algorithms'
    rounds to agree at float32 rounding under vmap, chunked, sequential and sharded, which an
    extra or a missing update-free step would break."""
    from fedorth.fed import local
    from fedorth.optim.soap import scale_by_soap

    calls = []

    def record_update_free(updates, state, params=None):
        del params
        zero = sum(jnp.sum(jnp.abs(u)) for u in jax.tree.leaves(updates)) == 0
        jax.debug.callback(lambda z: calls.append(bool(z)), zero)
        return updates, state

    def recorded_soap(**kwargs):
        recorder = optax.GradientTransformation(optax.init_empty_state, record_update_free)
        return optax.chain(scale_by_soap(**kwargs), recorder)

    monkeypatch.setitem(local.DIRECTIONS, "soap", recorded_soap)
    data = _diagonal_clients()
    free = {}
    for name, options in [("local_soap", {}), ("fedpac_soap", {"beta": BETA})]:
        calls.clear()
        _engine(name, SOAP, data, "sequential", **options)
        jax.effects_barrier()
        assert len(calls) == ROUNDS * S * K, (name, len(calls))
        free[name] = sum(calls)
    assert free == {"local_soap": ROUNDS * S, "fedpac_soap": ROUNDS * S}, free
