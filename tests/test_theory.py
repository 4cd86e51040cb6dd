"""fedorth.theory: toy problems, singular-value maps, Theorem 3's exponent, rollouts, observers."""

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedorth import fed
from fedorth.fed import metrics as fed_metrics
from fedorth.optim import newton_schulz
from fedorth.optim.newton_schulz import NS_PRESETS
from fedorth.theory import problems, rollout, spectral


def _matrix_with_spectrum(s, seed=0, shape=(7, 5)):
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.normal(size=(shape[0], len(s))))
    v, _ = np.linalg.qr(rng.normal(size=(shape[1], len(s))))
    return (u * np.asarray(s, np.float64)) @ v.T


@pytest.mark.parametrize("coeffs", sorted(NS_PRESETS))
@pytest.mark.parametrize("steps", [0, 1, 3, 8])
def test_singular_value_map_is_newton_schulz_on_singular_values(x64, coeffs, steps):
    """NS(G) = U phi_T(S / ||G||_F) V^T: same singular values and vectors as the scalar map."""
    s = np.array([3.0, 1.5, 0.4, 0.05])
    g = _matrix_with_spectrum(s)
    out = np.asarray(newton_schulz(jnp.asarray(g), steps, coeffs, eps=0.0))
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    u, vt = u[:, : s.size], vt[: s.size]  # rank 4: the fifth singular value is 0 and stays 0
    expected = (u * spectral.singular_value_map(s / np.linalg.norm(s), steps, coeffs)) @ vt
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


def test_classic_contraction_of_lemma12():
    """FedMuon-LMO Lemma 12: 1 - phi(x) = (1-x)^3 (3x^2 + 9x + 8)/8 <= (1-x)^1.5 on [0, 1]."""
    x = np.linspace(0.0, 1.0, 10001)
    one_minus = 1.0 - spectral.singular_value_map(x, 1, "classic")
    np.testing.assert_allclose(one_minus, (1 - x) ** 3 * (3 * x**2 + 9 * x + 8) / 8, atol=1e-14)
    assert np.all(one_minus >= -1e-15) and np.all(one_minus <= (1 - x) ** 1.5 + 1e-15)
    for steps in range(6):  # and by induction 1 - phi_T(x) <= (1 - x)^(1.5^T)
        residual = 1.0 - spectral.singular_value_map(x, steps, "classic")
        assert np.all(residual <= (1 - x) ** (1.5**steps) + 1e-14), steps


def test_theorem3_exponent_values():
    """p(0) = 2 (Remark 3), p decreases monotonically to 1 in T, p = 1 at kappa = 1."""
    for kappa in (0.01, 0.1, 0.3, 0.7):
        p = spectral.theorem3_exponent(np.arange(40), kappa)
        assert p[0] == pytest.approx(2.0, abs=1e-12)
        assert np.all(np.diff(p) <= 1e-15) and p[-1] == pytest.approx(1.0, abs=1e-9)
    # A hand-computed value: T = 1, kappa = 1/2: 1 + log(1 - 2^-1.5)/log(1/2).
    expected = 1 + np.log(1 - 0.5**1.5) / np.log(0.5)
    assert spectral.theorem3_exponent(1, 0.5) == pytest.approx(expected, rel=1e-14)
    assert spectral.theorem3_exponent(3, 1.0) == 1.0
    with pytest.raises(ValueError, match="kappa"):
        spectral.theorem3_exponent(1, 0.0)
    with pytest.raises(ValueError, match="steps"):
        spectral.theorem3_exponent(-1, 0.5)


@pytest.mark.parametrize("seed", range(4))
def test_lemma12_inequality_on_random_matrices(x64, seed):
    """FedMuon-LMO (5): ||G||_{p(T)} <= <G, NS_T(G)> <= ||G||_tr and ||NS_T(G)||_2 <= 1."""
    rng = np.random.default_rng(seed)
    s = np.sort(rng.uniform(0.05, 1.0, 4))[::-1] * 10.0 ** rng.uniform(-1, 1)
    g = _matrix_with_spectrum(s, seed)
    kappa = s.min() / np.linalg.norm(s)
    for steps in range(7):
        d = np.asarray(newton_schulz(jnp.asarray(g), steps, "classic", eps=0.0))
        inner = np.sum(g * d)
        p = float(spectral.theorem3_exponent(steps, kappa))
        assert spectral.schatten_norm(g, p) <= inner * (1 + 1e-12), (steps, p)
        assert inner <= spectral.schatten_norm(g, 1) * (1 + 1e-12)
        assert spectral.schatten_norm(d, np.inf) <= 1 + 1e-12


def test_schatten_norm_matches_numpy():
    g = np.random.default_rng(0).normal(size=(2, 5, 3))
    for p, ord_ in ((1, "nuc"), (2, "fro"), (np.inf, 2)):
        want = [np.linalg.norm(m, ord_) for m in g]
        np.testing.assert_allclose(spectral.schatten_norm(g, p), want, rtol=1e-12)
    with pytest.raises(ValueError, match="p="):
        spectral.schatten_norm(g, 0.5)


def _run(alg, problem, rounds, *, local_steps=1, lr=0.05, clients_per_round=None):
    return fp.start_rounds(
        alg,
        num_clients=problem.num_clients,
        clients_per_round=clients_per_round or problem.num_clients,
        local_steps=local_steps,
        learning_rate=lr,
        params=problem.params,
        loss_fn=problem.loss_fn,
        batch_fn=problem.batch_fn,
    )


def test_theorem1_local_muon_never_moves():
    """FedMuon-LMO Theorem 1 (Appendix D): LocalMuon's iterate stays exactly at x0 = -a/4."""
    problem = problems.theorem1_problem(a=2.0)
    alg = fed.get_algorithm("local_lmo", {"name": "lmo", "norm": "spectral", "momentum": 0.9})
    server, round_fn, _ = _run(alg, problem, 5)
    for _ in range(5):
        server, _ = round_fn(server, problem.data)
        assert float(server.params["w"][0, 0]) == -0.5
    # f(x*) = (1/2)((a/2)^2/2 + (a/2)^2/2) = a^2/8 and grad f(x*) = 0.
    assert float(problem.objective(problem.optimum)) == pytest.approx(0.5)
    grad = jax.grad(problem.objective)(problem.optimum)["w"]
    assert float(grad[0, 0]) == 0.0
    with pytest.raises(ValueError, match="nonzero"):
        problems.theorem1_problem(a=0.0)


def test_quadratic_problem_optimum_and_gradients(x64):
    """W* is stationary for f; the noiseless client gradient is H_i (W - B_i)."""
    problem = problems.quadratic_problem(3, (5, 2), seed=1, heterogeneity=2.0)
    grad = jax.grad(problem.objective)(problem.optimum)["w"]
    np.testing.assert_allclose(grad, 0.0, atol=1e-12)
    w = {"w": jnp.ones((5, 2))}
    batch = problem.batch_fn(problem.data, 2, jax.random.key(0))
    g = jax.grad(lambda p: problem.loss_fn(p, {}, batch, jax.random.key(1))[0])(w)["w"]
    h, b = np.asarray(problem.data["H"][2]), np.asarray(problem.data["B"][2])
    np.testing.assert_allclose(g, h @ (1.0 - b), rtol=1e-12)
    eig = np.linalg.eigvalsh(h)
    np.testing.assert_allclose([eig.min(), eig.max()], [1.0, 10.0], rtol=1e-10)


def test_quadratic_problem_noise_is_additive(x64):
    """grad = grad f_i + noise_scale * xi with xi = heavy_tailed_noise(key) (same key)."""
    from fedorth.theory.minimax_toy import heavy_tailed_noise

    problem = problems.quadratic_problem(
        2, (4, 3), seed=0, noise="pareto", tail_index=1.5, noise_scale=0.3
    )
    clean = problems.quadratic_problem(2, (4, 3), seed=0)
    key = jax.random.key(7)
    w = {"w": jnp.full((4, 3), 0.5)}

    def grad(prob):
        batch = prob.batch_fn(prob.data, 1, jax.random.key(0))
        return jax.grad(lambda p: prob.loss_fn(p, {}, batch, key)[0])(w)["w"]

    xi = heavy_tailed_noise(key, (4, 3), tail_index=1.5, noise="pareto", dtype=jnp.float64)
    np.testing.assert_allclose(grad(problem) - grad(clean), 0.3 * xi, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="tail_index"):
        problems.quadratic_problem(2, seed=0, noise="pareto", tail_index=2.5)
    with pytest.raises(ValueError, match="noise="):
        problems.quadratic_problem(2, seed=0, noise="cauchy")


def test_rollout_equals_python_loop(x64):
    """One scan over R rounds == R calls of the round function (same metrics, same params).

    The round of test_observe_clients_follows_the_engine[local_adamw] (same problem, algorithm
    and config): the suite's persistent compilation cache compiles it once for both tests."""
    problem = problems.quadratic_problem(5, (4, 3), seed=3, noise="gaussian", noise_scale=0.1)
    alg = fed.get_algorithm("local_adamw", {"name": "adamw"})
    server, round_fn, _ = _run(alg, problem, 3, local_steps=4, clients_per_round=3)
    run = jax.jit(rollout.rollout(round_fn, 3))
    scanned, history = run(jax.tree.map(jnp.copy, server), problem.data)
    losses = []
    for _ in range(3):
        server, metrics = round_fn(server, problem.data)
        losses.append(float(metrics["train_loss"]))
    np.testing.assert_allclose(scanned.params["w"], server.params["w"], rtol=1e-12)
    np.testing.assert_allclose(history["train_loss"], losses, rtol=1e-12)
    with pytest.raises(ValueError, match="rounds"):
        rollout.rollout(round_fn, 0)


@pytest.mark.parametrize(
    "name,options",
    [
        ("local_adamw", {}),
        ("fedpac", {"beta": 0.5}),
        ("fedmuon", {"alpha": 0.3}),
        ("fedpac_sophia", {}),  # per-client counters: Sophia's lax.cond runs both branches
    ],
)
def test_observe_clients_follows_the_engine(x64, name, options):
    """Same trajectory as make_round_fn; states average to the server's; drift = Eq. (7)."""
    problem = problems.quadratic_problem(5, (4, 3), seed=3, noise="gaussian", noise_scale=0.1)
    optim = {"fedmuon": {"name": "muon", "beta": 0.9}, "fedpac_sophia": {"name": "sophia"}}.get(
        name, {"name": "adamw"}
    )
    if name == "fedpac_sophia":
        optim["update_interval"] = 2
    alg = fed.get_algorithm(name, optim, **options)
    server, round_fn, config = _run(alg, problem, 3, local_steps=4, clients_per_round=3)
    observed = rollout.observe_clients(alg, problem.loss_fn, problem.batch_fn, config)
    other = jax.tree.map(jnp.copy, server)
    for _ in range(3):
        server, metrics = round_fn(server, problem.data)
        other, metrics_o, states_C = observed(other, problem.data)
        np.testing.assert_allclose(other.params["w"], server.params["w"], rtol=1e-12)
        np.testing.assert_allclose(metrics_o["train_loss"], metrics["train_loss"], rtol=1e-12)
        assert jax.tree.leaves(states_C)[-1].shape[0] == 3
        drift = fed_metrics.preconditioner_drift(states_C)["precond_drift"]
        np.testing.assert_allclose(metrics_o["precond_drift"], drift, rtol=1e-6)
        if alg.start.averaged:
            np.testing.assert_allclose(metrics_o["precond_drift"], metrics["precond_drift"], 1e-6)
            mean = jax.tree.map(lambda x: np.mean(np.asarray(x), axis=0), states_C)
            for a, b in zip(jax.tree.leaves(mean), jax.tree.leaves(server.opt_state), strict=True):
                if np.issubdtype(np.asarray(b).dtype, np.floating):
                    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
        else:
            assert other.opt_state is None


def test_observe_clients_rejects_persistent_algorithms():
    problem = problems.theorem1_problem()
    alg = fed.get_algorithm("fedmuon_bc", {"name": "lmo"})
    config = fed.RoundConfig(num_clients=2, clients_per_round=2, local_steps=1, learning_rate=0.1)
    with pytest.raises(ValueError, match="persistent"):
        rollout.observe_clients(alg, problem.loss_fn, problem.batch_fn, config)
