"""Tests for fedorth.optim.sophia against float64 NumPy references, optax.contrib and identities."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optim_battery as battery
import pytest
from helpers import fast_jit
from optax.contrib import _sophia as optax_sophia

from fedorth.optim import SophiaState, scale_by_sophia, sophia
from fedorth.optim.sophia import gnb_diagonal, hutchinson_diagonal, rademacher_like

SHAPES = {"w": (3, 4), "b": (4,)}
SIZE = 16


def unflatten(x):
    """Flat [16] vector -> {"w": [3, 4], "b": [4]} (w first, row-major)."""
    return {"w": x[:12].reshape(3, 4), "b": x[12:]}


def flatten(tree):
    return jnp.concatenate([tree["w"].ravel(), tree["b"]])


def np_flatten(tree):
    return np.concatenate([np.asarray(tree["w"], np.float64).ravel(), np.asarray(tree["b"])])


def shared_counter_axes(state):
    """vmap axes for a client-stacked state: None for integer scalar leaves, 0 for the rest.

    This is the engine's convention (docs/CONTRACTS.md): schedule counters are shared.
    """
    return jax.tree.map(
        lambda x: None if jnp.ndim(x) == 0 and jnp.issubdtype(x.dtype, jnp.integer) else 0,
        state,
    )


def quadratic(a, c):
    """f(θ) = ½ (x − c)ᵀ A (x − c) with x = flatten(θ); Hessian A."""
    a, c = jnp.asarray(a, jnp.float32), jnp.asarray(c, jnp.float32)

    def f(params):
        r = flatten(params) - c
        return 0.5 * r @ (a @ r)

    return f


def dense_hessian(seed, indefinite=False):
    rng = np.random.default_rng(seed)
    b = rng.normal(size=(SIZE, SIZE))
    a = b @ b.T / SIZE + 0.5 * np.eye(SIZE)
    if indefinite:
        a -= 1.2 * np.diag(rng.uniform(size=SIZE))
    return a


def np_packed_signs(key, sizes):
    """NumPy reading of `rademacher_like`'s docstring: one flat ±1 vector per size (tree order).

    Entry 32·i + j of the concatenated leaves is +1 where bit j of word i of
    ``jax.random.bits(key, (ceil(n / 32),), uint32)`` is set, else −1.
    """
    total = sum(sizes)
    words = np.asarray(jax.random.bits(key, (-(-total // 32),), jnp.uint32), np.uint64)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint64)) & 1
    flat = np.where(bits.reshape(-1)[:total] == 1, 1.0, -1.0)
    return np.split(flat, np.cumsum(sizes)[:-1])


def rademacher_probe(key, probes="packed"):
    """The documented probe of `hutchinson_diagonal` for one key, as a flat NumPy vector."""
    if probes == "optax":
        zeros = unflatten(jnp.zeros(SIZE))
        return np_flatten(optax.tree.random_like(key, zeros, jax.random.rademacher, jnp.float32))
    b, w = np_packed_signs(key, [4, 12])  # tree order: "b" before "w"
    return np.concatenate([w, b])


# --------------------------------------------------------------------------------------
# Float64 NumPy reference of the two variants (module docstring; FedPAC (Liu et al.) Alg. 8 for
# "paper").


def numpy_sophia(x0, grad_fn, hdiag_fn, *, steps, lr, b1, b2, rho, eps, interval, wd, mode):
    x, m, h = np.array(x0, np.float64), np.zeros(x0.size), np.zeros(x0.size)
    xs, directions = [], []
    for k in range(1, steps + 1):
        g = grad_fn(x)
        m = b1 * m + (1 - b1) * g
        if mode == "paper":
            if k % interval == 0:
                h = b2 * h + (1 - b2) * np.maximum(hdiag_fn(x), 0)
            d = np.clip(m / np.maximum(h, eps), -rho, rho)
        else:
            m_hat = m / (1 - b1**k)
            d = np.clip(m_hat / np.maximum(rho * h, eps), -1, 1)
            if (k - 1) % interval == 0:
                h = b2 * h + (1 - b2) * hdiag_fn(x)
        x = x - lr * (d + wd * x)
        xs.append(x)
        directions.append(d)
    return np.array(xs), np.array(directions)


@pytest.mark.parametrize("mode", ["paper", "optax"])
def test_matches_numpy_reference_on_diagonal_quadratic(mode):
    # Diagonal Hessian with mixed signs: u ⊙ Hu = diag(H) for every Rademacher u, so the
    # Hutchinson estimate is exact and "paper"'s max(ĥ, 0) clamp is exercised.
    rng = np.random.default_rng(1)
    diag = rng.permutation(np.linspace(-2.0, 6.0, SIZE) + 0.03)
    center = rng.normal(size=SIZE)
    x0 = rng.normal(size=SIZE) * 2
    hyper = dict(lr=0.5, b1=0.8, b2=0.7, rho=0.3, eps=1e-3, interval=3, wd=0.05)
    if mode == "optax":
        hyper.update(lr=0.1, rho=0.6)
    xs_ref, d_ref = numpy_sophia(
        x0,
        lambda x: diag * (x - center),
        lambda x: diag,
        steps=20,
        mode=mode,
        **hyper,
    )
    # The test only means something if some coordinates are clipped and others are not.
    bound = hyper["rho"] if mode == "paper" else 1.0
    assert np.any(np.abs(d_ref) == bound) and np.any(np.abs(d_ref[5:]) < 0.9 * bound)

    f = quadratic(np.diag(diag), center)
    tx = sophia(
        hyper["lr"],
        hyper["b1"],
        hyper["b2"],
        rho=hyper["rho"],
        eps=hyper["eps"],
        weight_decay=hyper["wd"],
        update_interval=hyper["interval"],
        clip_mode=mode,
    )

    @fast_jit
    def step(params, state):
        updates, state = tx.update(jax.grad(f)(params), state, params, obj_fn=f)
        return optax.apply_updates(params, updates), state

    params = unflatten(jnp.asarray(x0, jnp.float32))
    state = tx.init(params)
    for k in range(20):
        params, state = step(params, state)
        np.testing.assert_allclose(np_flatten(params), xs_ref[k], rtol=2e-5, atol=2e-5)
    assert int(state[0].count) == 20


def test_hutchinson_matches_numpy_on_dense_hessian():
    a = dense_hessian(2)
    f = quadratic(a, np.zeros(SIZE))
    params = unflatten(jnp.linspace(-1.0, 1.0, SIZE))
    key = jax.random.key(3)
    for sampler in ("packed", "optax"):
        for num_probes in (1, 3):
            got = np_flatten(hutchinson_diagonal(f, params, key, num_probes, probes=sampler))
            keys = [key] if num_probes == 1 else list(jax.random.split(key, num_probes))
            probes = [rademacher_probe(k, sampler) for k in keys]
            assert all(set(np.unique(u)) == {-1.0, 1.0} for u in probes)
            want = np.mean([u * (a @ u) for u in probes], axis=0)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_packed_signs_follow_the_documented_bits():
    # Leaves of odd sizes (53 entries: the last word is partly used), several dtypes, a typed
    # and a raw key: each leaf's signs are its slice of the unpacked words, in tree order.
    tree = {
        "a": jnp.zeros((3, 5), jnp.bfloat16),
        "b": jnp.zeros((7,), jnp.float32),
        "c": {"d": jnp.zeros((31,), jnp.float16)},
    }
    for key in (jax.random.key(21), jax.random.PRNGKey(21)):
        got = fast_jit(rademacher_like)(key, tree)
        leaves = jax.tree.leaves(got)
        want = np_packed_signs(key, [leaf.size for leaf in leaves])
        for leaf, ref, proto in zip(leaves, want, jax.tree.leaves(tree), strict=True):
            assert leaf.dtype == proto.dtype and leaf.shape == proto.shape
            np.testing.assert_array_equal(np.asarray(leaf, np.float64).ravel(), ref)


def test_packed_signs_are_fair_independent_coins():
    # 2**20 signs from one key: every statistic below is a sum of n independent ±1 terms under
    # the Rademacher law, so it lies within 5/sqrt(n) of 0 (a 5-sigma bound; these are fixed
    # draws, so the test is deterministic). A sampler that reused bits across words or bit
    # positions, or leaked a bias, would put one of them far outside.
    n = 2**20
    u = np.asarray(rademacher_like(jax.random.key(5), jnp.zeros(n)), np.float64)
    assert set(np.unique(u)) == {-1.0, 1.0}
    assert abs(u.mean()) < 5 / np.sqrt(n)
    by_position = u.reshape(-1, 32)  # column j: bit j of every word
    assert np.all(np.abs(by_position.mean(axis=0)) < 5 / np.sqrt(n // 32))
    for lag in (1, 31, 32, 33, 64):  # neighbouring bits and the same bit of neighbouring words
        assert abs(np.mean(u[:-lag] * u[lag:])) < 5 / np.sqrt(n - lag)
    # Different keys, different signs (agreement of two independent draws is 1/2 on average).
    v = np.asarray(rademacher_like(jax.random.key(6), jnp.zeros(n)), np.float64)
    assert abs(np.mean(u * v)) < 5 / np.sqrt(n)


def test_packed_hutchinson_is_unbiased_with_the_rademacher_variance():
    # E[u ⊙ Au] = diag(A), and for Rademacher u, Var[(u ⊙ Au)_i] = Σ_{j≠i} A_ij²: the mean of
    # P probes must lie within 5 standard errors of diag(A) in every coordinate.
    a = dense_hessian(8, indefinite=True)
    f = quadratic(a, np.zeros(SIZE))
    params = unflatten(jnp.zeros(SIZE))
    num_probes = 4096
    got = np_flatten(hutchinson_diagonal(f, params, jax.random.key(2), num_probes))
    off = a - np.diag(np.diag(a))
    stderr = np.sqrt((off**2).sum(axis=1) / num_probes)
    assert np.all(np.abs(got - np.diag(a)) < 5 * stderr)
    assert np.any(np.abs(got - np.diag(a)) > 0.05 * stderr)  # a real estimate, not diag(A)


def test_default_probe_key_is_seed_folded_with_count():
    # Without a hessian_key, the probe of the step with (pre-increment) count c comes from
    # fold_in(key(seed), c): check two refreshes against NumPy with those probes.
    a = dense_hessian(4)
    f = quadratic(a, np.zeros(SIZE))
    b2, seed = 0.6, 11
    tx = scale_by_sophia(0.9, b2, update_interval=1, clip_mode="optax", seed=seed)
    params = unflatten(jnp.ones(SIZE))
    state = tx.init(params)
    h = np.zeros(SIZE)
    for count in range(2):
        _, state = tx.update(jax.grad(f)(params), state, params, obj_fn=f)
        u = rademacher_probe(jax.random.fold_in(jax.random.key(seed), count))
        h = b2 * h + (1 - b2) * u * (a @ u)
        np.testing.assert_allclose(np_flatten(state.nu), h, rtol=1e-5, atol=1e-5)


def test_matches_optax_contrib_sophia_with_same_probes():
    # clip_mode="optax" is optax.contrib.scale_by_sophia(gamma=rho, clip_threshold=1): with the
    # probe key optax would draw (its state key is split once per refresh), updates and the
    # Hessian EMA agree on an indefinite dense quadratic, where the probes matter.
    a = dense_hessian(5, indefinite=True)
    f = quadratic(a, np.linspace(-1, 1, SIZE))
    hyper = dict(b1=0.9, b2=0.95, eps=1e-8, update_interval=3)
    ours = scale_by_sophia(rho=0.05, clip_mode="optax", probes="optax", **hyper)
    theirs = optax_sophia.scale_by_sophia(
        gamma=0.05,
        clip_threshold=1.0,
        hessian_diagonal_fn=optax_sophia.hutchinson_estimator_diag_hessian(jax.random.PRNGKey(7)),
        **hyper,
    )
    ours_update = fast_jit(lambda g, s, p, k: ours.update(g, s, p, obj_fn=f, hessian_key=k))
    theirs_update = fast_jit(lambda g, s, p: theirs.update(g, s, p, obj_fn=f))
    params = unflatten(jnp.linspace(0.5, -2.0, SIZE))
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    optax_key = jax.random.PRNGKey(7)
    # Both sides' Hessian-vector products at float32 (a GPU's default is TF32, whose rounding
    # differs between the two differentiation paths), traced inside the context.
    with jax.default_matmul_precision("float32"):
        for k in range(12):
            next_key, probe_key = jax.random.split(optax_key)
            if k % 3 == 0:
                optax_key = next_key
            g = jax.grad(f)(params)
            u_ours, s_ours = ours_update(g, s_ours, params, probe_key)
            u_theirs, s_theirs = theirs_update(g, s_theirs, params)
            np.testing.assert_allclose(
                np_flatten(u_ours), np_flatten(u_theirs), rtol=1e-6, atol=1e-7
            )
            np.testing.assert_allclose(
                np_flatten(s_ours.nu), np_flatten(s_theirs.nu), rtol=1e-6, atol=1e-7
            )
            params = optax.apply_updates(params, jax.tree.map(lambda u: -0.1 * u, u_ours))
    assert int(s_ours.count) == int(s_theirs.count) == 12


# --------------------------------------------------------------------------------------
# Gauss–Newton–Bartlett on softmax regression


def softmax_regression(num_examples=6, dim=3, classes=4):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(num_examples, dim))
    params = {"w": jnp.asarray(rng.normal(size=(dim, classes)), jnp.float32), "b": jnp.zeros(4)}
    logits_fn = lambda p: jnp.asarray(x, jnp.float32) @ p["w"] + p["b"][None, :]

    def loss_from_logits(logits, labels):
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
        return -jnp.mean(picked)

    return x, params, logits_fn, loss_from_logits


def numpy_gnb(x, params, labels):
    """B·ĝ⊙ĝ for mean cross-entropy of softmax(x W + b) at sampled labels, per sample."""
    w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
    logits = x @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    n = x.shape[0]
    out = []
    for y in labels:
        r = p - np.eye(p.shape[1])[y]
        g_w, g_b = x.T @ r / n, r.mean(0)
        out.append(np.concatenate([(n * g_w * g_w).ravel(), n * g_b * g_b]))
    return np.array(out), p


def gnb_flat(tree):
    return np.concatenate([np.asarray(tree["w"]).ravel(), np.asarray(tree["b"])])


def test_gnb_matches_numpy_softmax_regression():
    x, params, logits_fn, loss_from_logits = softmax_regression()
    key = jax.random.key(8)
    logits = logits_fn(params)
    for num_probes in (1, 2):
        keys = [key] if num_probes == 1 else list(jax.random.split(key, num_probes))
        labels = [np.asarray(jax.random.categorical(k, logits)) for k in keys]
        want = numpy_gnb(x, params, labels)[0].mean(0)
        got = gnb_diagonal(logits_fn, loss_from_logits, params, key, num_probes)
        np.testing.assert_allclose(gnb_flat(got), want, rtol=1e-5, atol=1e-7)

    # Through the transform: one refresh puts (1 − b2)·ĥ into the EMA.
    tx = scale_by_sophia(0.9, 0.75, estimator="gnb", update_interval=1)
    state = tx.init(params)
    _, state = tx.update(
        jax.tree.map(jnp.zeros_like, params),
        state,
        params,
        logits_fn=logits_fn,
        loss_from_logits=loss_from_logits,
        hessian_key=key,
    )
    labels = [np.asarray(jax.random.categorical(key, logits))]
    np.testing.assert_allclose(
        gnb_flat(state.nu), 0.25 * numpy_gnb(x, params, labels)[0][0], rtol=1e-5, atol=1e-8
    )


def test_gnb_is_unbiased_for_the_gauss_newton_diagonal():
    # Identity: E_ŷ[B·ĝ⊙ĝ] = diag(Σ_i J_iᵀ (diag p_i − p_i p_iᵀ) J_i) / B, the Gauss–Newton
    # diagonal of the mean cross-entropy. The Monte Carlo mean of 2000 samples must match the
    # NumPy samples exactly and the identity within 5 standard errors.
    x, params, logits_fn, loss_from_logits = softmax_regression()
    key, num = jax.random.key(9), 2000
    got = gnb_flat(gnb_diagonal(logits_fn, loss_from_logits, params, key, num))
    labels = np.asarray(
        jax.vmap(lambda k: jax.random.categorical(k, logits_fn(params)))(jax.random.split(key, num))
    )
    samples, p = numpy_gnb(x, params, labels)
    np.testing.assert_allclose(got, samples.mean(0), rtol=1e-4, atol=1e-7)
    n = x.shape[0]
    curv = p * (1 - p)  # diagonal of diag(p) − ppᵀ; off-diagonal terms do not reach diag(GN)
    gn_w = np.einsum("id,ic->dc", x * x, curv) / n
    gn_b = curv.mean(0)
    exact = np.concatenate([gn_w.ravel(), gn_b])
    stderr = samples.std(0) / np.sqrt(num)
    assert np.all(np.abs(samples.mean(0) - exact) < 5 * stderr + 1e-9), (samples.mean(0), exact)


# --------------------------------------------------------------------------------------
# Clipping and schedule


@pytest.mark.parametrize("mode", ["paper", "optax"])
def test_elementwise_clip(mode):
    rho, eps = 0.5, 1e-3
    g = np.array([0.1, -0.1, 2.0, -2.0, 0.0, 1e-4, -1e-2, 0.3])
    h = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, -5.0])
    tx = scale_by_sophia(0.0, 0.9, rho=rho, eps=eps, update_interval=1000, clip_mode=mode)
    params = jnp.zeros(8)
    state = tx.init(params)._replace(nu=jnp.asarray(h, jnp.float32))
    direction, _ = tx.update(jnp.asarray(g, jnp.float32), state, params, obj_fn=jnp.sum)
    if mode == "paper":  # FedPAC (Liu et al.) Alg. 8 lines 17–18
        want = np.clip(g / np.maximum(h, eps), -rho, rho)
    else:  # b1 = 0 makes the bias-corrected m̂ equal g
        want = np.clip(g / np.maximum(rho * h, eps), -1, 1)
    np.testing.assert_allclose(np.asarray(direction), want, rtol=1e-6)
    assert np.any(np.abs(want) == (rho if mode == "paper" else 1.0))


class HvpLog:
    """An obj_fn whose every evaluation (one per HVP) records the step it was called at."""

    def __init__(self, f):
        self.steps, self.f = [], f

    def obj_fn(self, step):
        def fn(params):
            jax.debug.callback(lambda s: self.steps.append(int(s)), step)
            return self.f(params)

        return fn


@pytest.mark.parametrize("mode, expected", [("paper", [3, 6, 9]), ("optax", [1, 4, 7, 10])])
def test_update_interval_schedule(mode, expected):
    # "paper": refresh at 1-indexed steps k ≡ 0 (mod f_h) (Alg. 8 line 9); "optax": at the
    # first step and every f_h after it (optax.contrib: count ≡ 0 before the increment).
    f = quadratic(dense_hessian(10), np.zeros(SIZE))
    log = HvpLog(f)
    tx = scale_by_sophia(0.9, 0.9, update_interval=3, clip_mode=mode)

    @fast_jit
    def step(params, state, k):
        return tx.update(jax.grad(f)(params), state, params, obj_fn=log.obj_fn(k))[1]

    params = unflatten(jnp.linspace(-1.0, 1.0, SIZE))
    state = tx.init(params)
    nus = []
    for k in range(1, 11):
        state = step(params, state, k)
        jax.block_until_ready(state)
        nus.append(np_flatten(state.nu))
    jax.effects_barrier()
    assert log.steps == expected
    for k in range(2, 11):  # h only changes at refresh steps
        changed = not np.array_equal(nus[k - 1], nus[k - 2])
        assert changed == (k in expected), k


def test_hvp_count_under_vmap_with_shared_count():
    # The acceptance: K steps over C clients cost K/interval HVP executions when the
    # counter is shared (in_axes=None), because the refresh stays a real lax.cond branch. With a
    # batched counter vmap turns cond into select and runs the HVP on every step.
    clients, steps, interval = 3, 12, 4
    rng = np.random.default_rng(12)
    centers = jnp.asarray(rng.normal(size=(clients, SIZE)), jnp.float32)
    a = jnp.asarray(dense_hessian(12), jnp.float32)
    loss = lambda p, c: 0.5 * (flatten(p) - c) @ (a @ (flatten(p) - c))
    calls = []

    def counted(p, c):
        jax.debug.callback(lambda: calls.append(1))
        return loss(p, c)

    tx = sophia(0.1, update_interval=interval)

    def client_step(params, state, center, key):
        grads = jax.grad(loss)(params, center)
        updates, state = tx.update(
            grads, state, params, obj_fn=lambda p: counted(p, center), hessian_key=key
        )
        return optax.apply_updates(params, updates), state

    params_c = jax.vmap(unflatten)(jnp.zeros((clients, SIZE)))
    axes = shared_counter_axes(tx.init(unflatten(jnp.zeros(SIZE))))
    keys = jax.random.split(jax.random.key(0), (steps, clients))

    def run(in_axes):
        calls.clear()
        state = jax.vmap(tx.init, out_axes=in_axes)(params_c)
        fn = fast_jit(jax.vmap(client_step, in_axes=(0, in_axes, 0, 0), out_axes=(0, in_axes)))
        params = params_c
        for k in range(steps):
            params, state = fn(params, state, centers, keys[k])
        jax.block_until_ready(params)
        jax.effects_barrier()
        return len(calls), params, state

    shared_calls, shared_params, shared_state = run(axes)
    assert shared_calls == steps // interval
    assert jnp.ndim(shared_state[0].count) == 0 and int(shared_state[0].count) == steps
    batched_calls, batched_params, _ = run(0)
    assert batched_calls == steps  # both branches run: one HVP per step
    # Same numbers either way: the convention changes the cost, not the result.
    for name in SHAPES:
        np.testing.assert_allclose(shared_params[name], batched_params[name], rtol=1e-6)


def test_clients_draw_different_probes_only_with_their_own_key():
    # Same params and objective on every client: with a per-client key the Hutchinson
    # estimates differ (the Hessian is dense, so probes matter); without it they coincide.
    f = quadratic(dense_hessian(13), np.zeros(SIZE))
    tx = scale_by_sophia(update_interval=1)
    params_c = jax.vmap(unflatten)(jnp.tile(jnp.linspace(-1.0, 1.0, SIZE), (4, 1)))
    axes = shared_counter_axes(tx.init(unflatten(jnp.zeros(SIZE))))
    state_c = jax.vmap(tx.init, out_axes=axes)(params_c)
    grads_c = jax.vmap(jax.grad(f))(params_c)

    def nu_rows(extra_fn):
        update = fast_jit(
            jax.vmap(
                lambda g, s, p, k: tx.update(g, s, p, obj_fn=f, **extra_fn(k)),
                in_axes=(0, axes, 0, 0),
                out_axes=(0, axes),
            )
        )
        keys = jax.random.split(jax.random.key(1), 4)
        return np.asarray(jax.vmap(flatten)(update(grads_c, state_c, params_c, keys)[1].nu))

    per_client = nu_rows(lambda k: {"hessian_key": k})
    shared = nu_rows(lambda k: {})
    assert all(not np.allclose(per_client[0], per_client[c]) for c in range(1, 4))
    assert all(np.array_equal(shared[0], shared[c]) for c in range(1, 4))
    # The engine's generic per-client optimizer `key` serves when no hessian_key is given, and
    # hessian_key takes precedence over it.
    np.testing.assert_array_equal(nu_rows(lambda k: {"key": k}), per_client)
    np.testing.assert_array_equal(
        nu_rows(lambda k: {"hessian_key": k, "key": jax.random.key(99)}), per_client
    )


# --------------------------------------------------------------------------------------
# The shared battery (tests/optim_battery.py) and convergence


def battery_inputs(seed=14, clients=3, steps=5):
    rng = np.random.default_rng(seed)
    draw = lambda *lead: {
        k: jnp.asarray(rng.normal(size=(*lead, *s)), jnp.float32) for k, s in SHAPES.items()
    }
    return (
        draw(),
        [draw() for _ in range(steps)],
        draw(clients),
        [draw(clients) for _ in range(steps)],
    )


def coupled_loss(params):
    """A non-quadratic loss with a dense Hessian (so Hutchinson probes matter)."""
    x = flatten(params)
    return jnp.sum(jnp.cos(x[:-1] * x[1:])) + 0.25 * jnp.sum(x**4)


@pytest.mark.parametrize(
    "tx",
    [
        sophia(0.1, update_interval=2, weight_decay=0.01),
        scale_by_sophia(update_interval=2, clip_mode="optax", eps=1e-3),
    ],
    ids=["sophia-paper", "scale_by_sophia-optax"],
)
def test_battery_hutchinson(tx):
    """jit == eager, shapes/dtypes kept, traced once, vmap == loop (batched and shared counter),
    chain(clip_by_global_norm, sophia) == sophia on clipped gradients; 4 steps, 2 refreshes.
    (The eager half re-traces the refresh cond on every call, hence few steps.)"""
    params, grads, params_c, grads_c = battery_inputs(steps=4)
    battery.run_battery(
        tx,
        params,
        grads,
        params_c,
        grads_c,
        extra_args_fn=lambda loss_fn: {"obj_fn": loss_fn},
        loss_fn=coupled_loss,
    )


def test_battery_gnb():
    """The GNB path (label sampling, lax.map over 2 samples) under jit, without retracing, and
    under vmap with a shared counter; the rest of the battery is estimator-independent."""
    _, params, logits_fn, loss_from_logits = softmax_regression()
    rng = np.random.default_rng(15)
    draw = lambda *lead: {
        k: jnp.asarray(rng.normal(size=(*lead, *v.shape)), jnp.float32) for k, v in params.items()
    }
    grads, params_c, grads_c = [draw() for _ in range(3)], draw(3), [draw(3) for _ in range(3)]
    tx = sophia(0.1, estimator="gnb", update_interval=2, num_probes=2)
    extra = {"logits_fn": logits_fn, "loss_from_logits": loss_from_logits}
    kw = dict(extra_args_fn=lambda _: extra)
    battery.check_jit(tx, params, grads, **kw)
    battery.check_no_recompile(tx, params, grads, **kw)
    battery.check_vmap_matches_loop(tx, params_c, grads_c, shared_counters=True, **kw)


@pytest.mark.parametrize("mode, lr", [("paper", 1.0), ("optax", 0.1)])
def test_converges_on_quadratic_and_rosenbrock(mode, lr):
    """Sophia-H reaches the minimum of ½‖W − W*‖² (a matrix and a vector) and of the row-wise
    Rosenbrock on a (2, 3) matrix from W = −0.5 (minimum 0 at W = 1; its Hessian is dense and
    indefinite on the way, so the probes and the clamp/clip all matter)."""
    extra = lambda loss_fn: {"obj_fn": loss_fn}
    loss_fn, params, _ = battery.matrix_quadratic(jax.random.key(0), {"w": (4, 3), "b": (3,)})
    tx = sophia(lr, 0.9, 0.99, rho=0.1, weight_decay=0.0, update_interval=2, clip_mode=mode)
    battery.check_converges(tx, loss_fn, params, steps=200, threshold=1e-6, extra_args_fn=extra)
    loss_fn, params = battery.matrix_rosenbrock((2, 3))
    tx = sophia(lr * 0.5, 0.9, 0.99, rho=0.05, weight_decay=0.0, update_interval=5, clip_mode=mode)
    battery.check_converges(tx, loss_fn, params, steps=3000, threshold=1e-6, extra_args_fn=extra)


def test_mu_dtype_and_low_precision_params():
    # bfloat16 momentum is stored as bfloat16; bfloat16 params/grads give bfloat16 updates; the
    # state keeps its dtypes across steps (a lax.scan carry needs that).
    params = {"w": jnp.ones((3, 4), jnp.bfloat16), "b": jnp.zeros(4, jnp.bfloat16)}
    f = lambda p: (
        jnp.sum(jnp.square(p["w"].astype(jnp.float32)))
        + jnp.sum(jnp.square(p["b"].astype(jnp.float32) - 1))
    )
    tx = sophia(0.1, update_interval=1, mu_dtype=jnp.bfloat16)
    state = tx.init(params)
    step = fast_jit(lambda g, s, p: tx.update(g, s, p, obj_fn=f))
    for _ in range(3):
        updates, new_state = step(jax.grad(f)(params), state, params)
        assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(lambda x: x.dtype, params)
        assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)
        state, params = new_state, optax.apply_updates(params, updates)
    assert state[0].mu["w"].dtype == jnp.bfloat16
    assert isinstance(state[0], SophiaState)
    # h of ½·2‖w‖²: ĥ = 2 exactly (diagonal), EMA over 3 refreshes: 2·(1 − 0.99³).
    np.testing.assert_allclose(
        np.asarray(state[0].nu["w"], np.float64), 2 * (1 - 0.99**3), rtol=1e-2
    )


# --------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"update_interval": 0}, "update_interval=0"),
        ({"update_interval": -3}, "update_interval=-3"),
        ({"update_interval": 2.5}, "update_interval=2.5"),
        ({"update_interval": True}, "update_interval=True"),
        ({"rho": 0.0}, "rho=0.0"),
        ({"rho": -0.1}, "rho=-0.1"),
        ({"estimator": "fisher"}, r"estimator='fisher'.*\('hutchinson', 'gnb'\)"),
        ({"clip_mode": "sophia_g"}, r"clip_mode='sophia_g'.*\('paper', 'optax'\)"),
        ({"num_probes": 0}, "num_probes=0"),
        ({"probes": "gaussian"}, r"probes='gaussian'.*\('packed', 'optax'\)"),
        ({"b2": 1.0}, "b2=1.0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scale_by_sophia(**kwargs)
    with pytest.raises(ValueError, match=match):
        sophia(0.1, **kwargs)


def test_missing_extra_arguments_are_named():
    params = {"w": jnp.ones(3)}
    g = {"w": jnp.ones(3)}
    tx = sophia(0.1)
    with pytest.raises(ValueError, match=r"estimator='hutchinson'.*\['obj_fn'\].*obj_fn="):
        tx.update(g, tx.init(params), params)
    tx = scale_by_sophia(estimator="gnb")
    with pytest.raises(ValueError, match=r"estimator='gnb'.*\['loss_from_logits'\]"):
        tx.update(g, tx.init(params), params, logits_fn=lambda p: p["w"][None, :])
    with pytest.raises(ValueError, match="needs params"):
        tx.update(g, tx.init(params), logits_fn=jnp.sum, loss_from_logits=jnp.sum)


def test_inject_hyperparams():
    """`optax.inject_hyperparams(sophia)` equals `sophia` and its learning rate scales updates;
    `update_interval`, `num_probes` and `seed` fix the program, so they stay static."""
    params, grads, _, _ = battery_inputs(steps=3)
    battery.check_inject_hyperparams(
        sophia,
        dict(learning_rate=0.1, rho=0.05, update_interval=2, weight_decay=0.01),
        params,
        grads,
        static_args=("update_interval", "num_probes", "seed"),
        extra_args_fn=lambda loss_fn: {"obj_fn": loss_fn},
        loss_fn=coupled_loss,
    )


def test_fedpac_preset_sophia_is_the_box_with_rho_one():
    """The Sophia of FedPAC (Liu et al.)'s presets (Local Sophia, FedPAC_Sophia, Fed-Sophia:
    ``configs.presets.FEDPAC_OPTIM["sophia"]``) built as the engine builds it (``fed.local``)
    follows Alg. 8's box with rho = 1 step for step: float64 NumPy ``numpy_sophia`` (mode
    "paper") at lr 3e-4, betas (0.9, 0.99), eps 1e-12, f_h 10, weight decay 0.01, 25 steps (two
    Hessian refreshes). Half the coordinates start 1e-3 from their minimum, so after the
    refreshes some entries of m / max(h, eps) lie inside (-1, 1) and others are clipped: the
    clip level is 1 (the steps reach lr, 25x the 1.2e-5 of rho = 0.04)."""
    from configs.presets import FEDPAC_OPTIM
    from fedorth.fed import local

    optim = FEDPAC_OPTIM["sophia"]
    assert optim["rho"] == 1.0 and optim["clip_mode"] == "paper"
    name, wd, hp = local.split_optim(optim)
    lr = optim["learning_rate"]
    rng = np.random.default_rng(4)
    diag = rng.uniform(0.5, 3.0, SIZE)
    center = rng.normal(size=SIZE)
    x0 = center + np.where(np.arange(SIZE) % 2 == 0, 1e-3, 1.0) * rng.choice([-1, 1], SIZE)
    hyper = dict(lr=lr, b1=hp["b1"], b2=hp["b2"], rho=hp["rho"], eps=hp["eps"], wd=wd)
    xs_ref, d_ref = numpy_sophia(
        x0,
        lambda x: diag * (x - center),
        lambda x: diag,
        steps=25,
        interval=hp["update_interval"],
        mode="paper",
        **hyper,
    )
    assert np.any(np.abs(d_ref[10:]) == 1.0) and np.any(np.abs(d_ref[10:]) < 0.5)
    with jax.enable_x64(True):
        f = lambda p: 0.5 * jnp.sum(jnp.asarray(diag) * (flatten(p) - jnp.asarray(center)) ** 2)
        tx = local.local_tx(local.direction(name, **hp), weight_decay=wd)

        @fast_jit
        def step(params, state):
            updates, state = tx.update(
                jax.grad(f)(params), state, params, obj_fn=f, learning_rate=lr
            )
            return optax.apply_updates(params, updates), state

        params = unflatten(jnp.asarray(x0, jnp.float64))
        state = tx.init(params)
        for k in range(25):
            params, state = step(params, state)
            np.testing.assert_allclose(np_flatten(params), xs_ref[k], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "preset", ["cifar100_resnet18", "tiny_imagenet_vit_dir0.05", "c4_llama60m"]
)
def test_sophia_methods_of_fedpac_tables_share_one_sophia(preset):
    """Local Sophia, FedPAC_Sophia, FedPAC_Sophia_light and Fed-Sophia (vision only) run the same
    Sophia in each FedPAC (Liu et al.) setting: Table 8's lr/betas/decay and the box with rho = 1
    (``FEDPAC_OPTIM["sophia"]``), schedule aside."""
    import importlib

    from configs.presets import FEDPAC_OPTIM

    names = ["local_sophia", "fedpac_sophia", "fedpac_sophia_light"]
    if not preset.startswith("c4_"):
        names.append("fed_sophia")
    for name in names:
        optim = dict(importlib.import_module(f"configs.{name}").get_config(preset).optim)
        optim.pop("schedule", None)
        assert optim.pop("ns_dtype", "auto") == "auto"  # base config's key, unused by Sophia
        assert optim == FEDPAC_OPTIM["sophia"], (name, optim)
