"""Muon and the LMO family: float64 NumPy references, optax.contrib agreement, the battery."""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from helpers import equations, fast_jit
from optim_battery import (
    check_converges,
    check_inject_hyperparams,
    matrix_quadratic,
    matrix_rosenbrock,
    run_battery,
)
from test_newton_schulz import conditioned, np_newton_schulz, polar

from fedorth.optim import (
    default_muon_mask,
    is_muon_matrix,
    lmo,
    muon,
    ns_coefficients,
    orthogonalize_tree,
    scale_by_lmo,
    scale_by_muon,
)
from fedorth.optim.muon import shape_scale

SHAPES = {"wide": (8, 24), "tall": (24, 8), "conv": (3, 3, 4, 8)}


def np_orthogonalize(d, steps, coeffs, eps):
    """Float64 NS on the Flax matrix view (prod(shape[:-1]), shape[-1])."""
    matrix = np.asarray(d, np.float64).reshape(-1, d.shape[-1])
    return np_newton_schulz(matrix, ns_coefficients(coeffs, steps), eps)[-1].reshape(d.shape)


def np_scale(shape, scaling):
    fan_in, fan_out = math.prod(shape[:-1]), shape[-1]
    if scaling == "jordan":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if scaling == "moonlight":
        return 0.2 * math.sqrt(max(fan_in, fan_out))
    if scaling == "sqrt_ratio":
        return math.sqrt(fan_out / fan_in)
    if scaling == "none":
        return 1.0
    return scaling(fan_in, fan_out)


def np_muon(
    grads_seq, *, beta, nesterov, ema, steps=5, coeffs="jordan", eps=1e-7, scaling="jordan"
):
    """Float64 Muon: M ← βM + w·g (w = 1, or 1−β with ema), D = w·g + βM or M, γ·NS(D)."""
    w = (1 - beta) if ema else 1.0
    mu = {k: np.zeros(v.shape) for k, v in grads_seq[0].items()}
    out = []
    for grads in grads_seq:
        step = {}
        for k, g in grads.items():
            g = np.asarray(g, np.float64)
            mu[k] = beta * mu[k] + w * g
            d = w * g + beta * mu[k] if nesterov else mu[k]
            step[k] = np_scale(g.shape, scaling) * np_orthogonalize(d, steps, coeffs, eps)
        out.append(step)
    return out


def random_tree(seed, shapes, num=1):
    """`num` pytrees of standard normal leaves with the given shapes (float32), drawn by NumPy
    (jax.random would compile a program per shape)."""
    rng = np.random.default_rng(seed)
    return [
        {
            name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
            for name, shape in shapes.items()
        }
        for _ in range(num)
    ]


def assert_rel_close(actual, expected, tol, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    err = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
    assert err < tol, f"{what}: relative Frobenius error {err:.2e} >= {tol}"


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ema", [False, True])
def test_scale_by_muon_matches_float64_numpy(nesterov, ema):
    grads_seq = random_tree(0, SHAPES, num=4)
    tx = scale_by_muon(0.9, nesterov=nesterov, ema=ema)
    ref = np_muon(grads_seq, beta=0.9, nesterov=nesterov, ema=ema)
    state, update = tx.init(grads_seq[0]), fast_jit(tx.update)
    for t, grads in enumerate(grads_seq):
        updates, state = update(grads, state)
        for k in SHAPES:
            assert updates[k].shape == SHAPES[k] and updates[k].dtype == jnp.float32
            # float32 vs float64 through five NS steps: round-off level.
            assert_rel_close(updates[k], ref[t][k], 2e-5, f"step {t} leaf {k}")


# Groups of matrix views: two (8, 24) leaves; the (24, 8) leaf alone; the (3, 3, 8, 8) conv and
# the (72, 8) matrix share the (72, 8) view.
GROUP_SHAPES = {"a": (8, 24), "b": (8, 24), "tall": (24, 8), "c": (3, 3, 8, 8), "d": (72, 8)}


def test_grouped_newton_schulz_equals_float64_numpy_per_leaf():
    """group_shapes=True stacks equal matrix views but normalizes each matrix by its own norm:
    every leaf equals its own float64 NumPy iteration, and the per-leaf path to round-off."""
    tree = random_tree(7, GROUP_SHAPES, num=1)[0]
    tree["d"] = 100.0 * tree["d"]  # a different norm inside a group
    grouped = fast_jit(lambda t: orthogonalize_tree(t, group_shapes=True))(tree)
    single = fast_jit(lambda t: orthogonalize_tree(t, group_shapes=False))(tree)
    for k in GROUP_SHAPES:
        assert grouped[k].shape == GROUP_SHAPES[k]
        assert_rel_close(grouped[k], np_orthogonalize(tree[k], 5, "jordan", 1e-7), 2e-5, k)
        assert_rel_close(grouped[k], single[k], 1e-6, f"{k}: grouped vs per-leaf")
    # Fewer, batched products: 3 groups instead of 5 leaves, 3 products per quintic step.
    count = lambda group: str(
        jax.make_jaxpr(lambda t: orthogonalize_tree(t, group_shapes=group))(tree)
    ).count("dot_general")
    assert (count(False), count(True)) == (5 * 5 * 3, 3 * 5 * 3)
    # Under vmap over clients (the engine's layout), each client's group is its own batch.
    clients = jax.tree.map(lambda x: jnp.asarray(np.stack([x, -2.0 * np.asarray(x)])), tree)
    batched = fast_jit(jax.vmap(lambda t: orthogonalize_tree(t, group_shapes=True)))(clients)
    for k in GROUP_SHAPES:
        assert_rel_close(batched[k][1], -np_orthogonalize(tree[k], 5, "jordan", 1e-7), 2e-5, k)


def test_scale_by_muon_group_shapes_matches_float64_numpy():
    """scale_by_muon(group_shapes=True) is Muon step for step: float64 NumPy Muon per leaf,
    at the per-leaf transform's tolerance (test_scale_by_muon_matches_float64_numpy); the
    grouped and per-leaf iterations agree to 1e-6 in
    test_grouped_newton_schulz_equals_float64_numpy_per_leaf."""
    grads_seq = random_tree(8, GROUP_SHAPES, num=3)
    tx = scale_by_muon(0.9, group_shapes=True)
    ref = np_muon(grads_seq, beta=0.9, nesterov=True, ema=False)
    state, update = tx.init(grads_seq[0]), fast_jit(tx.update)
    for t, grads in enumerate(grads_seq):
        updates, state = update(grads, state)
        for k in GROUP_SHAPES:
            assert updates[k].shape == GROUP_SHAPES[k]
            assert_rel_close(updates[k], ref[t][k], 2e-5, f"step {t} leaf {k}")


@pytest.mark.parametrize(
    "scaling",
    ["jordan", "moonlight", "none", "sqrt_ratio", lambda fan_in, fan_out: fan_in / fan_out],
)
def test_shape_scaling_and_conv_view(scaling):
    # Conv (3, 3, 4, 8) is orthogonalized as the (36, 8) matrix with fan_in 36, fan_out 8;
    # "jordan" floors at 1 (wide 8→24 gets sqrt(3), tall and conv get 1).
    grads_seq = random_tree(1, SHAPES, num=2)
    tx = scale_by_muon(0.95, shape_scaling=scaling, ns_coeffs="polar_express", ns_steps=6)
    ref = np_muon(
        grads_seq,
        beta=0.95,
        nesterov=True,
        ema=False,
        scaling=scaling,
        coeffs="polar_express",
        steps=6,
    )
    state, update = tx.init(grads_seq[0]), fast_jit(tx.update)
    for t, grads in enumerate(grads_seq):
        updates, state = update(grads, state)
        for k in SHAPES:
            assert_rel_close(updates[k], ref[t][k], 5e-5, f"{scaling} step {t} leaf {k}")
    if scaling == "jordan":
        assert np_scale((8, 24), "jordan") == math.sqrt(3.0)
        assert np_scale((3, 3, 4, 8), "jordan") == 1.0
    if scaling == "sqrt_ratio":  # not floored: a narrowing kernel gets less than 1
        assert np_scale((24, 8), "sqrt_ratio") == math.sqrt(1 / 3)


def test_jordan_conv_factor_differs_from_jordans_code_only_when_out_exceeds_fan_in():
    # KellerJordan/Muon muon_update: `max(1, grad.size(-2) / grad.size(-1))**0.5` on the
    # PyTorch gradient, (out, in) for dense, (out, in, kh, kw) for conv: kh/kw for conv.
    # Ours reads the (kh·kw·in, out) view. Golden values: a 3×3 RGB stem with 32 outputs is
    # sqrt(32/27) = 1.0887 here and 1 in Jordan's code; with 64 outputs sqrt(64/27) = 1.5396.
    # If this changes, update shape_scale's docstring, which states the difference.
    def jordans(torch_shape):
        return max(1.0, torch_shape[-2] / torch_shape[-1]) ** 0.5

    assert shape_scale((16, 48), "jordan") == jordans((48, 16)) == math.sqrt(3.0)  # dense
    assert round(shape_scale((3, 3, 3, 32), "jordan"), 4) == 1.0887
    assert round(shape_scale((3, 3, 3, 64), "jordan"), 4) == 1.5396
    assert jordans((32, 3, 3, 3)) == jordans((64, 3, 3, 3)) == 1.0
    # ResNet-18's 1×1 shortcut convs double the width: sqrt(2) here, 1 in Jordan's code.
    assert shape_scale((1, 1, 64, 128), "jordan") == math.sqrt(2.0)
    assert jordans((128, 64, 1, 1)) == 1.0
    # out ≤ kh·kw·in (its 3×3 convs after the stem): both give 1.
    for kh, kw, cin, cout in [(3, 3, 64, 128), (3, 3, 128, 128), (3, 3, 256, 512)]:
        assert shape_scale((kh, kw, cin, cout), "jordan") == jordans((cout, cin, kh, kw)) == 1.0


@pytest.mark.parametrize("default_precision", [None, "tensorfloat32"])
def test_agrees_with_optax_contrib_scale_by_muon(default_precision):
    # optax.contrib.scale_by_muon keeps the EMA m_t = βm + (1−β)g and orthogonalizes its bias
    # correction m_t/(1−β^t); ours (Jordan's) keeps M_t = βM + g = m_t/(1−β). Without Nesterov
    # both orthogonalize positive multiples of the same matrix, and NS(cX) = NS(X) up to the eps
    # in ‖cX‖_F + eps (1e-8 here, against norms of order 1: far below float32 round-off).
    # optax's scale_by_muon applies no width scaling (that is its separate scale_by_shape), so
    # ours runs with shape_scaling="none"; and optax's `muon` chains scale_by_shape (Jordan's
    # sqrt(max(1, fan_out/fan_in))), which equals our default. With Nesterov the two differ by
    # design: optax bias-corrects M and g with different powers of β (1−β^{t+1} vs 1−β^t), so
    # its direction is not a multiple of g + βM.
    # Both sides pinned to float32 products (ours: ns_dtype="float32", HIGHEST; optax's under
    # jax.default_matmul_precision("float32")), also under a "tensorfloat32" default, the CPU
    # proxy of a GPU's TF32 default (see test_newton_schulz.test_precision_is_pinned_...).
    outer = jax.default_matmul_precision(default_precision)
    with outer if default_precision else contextlib.nullcontext():
        _compare_with_optax_contrib_muon()


def _compare_with_optax_contrib_muon():
    shapes = {"wide": (8, 24), "tall": (24, 8)}
    grads_seq = random_tree(2, shapes, num=5)
    ours = scale_by_muon(0.95, nesterov=False, eps=1e-8, shape_scaling="none", ns_dtype="float32")
    theirs = optax.contrib.scale_by_muon(
        beta=0.95,
        nesterov=False,
        eps=1e-8,
        weight_dimension_numbers={k: optax.contrib.MuonDimensionNumbers(0, 1) for k in shapes},
    )
    s_ours, s_theirs = ours.init(grads_seq[0]), theirs.init(grads_seq[0])
    update_ours, update_theirs = fast_jit(ours.update), fast_jit(theirs.update)
    for t, g in enumerate(grads_seq):
        u_ours, s_ours = update_ours(g, s_ours)
        with jax.default_matmul_precision("float32"):
            u_theirs, s_theirs = update_theirs(g, s_theirs)
        for k in shapes:
            assert_rel_close(u_ours[k], u_theirs[k], 1e-5, f"scale_by_muon step {t} {k}")

    # Full optimizers: matrices through Muon + width scaling + lr, the bias through AdamW(lr)
    # with no weight decay in both (optax's adam_weight_decay=0 default, our fallback default).
    params = {"w": jnp.ones((8, 24)), "v": jnp.ones((24, 8)), "b": jnp.ones((8,))}
    grads_seq = random_tree(3, {k: v.shape for k, v in params.items()}, num=4)
    ours = muon(0.1, nesterov=False, eps=1e-8, ns_dtype="float32")
    theirs = optax.contrib.muon(0.1, nesterov=False, eps=1e-8)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    update_ours, update_theirs = fast_jit(ours.update), fast_jit(theirs.update)
    for t, g in enumerate(grads_seq):
        u_ours, s_ours = update_ours(g, s_ours, params)
        with jax.default_matmul_precision("float32"):
            u_theirs, s_theirs = update_theirs(g, s_theirs, params)
        for k in params:
            assert_rel_close(u_ours[k], u_theirs[k], 1e-5, f"muon step {t} {k}")


def test_muon_matrix_leaves_weight_decay_and_default_adamw_fallback():
    # Matrix leaves: u = −η(γ·NS(D) + λW) (FedPAC (Liu et al.) Alg. 6 line 13); the bias and
    # the scalar go to AdamW(η, weight_decay=0), compared with optax.adamw on those leaves alone.
    shapes = {"dense": (16, 8), "conv": (3, 3, 2, 4), "bias": (8,), "scale": ()}
    params = random_tree(4, shapes)[0]
    grads_seq = random_tree(5, shapes, num=3)
    lr, wd = 0.05, 0.1
    tx = muon(lr, weight_decay=wd, beta=0.9)
    ref = np_muon(
        [{k: g[k] for k in ("dense", "conv")} for g in grads_seq],
        beta=0.9,
        nesterov=True,
        ema=False,
    )
    adam = optax.adamw(lr, weight_decay=0.0)
    vec = lambda tree: {k: tree[k] for k in ("bias", "scale")}
    state, adam_state = tx.init(params), adam.init(vec(params))
    update, adam_update = fast_jit(tx.update), fast_jit(adam.update)
    for t, grads in enumerate(grads_seq):
        updates, state = update(grads, state, params)
        for k in ("dense", "conv"):
            expected = -lr * (ref[t][k] + wd * np.asarray(params[k], np.float64))
            assert_rel_close(updates[k], expected, 2e-5, f"step {t} {k}")
        adam_updates, adam_state = adam_update(vec(grads), adam_state, vec(params))
        for k in ("bias", "scale"):
            np.testing.assert_allclose(updates[k], adam_updates[k], rtol=1e-6, err_msg=k)
        params = optax.apply_updates(params, updates)


def test_muon_mask_and_custom_fallback():
    # A user mask can send a matrix (an embedding) to the fallback; a custom fallback is used
    # as given; the mask may be a callable or a pytree.
    shapes = {"embed": (10, 6), "dense": (6, 12), "bias": (12,)}
    params = random_tree(6, shapes)[0]
    grads = random_tree(7, shapes)[0]
    mask_tree = {"embed": False, "dense": True, "bias": False}
    for mask in (mask_tree, lambda p: {k: k == "dense" for k in p}):
        tx = muon(0.1, fallback=optax.sgd(0.5), muon_mask=mask)
        updates, _ = fast_jit(tx.update)(grads, tx.init(params), params)
        for k in ("embed", "bias"):
            np.testing.assert_allclose(updates[k], -0.5 * grads[k], rtol=1e-6, err_msg=k)
        ref = np_muon([{"dense": grads["dense"]}], beta=0.95, nesterov=True, ema=False)
        assert_rel_close(updates["dense"], -0.1 * ref[0]["dense"], 2e-5, "dense")
    # fallback_learning_rate sets the default AdamW's learning rate: the first Adam step is
    # −lr·g/(|g| + eps) ≈ −lr·sign(g).
    tx = muon(0.1, fallback_learning_rate=0.01)
    updates, _ = fast_jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["bias"], -0.01 * np.sign(grads["bias"]), rtol=1e-5)


def test_muon_errors():
    with pytest.raises(ValueError, match=r"\['bias'\] of shape \(3,\).*fedorth.optim.muon"):
        scale_by_muon().init({"bias": jnp.zeros(3), "w": jnp.zeros((3, 3))})
    with pytest.raises(ValueError, match="leaf .* of shape \\(\\)"):
        scale_by_muon().update({"s": jnp.zeros(())}, None)
    # A mask that selects a vector for Muon reaches the same error.
    tx = muon(0.1, muon_mask=lambda p: jax.tree.map(lambda _: True, p))
    with pytest.raises(ValueError, match="orthogonalizes matrices"):
        tx.init({"bias": jnp.zeros(3)})
    with pytest.raises(ValueError, match="got both fallback and fallback_learning_rate"):
        muon(0.1, fallback=optax.sgd(0.1), fallback_learning_rate=0.1)
    with pytest.raises(ValueError, match=r"shape_scaling='mup'.*jordan.*moonlight.*none"):
        scale_by_muon(shape_scaling="mup")
    with pytest.raises(ValueError, match="Unknown Newton"):
        muon(0.1, ns_coeffs="fast")
    with pytest.raises(ValueError, match="steps must be >= 0"):
        scale_by_muon(ns_steps=-2)
    with pytest.raises(ValueError, match=r"orthogonalizer='qr'.*newton_schulz.*svd"):
        muon(0.1, orthogonalizer="qr")
    with pytest.raises(ValueError, match=r"Newton–Schulz dtype 'float16'.*auto.*bfloat16"):
        scale_by_muon(ns_dtype="float16")


def test_mu_dtype():
    params = {"w": jnp.ones((4, 6), jnp.bfloat16)}
    tx = scale_by_muon(mu_dtype=jnp.float32)
    state = tx.init(params)
    assert state.mu["w"].dtype == jnp.float32
    updates, state = fast_jit(tx.update)({"w": jnp.ones((4, 6), jnp.bfloat16)}, state)
    assert updates["w"].dtype == jnp.bfloat16 and state.mu["w"].dtype == jnp.float32


def _dot_dtypes(fn, *args):
    """The (lhs, rhs, result) dtypes of every dot_general in fn's jaxpr (sub-jaxprs too), and
    the dtypes of fn's outputs."""
    closed = jax.make_jaxpr(fn)(*args)
    found = [
        tuple(str(v.aval.dtype) for v in (*eqn.invars, eqn.outvars[0]))
        for eqn in equations(closed)
        if eqn.primitive.name == "dot_general"
    ]
    return found, {str(aval.dtype) for aval in closed.out_avals}


def test_ns_dtype_reaches_newton_schulz_from_every_entry_point():
    # ns_dtype="bfloat16": every Newton–Schulz product takes bfloat16 operands into a float32
    # result; "float32": float32 throughout. Updates and states stay float32 either way.
    params = {"w": jnp.ones((8, 24)), "conv": jnp.ones((3, 3, 4, 8)), "b": jnp.ones((8,))}
    mats = {k: v for k, v in params.items() if k != "b"}
    makers = {
        "scale_by_muon": (lambda d: scale_by_muon(ns_dtype=d), mats),
        "scale_by_muon_grouped": (lambda d: scale_by_muon(ns_dtype=d, group_shapes=True), mats),
        "muon": (lambda d: muon(0.1, ns_dtype=d), params),
        "scale_by_lmo": (lambda d: scale_by_lmo(ns_dtype=d), params),
        "lmo": (lambda d: lmo(0.1, momentum=0.9, ns_dtype=d), params),
    }
    for name, (make, tree) in makers.items():
        for ns_dtype in ("bfloat16", "float32"):
            tx = make(ns_dtype)
            dots, out_dtypes = _dot_dtypes(lambda g: tx.update(g, tx.init(tree), tree), tree)
            # 2 matrices × 5 quintic steps × 3 products ("jordan" and "classic" are quintic).
            assert len(dots) == 2 * 5 * 3, (name, len(dots))
            assert set(dots) == {(ns_dtype, ns_dtype, "float32")}, (name, ns_dtype, set(dots))
            assert out_dtypes <= {"float32", "int32"}, (name, out_dtypes)
    dots, _ = _dot_dtypes(lambda t: orthogonalize_tree(t, ns_dtype="bfloat16"), mats)
    assert set(dots) == {("bfloat16", "bfloat16", "float32")}


def test_scale_by_muon_bfloat16_matches_float64_numpy_at_bfloat16_tolerance():
    # The same four steps as the float32 test, with bfloat16 NS: measured 1.5e-2 to 2.6e-2
    # from float64 (Jordan's quintic amplifies bfloat16's 2^-9 rounding, see
    # test_newton_schulz); tolerance 5e-2.
    grads_seq = random_tree(21, SHAPES, num=3)
    tx = scale_by_muon(0.9, ns_dtype="bfloat16")
    ref = np_muon(grads_seq, beta=0.9, nesterov=True, ema=False)
    state, update = tx.init(grads_seq[0]), fast_jit(tx.update)
    for t, grads in enumerate(grads_seq):
        updates, state = update(grads, state)
        for k in SHAPES:
            assert updates[k].dtype == jnp.float32
            assert_rel_close(updates[k], ref[t][k], 5e-2, f"bf16 step {t} leaf {k}")


def np_fedmuon_svd(grads_seq, beta):
    """Float64 FedMuon (Liu et al.) Alg. 2 local direction: M = βM + G; UVᵀ = SVD(M)."""
    mu = {k: np.zeros(v.shape) for k, v in grads_seq[0].items()}
    out = []
    for grads in grads_seq:
        step = {}
        for k, g in grads.items():
            mu[k] = beta * mu[k] + np.asarray(g, np.float64)
            m = mu[k].reshape(-1, g.shape[-1])
            step[k] = polar(m).reshape(g.shape)
        out.append(step)
    return out


def test_svd_orthogonalizer_is_fedmuon_alg_2():
    grads_seq = random_tree(22, SHAPES, num=3)
    ref = np_fedmuon_svd(grads_seq, 0.9)
    tx = scale_by_muon(0.9, nesterov=False, orthogonalizer="svd", shape_scaling="none")
    state, update = tx.init(grads_seq[0]), fast_jit(tx.update)
    for t, grads in enumerate(grads_seq):
        updates, state = update(grads, state)
        for k in SHAPES:
            assert updates[k].shape == SHAPES[k] and updates[k].dtype == jnp.float32
            # float32 SVD against float64: round-off (measured ≈ 1e-6).
            assert_rel_close(updates[k], ref[t][k], 1e-5, f"svd step {t} leaf {k}")
            # The exact polar factor has every singular value 1 (full rank here).
            s = np.linalg.svd(np.asarray(updates[k], np.float64).reshape(-1, SHAPES[k][-1]))[1]
            np.testing.assert_allclose(s, 1.0, atol=1e-5, err_msg=k)
    # muon() passes it on: W ← W − η(UVᵀ + λW).
    params = random_tree(23, SHAPES)[0]
    full = muon(0.1, beta=0.9, nesterov=False, orthogonalizer="svd", shape_scaling="none")
    updates, _ = fast_jit(full.update)(grads_seq[0], full.init(params), params)
    for k in SHAPES:
        assert_rel_close(updates[k], -0.1 * ref[0][k], 1e-5, f"muon svd {k}")


def test_default_muon_mask_sends_degenerate_matrices_to_the_fallback():
    # A (1, 1, 192) cls token or a (1, n) row has a 1 × n matrix view: "jordan" would scale it
    # by sqrt(192) = 13.9. It goes to the AdamW fallback with the biases.
    shapes = {
        "cls": (1, 1, 192),
        "row": (1, 16),
        "col": (16, 1),
        "dense": (16, 8),
        "conv": (3, 3, 2, 4),
        "pos": (1, 5, 8),
        "bias": (8,),
    }
    expected = {"cls": False, "row": False, "col": False, "dense": True, "conv": True}
    expected |= {"pos": True, "bias": False}  # pos: the (5, 8) view is a real matrix
    rng = np.random.default_rng(24)  # NumPy: no per-shape compilation of jax.random
    params = {k: jnp.asarray(rng.standard_normal(v), jnp.float32) for k, v in shapes.items()}
    assert {k: is_muon_matrix(v) for k, v in params.items()} == expected
    grads = {k: jnp.asarray(rng.standard_normal(v), jnp.float32) for k, v in shapes.items()}
    lr = 0.05
    tx = muon(lr, beta=0.9, ns_steps=2)  # the mask is under test, not the iteration
    updates, _ = fast_jit(tx.update)(grads, tx.init(params), params)
    fallback = [k for k, use in expected.items() if not use]
    adam = optax.adamw(lr, weight_decay=0.0)
    sub = lambda t: {k: t[k] for k in fallback}
    adam_updates, _ = fast_jit(adam.update)(sub(grads), adam.init(sub(params)), sub(params))
    for k in fallback:
        np.testing.assert_allclose(updates[k], adam_updates[k], rtol=1e-6, err_msg=k)
    ref = np_muon(
        [{k: grads[k] for k in ("dense", "conv", "pos")}],
        beta=0.9,
        nesterov=True,
        ema=False,
        steps=2,
    )
    for k in ("dense", "conv", "pos"):
        assert_rel_close(updates[k], -lr * ref[0][k], 2e-5, k)


def test_default_muon_mask_sends_lookup_tables_to_the_fallback():
    # Tables are read by row, never multiplied by an activation: embeddings, position
    # embeddings and Swin's relative-position bias tables go to the AdamW fallback, as in the
    # Muon reference; the leaf's own name decides, so a conv kernel under a module called
    # "patch_embedding" stays a matrix.
    shapes = {
        "embed": {"embedding": (50, 8)},
        "pos_embedding": (1, 5, 8),
        "attn": {"relative_position_bias_table": (9, 2), "qkv": {"kernel": (8, 24)}},
        "patch_embedding": {"kernel": (2, 2, 3, 8), "bias": (8,)},
    }
    rng = np.random.default_rng(25)
    draw = lambda: jax.tree.map(  # noqa: E731
        lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32),
        shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )
    params, grads = draw(), draw()
    expected = {
        "embed": {"embedding": False},
        "pos_embedding": False,
        "attn": {"relative_position_bias_table": False, "qkv": {"kernel": True}},
        "patch_embedding": {"kernel": True, "bias": False},
    }
    assert default_muon_mask(params) == expected
    from fedorth.fed import local

    labels = jax.tree.map(lambda m: "matrix" if m else "other", expected)
    assert local.matrix_labels(params) == labels, "the engine's labels follow the same mask"
    lr = 0.05
    tx = muon(lr, beta=0.9, ns_steps=2)
    updates, _ = fast_jit(tx.update)(grads, tx.init(params), params)
    adam = optax.adamw(lr, weight_decay=0.0)
    adam_updates, _ = fast_jit(adam.update)(grads, adam.init(params), params)
    # Adam's first step is -lr * sign(g) (up to eps): the tables take it; the kernels do not.
    for path in (
        ("embed", "embedding"),
        ("pos_embedding",),
        ("attn", "relative_position_bias_table"),
    ):
        get = lambda t: functools.reduce(lambda node, k: node[k], path, t)  # noqa: B023, E731
        np.testing.assert_allclose(get(updates), get(adam_updates), rtol=1e-6, err_msg=str(path))
    ref = np_muon(
        [{"qkv": grads["attn"]["qkv"]["kernel"]}], beta=0.9, nesterov=True, ema=False, steps=2
    )
    assert_rel_close(updates["attn"]["qkv"]["kernel"], -lr * ref[0]["qkv"], 2e-5, "qkv")


def test_swin_and_llama_name_their_tables_as_the_mask_expects():
    from fedorth.models import swin
    from fedorth.models.llama import llama

    def mask_of(model, x):
        return default_muon_mask(jax.eval_shape(lambda: model.init(jax.random.key(0), x)[0]))

    tiny_swin = swin.swin_t(
        num_classes=10,
        image_size=16,
        patch_size=2,
        embed_dim=8,
        depths=(2,),
        num_heads=(2,),
        window_size=4,
    )
    flat = jax.tree_util.tree_flatten_with_path(mask_of(tiny_swin, jnp.zeros((1, 16, 16, 3))))[0]
    tables = [m for p, m in flat if jax.tree_util.keystr(p).endswith("bias_table']")]
    assert len(tables) == 2 and not any(tables), "Swin's two blocks' bias tables: fallback"
    assert sum(m for _, m in flat) > 0, "Swin's attention and MLP kernels stay on Muon"
    mask = mask_of(llama(size="tiny"), jnp.zeros((1, 4), jnp.int32))
    assert mask["embed"]["embedding"] is False, "LLaMA's token embedding: fallback"
    assert mask["lm_head"]["kernel"] is True, "the output head is a linear map: Muon"


def test_complex_parameters_are_refused():
    z = {"w": jnp.ones((4, 6), jnp.complex64)}
    for name, tx in {
        "scale_by_muon": scale_by_muon(),
        "muon": muon(0.1),
        "scale_by_lmo": scale_by_lmo(),
        "lmo": lmo(0.1, momentum=0.9),
    }.items():
        who = "scale_by_lmo" if "lmo" in name else "scale_by_muon"
        with pytest.raises(ValueError, match=rf"{who} got the complex leaf \['w'\] \(complex64\)"):
            tx.init(z)
    with pytest.raises(ValueError, match="complex leaf"):
        scale_by_lmo().update(z, optax.EmptyState())
    with pytest.raises(ValueError, match="complex leaf"):
        scale_by_muon().update(z, scale_by_muon().init({"w": jnp.ones((4, 6))}))


# ---------------------------------------------------------------- LMO family (FedMuon-LMO)


def np_lmo_direction(u, norm, steps=5, coeffs="classic", eps=1e-7):
    u = np.asarray(u, np.float64)
    if norm == "sign":
        return np.sign(u)
    if norm == "spectral" and u.ndim >= 2:
        return np_orthogonalize(u, steps, coeffs, eps)
    return u / (np.linalg.norm(u) + eps)


@pytest.mark.parametrize("norm", ["spectral", "frobenius", "sign"])
@pytest.mark.parametrize("steps", [0, 5])
def test_lmo_directions_match_numpy(norm, steps):
    shapes = {"w": (8, 24), "conv": (3, 3, 4, 8), "bias": (8,), "scalar": ()}
    u = random_tree(8, shapes)[0]
    d, _ = scale_by_lmo(norm, ns_steps=steps).update(u, optax.EmptyState())
    for k in shapes:
        assert d[k].shape == shapes[k] and d[k].dtype == jnp.float32
        expected = np_lmo_direction(u[k], norm, steps)
        np.testing.assert_allclose(d[k], expected, rtol=2e-5, atol=1e-6, err_msg=f"{norm} {k}")


def test_lmo_dual_norm_identities_and_descent():
    # ⟨d(u), u⟩ = ‖u‖_* (dual norm): nuclear norm for the spectral LMO (40 classic steps reach
    # the exact polar factor of a well-conditioned u), ‖u‖_F for frobenius, ‖u‖_1 for sign.
    # FedMuon-LMO (bias-corrected LMO) Lemma 1 / Eq. (4): ⟨G, lmo(G)⟩ = −‖G‖_*.
    u = conditioned(np.random.default_rng(9), (12, 20), smin=0.2).astype(np.float32)
    u64 = u.astype(np.float64)
    duals = {
        "spectral": np.linalg.svd(u64, compute_uv=False).sum(),
        "frobenius": np.linalg.norm(u64),
        "sign": np.abs(u64).sum(),
    }
    for norm, dual in duals.items():
        d, _ = scale_by_lmo(norm, ns_steps=40).update({"u": u}, optax.EmptyState())
        inner = float(np.sum(np.asarray(d["u"], np.float64) * u64))
        np.testing.assert_allclose(inner, dual, rtol=1e-5, err_msg=f"<d(u), u> for {norm}")
        # The step with scale_by_learning_rate is −η·d: a descent direction for gradient u.
        tx = optax.chain(scale_by_lmo(norm), optax.scale_by_learning_rate(0.1))
        step, _ = tx.update({"u": u}, tx.init({"u": u}))
        assert float(np.sum(np.asarray(step["u"]) * u)) < 0.0, norm


def test_lmo_wrapper_momentum_matches_fedmuon_lmo_rule():
    # M ← (1−α)M + αg (FedMuon-LMO Eq. 127 / Alg. 1 line 8, α = 1 − momentum), X ← X + η·lmo(M).
    shapes = {"w": (6, 10), "b": (10,)}
    grads_seq = random_tree(10, shapes, num=3)
    params = random_tree(11, shapes)[0]
    alpha, lr = 0.1, 0.05
    tx = lmo(lr, norm="spectral", momentum=1 - alpha, ns_steps=3)
    state, update = tx.init(params), fast_jit(tx.update)
    m = {k: np.zeros(s) for k, s in shapes.items()}
    for t, g in enumerate(grads_seq):
        updates, state = update(g, state, params)
        for k in shapes:
            m[k] = (1 - alpha) * m[k] + alpha * np.asarray(g[k], np.float64)
            expected = -lr * np_lmo_direction(m[k], "spectral", 3)
            np.testing.assert_allclose(
                updates[k], expected, rtol=2e-5, atol=1e-7, err_msg=f"{t} {k}"
            )


def test_lmo_errors():
    with pytest.raises(ValueError, match=r"norm='nuclear'.*spectral.*frobenius.*sign"):
        scale_by_lmo("nuclear")
    with pytest.raises(ValueError, match="Unknown Newton"):
        scale_by_lmo(ns_coeffs="x")
    with pytest.raises(ValueError, match=r"norm='sign' takes shape_scaling='none' only"):
        lmo(0.1, norm="sign", shape_scaling="moonlight")
    with pytest.raises(ValueError, match=r"shape_scaling='mup'.*sqrt_ratio"):
        scale_by_lmo(shape_scaling="mup")


@pytest.mark.parametrize("scaling", ["none", "moonlight", "jordan", "sqrt_ratio"])
def test_lmo_shape_scaling_matches_numpy(scaling):
    # γ·NS(u) on matrix leaves (FedMuon-LMO §7.1 scales FedMuon's step per layer as Moonlight
    # does: "moonlight", the factor LocalMuon gets); vectors and (1, n) views keep γ = 1.
    shapes = {"w": (8, 24), "conv": (3, 3, 4, 8), "row": (1, 12), "bias": (8,)}
    u = random_tree(26, shapes)[0]
    d, _ = scale_by_lmo("spectral", shape_scaling=scaling).update(u, optax.EmptyState())
    for k in shapes:
        gamma = np_scale(shapes[k], scaling) if k in ("w", "conv") else 1.0
        expected = gamma * np_lmo_direction(u[k], "spectral")
        np.testing.assert_allclose(d[k], expected, rtol=2e-5, atol=1e-6, err_msg=f"{scaling} {k}")
    if scaling == "moonlight":  # 0.2·sqrt(max(8, 24)) and 0.2·sqrt(max(36, 8))
        assert np_scale((8, 24), scaling) == 0.2 * math.sqrt(24)
        assert np_scale((3, 3, 4, 8), scaling) == 0.2 * 6.0


# ---------------------------------------------------------------- the shared battery

BATTERY_SHAPES = {"w": (6, 10), "conv": (3, 3, 2, 4), "b": (10,)}
MATRIX_SHAPES = {"w": (6, 10), "conv": (3, 3, 2, 4)}
NUM_CLIENTS = 3

TRANSFORMS = {
    "muon": lambda: muon(0.05, weight_decay=0.01),
    "scale_by_muon": lambda: scale_by_muon(ns_coeffs="polar_express"),
    "lmo_spectral": lambda: lmo(0.05, norm="spectral", momentum=0.9),
    "lmo_frobenius": lambda: scale_by_lmo("frobenius"),
    "lmo_sign": lambda: scale_by_lmo("sign"),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_battery(name):
    tx = TRANSFORMS[name]()
    shapes = MATRIX_SHAPES if name == "scale_by_muon" else BATTERY_SHAPES
    params = random_tree(12, shapes)[0]
    grads_seq = random_tree(13, shapes, num=2)
    stack = lambda trees: jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *trees)
    params_C = stack(random_tree(14, shapes, num=NUM_CLIENTS))
    grads_seq_C = [stack(random_tree(seed, shapes, num=NUM_CLIENTS)) for seed in (15, 115)]
    # vmap/jit change XLA's fusion; float32 round-off through NS stays below these.
    run_battery(tx, params, grads_seq, params_C, grads_seq_C, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "factory,kwargs",
    [
        (muon, dict(learning_rate=0.05, weight_decay=0.01, beta=0.9)),
        (lmo, dict(learning_rate=0.05, norm="frobenius", momentum=0.9)),
    ],
    ids=["muon", "lmo"],
)
def test_inject_hyperparams(factory, kwargs):
    params = random_tree(16, BATTERY_SHAPES)[0]
    grads_seq = random_tree(17, BATTERY_SHAPES, num=2)
    # ns_steps fixes the number of matmuls: it must be static.
    check_inject_hyperparams(
        factory, kwargs, params, grads_seq, static_args=("ns_steps",), rtol=1e-4, atol=1e-6
    )


CONVERGENCE = {
    # name: (transform, steps, quadratic threshold)
    "muon": (lambda: muon(optax.cosine_decay_schedule(0.5, 200)), 200, 1e-3),
    "lmo_spectral": (lambda: lmo(optax.cosine_decay_schedule(0.5, 200)), 200, 1e-3),
    "lmo_frobenius": (
        lambda: lmo(optax.cosine_decay_schedule(2.0, 200), norm="frobenius"),
        200,
        1e-3,
    ),
    "lmo_sign": (lambda: lmo(optax.cosine_decay_schedule(0.1, 200), norm="sign"), 200, 1e-3),
}


@pytest.mark.parametrize("name", sorted(CONVERGENCE))
def test_converges_on_matrix_quadratic(name):
    # ½‖W − W*‖² over a dense (16, 32) and a conv (3, 3, 4, 8) leaf, from 0: initial loss 410.
    # Normalized steps need a decaying learning rate to settle (cosine to 0); measured final
    # losses are 1e-5 to 1e-8, the threshold 1e-3 is a 4e5-fold decrease.
    make, steps, threshold = CONVERGENCE[name]
    loss_fn, params0, _ = matrix_quadratic(jax.random.key(0), {"a": (16, 32), "b": (3, 3, 4, 8)})
    assert abs(float(loss_fn(params0)) - 410.18) < 0.01
    check_converges(make(), loss_fn, params0, steps=steps, threshold=threshold)


@pytest.mark.parametrize(
    "name,make",
    [
        ("muon", lambda: muon(optax.cosine_decay_schedule(0.05, 2000), beta=0.9)),
        (
            "lmo_frobenius",
            lambda: lmo(optax.cosine_decay_schedule(0.05, 2000), norm="frobenius", momentum=0.9),
        ),
    ],
)
def test_converges_on_matrix_rosenbrock(name, make):
    # Row-wise Rosenbrock on a (4, 8) matrix from W = −0.5 (loss 1647) to W* = 1 (loss 0):
    # 2000 steps, cosine-decayed lr; measured final losses ≈ 1e-10, threshold 1e-4.
    loss_fn, params0 = matrix_rosenbrock((4, 8))
    assert float(loss_fn(params0)) == 1647.0
    check_converges(make(), loss_fn, params0, steps=2000, threshold=1e-4)


# ---------------------------------------------------------------- the optim.* config keys


def test_optim_ns_dtype_and_orthogonalizer_reach_the_local_direction():
    # configs/base.py sets optim.ns_dtype = "auto"; split_optim passes an explicit value to the
    # optimizers that run Newton–Schulz (muon, lmo) and refuses it for the others.
    from configs.base import get_base_config
    from fedorth.fed import local

    assert get_base_config().optim.ns_dtype == "auto"
    tree = {"w": jnp.ones((8, 24)), "b": jnp.ones((8,))}
    for name in ("muon", "lmo"):
        optim = {"name": name, "learning_rate": 0.1, "ns_dtype": "bfloat16"}
        _, _, hp = local.split_optim(optim)
        assert hp == {"ns_dtype": "bfloat16"}
        tx = local.direction(name, **hp)
        dots, _ = _dot_dtypes(lambda g: tx.update(g, tx.init(tree), tree), tree)
        assert set(dots) == {("bfloat16", "bfloat16", "float32")}, (name, set(dots))
        assert local.split_optim({**optim, "ns_dtype": "auto"})[2] == {}, "auto is the default"
    with pytest.raises(ValueError, match=r"optim.ns_dtype='bfloat16'.*'sgd' runs no Newton"):
        local.split_optim({"name": "sgd", "ns_dtype": "bfloat16"})
    assert local.split_optim({"name": "sgd", "ns_dtype": "auto"}) == ("sgd", 0.0, {})
    # optim.orthogonalizer="svd" on the federated Muon direction: FedMuon (Liu et al.) Alg. 2.
    g = random_tree(27, {"w": (8, 24), "b": (8,)})[0]
    tx = local.direction(
        "muon", beta=0.9, nesterov=False, orthogonalizer="svd", shape_scaling="none"
    )
    updates, _ = tx.update(g, tx.init(tree), tree)
    np.testing.assert_allclose(updates["w"], polar(np.asarray(g["w"])), rtol=0, atol=2e-5)
    # The default labels follow the Muon mask: a (1, 1, 192) cls token is not a matrix.
    labels = local.matrix_labels({"cls": jnp.ones((1, 1, 192)), "w": jnp.ones((8, 24))})
    assert labels == {"cls": "other", "w": "matrix"}


def test_validate_reports_a_bad_optim_ns_dtype_in_one_line():
    from configs.fedavg import get_config as fedavg_config
    from configs.local_muon import get_config as local_muon_config
    from fedorth.train import validate

    config = local_muon_config()
    config.optim.ns_dtype = "bfloat16"
    validate.validate(config)  # a valid choice for a Muon optimizer
    config.optim.ns_dtype = "float16"
    with pytest.raises(validate.ConfigError, match=r"optim.ns_dtype='float16' is unknown.*'auto'"):
        validate.validate(config)
    config = fedavg_config()
    config.optim.ns_dtype = "bfloat16"
    with pytest.raises(validate.ConfigError, match=r"optim.name='sgd' runs no Newton–Schulz"):
        validate.validate(config)


@pytest.mark.parametrize("ema,nesterov", [(True, False), (False, True)])
def test_muon_direction_momentum_sgd_fallback_matches_numpy(ema, nesterov):
    # optim.fallback="momentum_sgd": the non-matrix leaves take the Muon leaves' own momentum,
    # unorthogonalized, times fallback_lr_ratio (FedMuon-LMO Appendix G: momentum SGD on both
    # LocalMuon and FedMuon). Float64 NumPy: M ← βM + w·g (w = 1 − β with ema), step M or
    # w·g + βM (Nesterov).
    from fedorth.fed import local

    beta, ratio = 0.9, 0.25
    shapes = {"w": (6, 10), "b": (10,), "cls": (1, 1, 4)}
    params = random_tree(28, shapes)[0]
    grads_seq = random_tree(29, shapes, num=3)
    tx = local.direction(
        "muon",
        beta=beta,
        ema=ema,
        nesterov=nesterov,
        fallback="momentum_sgd",
        fallback_lr_ratio=ratio,
    )
    state, update = tx.init(params), fast_jit(tx.update)
    w = 1 - beta if ema else 1.0
    m = {k: np.zeros(shapes[k]) for k in ("b", "cls")}
    for t, g in enumerate(grads_seq):
        updates, state = update(g, state, params)
        for k in m:
            gk = np.asarray(g[k], np.float64)
            m[k] = beta * m[k] + w * gk
            expected = ratio * (w * gk + beta * m[k] if nesterov else m[k])
            np.testing.assert_allclose(
                updates[k], expected, rtol=1e-6, atol=1e-7, err_msg=f"step {t} {k}"
            )
    with pytest.raises(ValueError, match=r"optim.fallback='lion' is unknown"):
        local.direction("muon", fallback="lion")
    # fallback_eps reaches the Adam fallback: the first Adam step is g/(|g| + eps).
    tx = local.direction("muon", fallback_eps=1.0)
    updates, _ = tx.update(grads_seq[0], tx.init(params), params)
    gb = np.asarray(grads_seq[0]["b"], np.float64)
    np.testing.assert_allclose(updates["b"], gb / (np.abs(gb) + 1.0), rtol=1e-5)


def test_minimax_muon_step_takes_ns_dtype():
    # FedMuon-DA (Fed minimax (Zhang & Gao) Alg. 2/3) orthogonalizes with the same
    # newton_schulz: optim.ns_dtype reaches it; "auto" is accepted by every minimax step.
    from fedorth import fed
    from fedorth.optim import minimax

    tree = {"primal": {"w": jnp.ones((8, 24))}, "dual": {"a": jnp.ones((3,))}}
    label_fn = minimax.make_label_fn(("dual",))
    for ns_dtype in ("bfloat16", "float32"):
        tx = minimax.scale_by_minimax_step(label_fn, "muon", ns_dtype=ns_dtype)
        dots, _ = _dot_dtypes(lambda u: tx.update(u, tx.init(u))[0], tree)
        assert set(dots) == {(ns_dtype, ns_dtype, "float32")} and len(dots) == 15, dots
    muon_optim = {"name": "muon", "learning_rate": 0.03}
    fed.get_algorithm("fedmuon_da", {**muon_optim, "ns_dtype": "bfloat16"})
    fed.get_algorithm("local_sgda", {"name": "sgd", "learning_rate": 1.0, "ns_dtype": "auto"})
    with pytest.raises(ValueError, match=r"Newton–Schulz dtype 'int8'"):
        fed.get_algorithm("fedmuon_da", {**muon_optim, "ns_dtype": "int8"})


def test_local_muon_bias_follows_adamw_decaying_at_the_adamw_rate():
    # Each parameter group decays at its own rate (the authors' SingleDeviceMuonWithAuxAdam
    # groups, each with its own lr and weight_decay): under Local Muon with FedPAC (Liu et al.)
    # Table 8's Muon row (lr 3e-2, wd 0.01, fallback AdamW at 3e-4 with the row's (0.9, 0.95)),
    # a bias follows AdamW at 3e-4 with decoupled decay 3e-4 * 0.01, its Adam state restarting
    # every round (Local-X).
    # Float64 NumPy AdamW, engine in float64 (one client: the server average is its iterate).
    # Decaying the bias at the Muon rate (3e-2 * 0.01) moves it by ~1e-3 here.
    import fed_problems as fp

    from configs import presets
    from fedorth import fed

    optim = dict(presets.FEDPAC_OPTIM["muon"])
    lr, wd, ratio = optim.pop("learning_rate"), optim["weight_decay"], optim["fallback_lr_ratio"]
    rounds, steps = 3, 20
    rng = np.random.default_rng(5)
    data = {"H": np.eye(4)[None], "B": rng.normal(size=(1, 4, 3)), "c": np.full((1, 3), 40.0)}
    b0 = np.array([1.0, -2.0, 0.5])
    with jax.enable_x64(True):
        alg = fed.get_algorithm("local_muon", optim)
        params = {"w": jnp.zeros((4, 3)), "b": jnp.asarray(b0)}
        settings = dict(num_clients=1, clients_per_round=1, local_steps=steps, learning_rate=lr)
        server, round_fn, _ = fp.start_rounds(alg, params=params, **settings)
        jdata = jax.tree.map(jnp.asarray, data)
        trajectory = []
        for _ in range(rounds):
            server, _ = round_fn(server, jdata)
            trajectory.append(np.asarray(server.params["b"], np.float64))
    lr_adamw = ratio * lr
    assert lr_adamw == pytest.approx(3e-4)
    b = b0.copy()
    for r in range(rounds):
        m, v = np.zeros(3), np.zeros(3)
        for t in range(1, steps + 1):
            g = b - data["c"][0]
            m, v = 0.9 * m + 0.1 * g, 0.95 * v + 0.05 * g * g
            adam = (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.95**t)) + 1e-8)
            b = b - lr_adamw * (adam + wd * b)
        np.testing.assert_allclose(trajectory[r], b, rtol=1e-12, atol=1e-14, err_msg=f"round {r}")


@pytest.mark.parametrize(
    "name,options",
    [("local_muon", {}), ("fedpac_muon", {}), ("fedmuon", {}), ("fedmuon_svd", {})],
)
def test_muon_fallback_leaves_decay_at_the_fallback_rate(name, options):
    # A leaf with zero gradient moves only by the decoupled decay: x <- (1 - lr_group lambda) x,
    # with lr_group = fallback_lr_ratio * lr on the fallback's leaves (the bias) and lr on the
    # Muon matrices, for every Muon method (each group at its own rate; with a zero global
    # direction the alignment/correction terms are zero).
    from configs import presets
    from fedorth import fed

    optim = dict(presets.FEDPAC_OPTIM["muon"])
    lr, wd, ratio = optim.pop("learning_rate"), optim["weight_decay"], optim["fallback_lr_ratio"]
    params = {"w": jnp.full((4, 3), 2.0), "b": jnp.asarray([1.0, -2.0, 0.5])}
    zeros = jax.tree.map(jnp.zeros_like, params)
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(jnp.float64), params)
        zeros = jax.tree.map(lambda x: x.astype(jnp.float64), zeros)
        tx = fed.get_algorithm(name, optim, **options).local_tx
        state = tx.init(params)
        x = params
        for _ in range(5):
            updates, state = tx.update(zeros, state, x, learning_rate=lr, global_direction=zeros)
            x = optax.apply_updates(x, updates)
    np.testing.assert_allclose(
        x["b"], np.asarray(params["b"]) * (1 - ratio * lr * wd) ** 5, rtol=1e-13
    )
    # The Muon matrix's zero momentum orthogonalizes to zero: decay at the Muon rate only.
    np.testing.assert_allclose(x["w"], 2.0 * (1 - lr * wd) ** 5, rtol=1e-13)


def test_fedmuon_bc_other_leaves_decay_at_their_rate():
    # FedMuon-LMO's non-matrix leaves step at other_lr_ratio * eta: they decay at that rate too.
    from fedorth import fed

    lr, wd, ratio = 1e-3, 0.1, 10.0
    params = {"w": jnp.full((4, 3), 2.0), "b": jnp.asarray([1.0, -2.0, 0.5])}
    zeros = jax.tree.map(jnp.zeros_like, params)
    alg = fed.get_algorithm("fedmuon_bc", {"name": "lmo", "weight_decay": wd}, other_lr_ratio=ratio)
    tx = alg.local_tx
    state = tx.init(params)
    updates, _ = tx.update(zeros, state, params, learning_rate=lr, control_correction=zeros)
    np.testing.assert_allclose(updates["b"], -ratio * lr * wd * np.asarray(params["b"]), rtol=1e-6)
    np.testing.assert_allclose(updates["w"], -lr * wd * 2.0, rtol=1e-6)
