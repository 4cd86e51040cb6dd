"""Newton–Schulz: float64 NumPy references, the SVD polar factor, and the singular-value map."""

import contextlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import fast_jit
from optax.contrib import _muon as optax_muon

from fedorth.optim.newton_schulz import (
    _POLAR_EXPRESS_RAW,
    NS_PRESETS,
    POLAR_EXPRESS_SAFETY,
    SYMMETRIC_BLOCKS_MIN,
    default_ns_dtype,
    newton_schulz,
    newton_schulz_flops,
    ns_coefficients,
    polar_factor_svd,
    resolve_ns_dtype,
)

# The real rule, before tests/conftest.py's autouse fixture pins "auto" to float32 in every test
# (here the comparisons with float64 NumPy are at float32 round-off, 2e-5; the bfloat16 path is
# tested below with dtype="bfloat16" passed explicitly, at its own tolerance).
_DEFAULT_NS_DTYPE = default_ns_dtype


PRESETS = sorted(NS_PRESETS)
# Wide, tall, batched wide, batched tall; the other float32 tests reuse these shapes, so that
# their op-by-op calls run the programs the step-by-step test compiled.
SHAPES = [(12, 20), (20, 12), (3, 10, 14), (2, 14, 9)]


def np_newton_schulz(x, schedule, eps=1e-7):
    """Float64 transcription of FedPAC (Liu et al.) Alg. 6 lines 20–29: normalize, transpose
    tall, iterate.

    Returns the list of iterates X_0 … X_T (each transposed back to x's orientation).
    """
    x = np.asarray(x, np.float64)
    tall = x.shape[-2] > x.shape[-1]
    X = x / (np.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
    if tall:
        X = np.swapaxes(X, -1, -2)
    iterates = [X]
    for a, b, c in schedule:
        A = X @ np.swapaxes(X, -1, -2)
        B = b * A + c * A @ A
        X = a * X + B @ X
        iterates.append(X)
    return [np.swapaxes(Y, -1, -2) if tall else Y for Y in iterates]


def polar(x):
    u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
    return u @ vt


def rel_fro(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=(-2, -1)) / np.linalg.norm(b, axis=(-2, -1))


def conditioned(rng, shape, smin=0.1, smax=1.0):
    """U diag(s) Vᵀ with singular values spread over [smin, smax] (condition number smax/smin)."""
    *batch, m, n = shape
    k = min(m, n)
    u = np.linalg.qr(rng.standard_normal((*batch, m, k)))[0]
    v = np.linalg.qr(rng.standard_normal((*batch, n, k)))[0]
    s = rng.uniform(smin, smax, (*batch, k))
    return (u * s[..., None, :]) @ np.swapaxes(v, -1, -2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preset", PRESETS)
def test_matches_float64_numpy_step_by_step(preset, shape):
    # Every iterate X_t (t = 0..T) of the float32 JAX iteration matches the float64 NumPy
    # transcription of the algorithm box; T = 12 also exercises the lax.scan path (> 10 steps).
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    steps = 12
    ref = np_newton_schulz(x, ns_coefficients(preset, steps))
    # Past _UNROLL_LIMIT steps a lax.scan, which an op-by-op call compiles whole at each call:
    # the scanned iterates come from one program (XLA's level 0, helpers.fast_jit).
    scanned = fast_jit(lambda x: {t: newton_schulz(x, t, preset) for t in range(11, steps + 1)})(x)
    for t in range(steps + 1):
        got = scanned[t] if t in scanned else newton_schulz(x, t, preset)
        assert got.shape == x.shape and got.dtype == jnp.float32
        # float32 round-off through t steps of three products; Polar Express's first step
        # (a ≈ 8, b ≈ −22, c ≈ 16) amplifies it most.
        err = rel_fro(got, ref[t]).max()
        assert err < 2e-5, f"{preset} step {t}: relative error {err:.2e} vs float64 NumPy"


@pytest.mark.parametrize("preset", PRESETS)
def test_float64_input_matches_numpy_to_round_off(preset):
    # Under x64 the iteration runs in float64 (compute dtype follows the input): the
    # implementation equals the algorithm box to float64 round-off, not just float32.
    x = np.random.default_rng(1).standard_normal((2, 9, 13))
    with jax.enable_x64(True):
        got = np.asarray(newton_schulz(jnp.asarray(x, jnp.float64), 7, preset))
    ref = np_newton_schulz(x, ns_coefficients(preset, 7))[-1]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (32, 32), (4, 16, 24)])
@pytest.mark.parametrize("preset,steps", [("classic", 40), ("cubic", 60), ("polar_express", 10)])
def test_converges_to_svd_polar_factor(preset, steps, shape):
    # Convergent presets reach UVᵀ of a well-conditioned matrix (singular values in [0.1, 1],
    # so σ_min/‖x‖_F ≥ 0.1/√min(m,n) ≥ 0.016) to 1e-3 in relative Frobenius norm.
    x = conditioned(np.random.default_rng(2), shape).astype(np.float32)
    # A lax.scan (steps > 10): compiled at XLA's level 0 (helpers.fast_jit), not op by op.
    got = fast_jit(newton_schulz, static_argnums=(1, 2))(x, steps, preset)
    err = rel_fro(got, polar(x)).max()
    assert err < 1e-3, f"{preset} with {steps} steps: {err:.2e} from the SVD polar factor"


def test_jordan_singular_values_follow_the_scalar_map_and_band():
    # NS acts on singular values only: σ_i(NS(x)) = p⁵(σ_i / (‖x‖_F + ε)) with Jordan's quintic
    # p(s) = 3.4445 s − 4.7750 s³ + 2.0315 s⁵ (identity, checked in float64 on the scalar map).
    # Measured band (iterating p five times on a fine grid of s ∈ [0.01, 1]): [0.68183, 1.13436]
    # (the oft-quoted ~[0.7, 1.13]); every singular value must land in it.
    rng = np.random.default_rng(3)
    x = conditioned(rng, (4, 48, 80), smin=0.1, smax=1.0).astype(np.float32)
    got = np.linalg.svd(np.asarray(newton_schulz(x, 5, "jordan"), np.float64), compute_uv=False)
    s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
    s = s / (np.sqrt(np.sum(s**2, axis=-1, keepdims=True)) + 1e-7)
    a, b, c = NS_PRESETS["jordan"][0]
    for _ in range(5):
        s = a * s + b * s**3 + c * s**5
    # p⁵ is not monotone, so compare the sorted spectra.
    np.testing.assert_allclose(
        np.sort(got, axis=-1), np.sort(s, axis=-1), atol=2e-5, err_msg="sigma != p^5(sigma_in)"
    )
    assert got.min() >= 0.6818 and got.max() <= 1.1344, (got.min(), got.max())


def test_polar_express_preset_equals_published_algorithm_1():
    # Amsel et al. 2025, Algorithm 1 as printed: X = G/(1.01‖G‖_F + 1e-7), safety-scaled
    # tuples, last tuple repeated. Our preset folds the 1.01 input scaling into the first tuple
    # and normalizes by ‖G‖_F + eps; with eps = 1e-7/1.01 the two are the same polynomial.
    x = np.random.default_rng(4).standard_normal((2, 9, 13))  # the float64 test's shape
    published = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]] + [
        _POLAR_EXPRESS_RAW[-1]
    ]
    for steps in (1, 5, 10):
        schedule = published[:steps] + [published[-1]] * (steps - len(published))
        X = x / (np.linalg.norm(x, axis=(-2, -1), keepdims=True) * POLAR_EXPRESS_SAFETY + 1e-7)
        for a, b, c in schedule:
            A = X @ np.swapaxes(X, -1, -2)
            X = a * X + (b * A + c * A @ A) @ X
        with jax.enable_x64(True):
            got = newton_schulz(jnp.asarray(x), steps, "polar_express", eps=1e-7 / 1.01)
        np.testing.assert_allclose(np.asarray(got), X, rtol=0, atol=1e-12)


def test_schedule_rules():
    pe = NS_PRESETS["polar_express"]
    assert len(pe) == 8 and pe[-1] == (1.875, -1.25, 0.375)
    assert ns_coefficients("polar_express", 11) == pe + (pe[-1],) * 3, "repeat the last tuple"
    assert ns_coefficients("polar_express", 3) == pe[:3], "cut to the first steps"
    assert ns_coefficients((1.5, -0.5, 0.0), 2) == ((1.5, -0.5, 0.0),) * 2
    custom = [(3.0, -3.0, 1.0), (1.5, -0.5, 0.0)]
    assert ns_coefficients(custom, 4) == ((3.0, -3.0, 1.0),) + ((1.5, -0.5, 0.0),) * 3
    assert ns_coefficients(np.array(custom), 1) == ((3.0, -3.0, 1.0),)
    assert ns_coefficients("classic", 0) == ()
    assert NS_PRESETS["classic"] == ((15 / 8, -5 / 4, 3 / 8),)
    assert NS_PRESETS["jordan"] == ((3.4445, -4.7750, 2.0315),)
    assert NS_PRESETS["cubic"] == ((1.5, -0.5, 0.0),)


def test_cubic_is_half_x_three_minus_xtx():
    # FedPAC (Liu et al.) Alg. 7 line 24 on the wide side: X ← ½(3I − XXᵀ)X.
    x = np.random.default_rng(5).standard_normal(SHAPES[0])
    X = x / (np.linalg.norm(x) + 1e-7)
    X = 0.5 * (3 * np.eye(len(X)) - X @ X.T) @ X
    np.testing.assert_allclose(newton_schulz(x.astype(np.float32), 1, "cubic"), X, atol=2e-6)


@pytest.mark.parametrize("preset", PRESETS)
def test_steps_zero_and_zero_matrix(preset):
    x = np.random.default_rng(6).standard_normal(SHAPES[2]).astype(np.float32)
    expected = x / (np.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7)
    np.testing.assert_allclose(newton_schulz(x, 0, preset), expected, rtol=1e-6, atol=1e-7)
    for steps in (0, 5, 12):
        z = newton_schulz(np.zeros(SHAPES[3], np.float32), steps, preset)
        assert np.all(np.asarray(z) == 0.0), f"zero input must give zeros (steps={steps})"


def test_tall_is_transpose_of_wide_and_batched_is_per_matrix():
    x = np.random.default_rng(7).standard_normal(SHAPES[2]).astype(np.float32)
    wide = newton_schulz(x)
    tall = newton_schulz(np.swapaxes(x, -1, -2))
    np.testing.assert_allclose(np.swapaxes(tall, -1, -2), wide, rtol=1e-5, atol=1e-6)
    for i in range(3):
        np.testing.assert_allclose(newton_schulz(x[i]), wide[i], rtol=1e-5, atol=1e-6)


def test_jit_and_vmap():
    x = np.random.default_rng(8).standard_normal(SHAPES[3]).astype(np.float32)
    eager = newton_schulz(x, 5, "polar_express")
    jitted = jax.jit(lambda x: newton_schulz(x, 5, "polar_express"))(x)
    vmapped = jax.vmap(lambda m: newton_schulz(m, 5, "polar_express"))(x)
    # Same math, different XLA fusion: float32 round-off, amplified by Polar Express's first step
    # (same 2e-5 budget as the float64 comparison above).
    assert rel_fro(jitted, eager).max() < 2e-5
    assert rel_fro(vmapped, eager).max() < 2e-5


def test_default_ns_dtype_rule():
    # bfloat16 where tensor cores make it the Muon reference's fast path, float32 on CPU.
    assert _DEFAULT_NS_DTYPE("cpu") == "float32"
    assert _DEFAULT_NS_DTYPE("gpu") == "bfloat16" and _DEFAULT_NS_DTYPE("cuda") == "bfloat16"
    assert _DEFAULT_NS_DTYPE("tpu") == "bfloat16" and _DEFAULT_NS_DTYPE("rocm") == "bfloat16"
    assert _DEFAULT_NS_DTYPE() == _DEFAULT_NS_DTYPE(jax.default_backend())
    for name in ("bfloat16", "float32"):
        assert resolve_ns_dtype(name) == name and resolve_ns_dtype(jnp.dtype(name)) == name
    assert resolve_ns_dtype(None) == resolve_ns_dtype("auto") == "float32"  # the fixture's pin
    with pytest.raises(ValueError, match=r"dtype 'float16'.*'auto', 'bfloat16', 'float32'"):
        newton_schulz(jnp.ones((3, 4)), dtype="float16")
    with pytest.raises(ValueError, match=r"Unknown Newton–Schulz dtype 'fast'"):
        resolve_ns_dtype("fast")


def _bf16(a):
    """Rounds to bfloat16 (round to nearest even) and back, in float64."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _f32(a):
    return np.asarray(a, np.float32).astype(np.float64)


def np_newton_schulz_bf16(x, schedule, eps=1e-7):
    """The bfloat16 path in NumPy: the operands of every product rounded to bfloat16, the
    products accumulated exactly (float64) and rounded to float32, as tensor cores do."""
    x = np.asarray(x, np.float64)
    tall = x.shape[-2] > x.shape[-1]
    norm = _f32(np.linalg.norm(x, axis=(-2, -1), keepdims=True))
    X = _bf16(x / (norm + eps))
    if tall:
        X = np.swapaxes(X, -1, -2)
    for a, b, c in schedule:
        A = _f32(X @ np.swapaxes(X, -1, -2))
        B = _bf16(b * A + c * _f32(_bf16(A) @ _bf16(A)))
        X = _bf16(a * X + _f32(B @ X))
    return np.swapaxes(X, -1, -2) if tall else X


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (3, 24, 40)])
@pytest.mark.parametrize("preset", PRESETS)
def test_bfloat16_matches_float64_numpy_at_bfloat16_tolerance(preset, shape):
    # Five steps against the exact float64 iteration. bfloat16's rounding unit is 2^-9 ≈ 2e-3,
    # three roundings per step, amplified by the polynomials' slopes (Jordan's p'(0) = 3.44,
    # Polar Express's first step 8.2): measured 2.5e-2 to 2.7e-2 for "jordan" and
    # "polar_express", 4e-3 for the convergent "classic" and "cubic" (which contract errors).
    # Tolerances: 5e-2 and 1e-2. Against the NumPy transcription of the bfloat16 path itself
    # the result is bit-equal on most shapes; a product that lands on a bfloat16 rounding tie
    # may round the other way in XLA's summation order, which then propagates (measured up to
    # 8.3e-3): tolerance 2e-2, and the float32 path's error is 1e-6, so > 1e-3 proves bfloat16.
    x = np.random.default_rng(9).standard_normal(shape).astype(np.float32)
    schedule = ns_coefficients(preset, 5)
    got = newton_schulz(x, 5, preset, dtype="bfloat16")
    assert got.dtype == jnp.float32 and got.shape == x.shape
    exact = np_newton_schulz(x, schedule)[-1]
    err = rel_fro(got, exact).max()
    tol = 5e-2 if preset in ("jordan", "polar_express") else 1e-2
    assert 1e-3 < err < tol, f"{preset}: bfloat16 NS is {err:.2e} from float64 NumPy"
    emulated = np_newton_schulz_bf16(x, schedule)
    assert rel_fro(got, emulated).max() < 2e-2, "not the bfloat16-operand, float32-sum iteration"
    assert rel_fro(newton_schulz(x, 5, preset, dtype="float32"), exact).max() < 2e-5


def _dots(fn, *args):
    """(operand dtypes, preferred_element_type, precision) of every dot_general in fn's jaxpr."""
    out = []
    for eqn in jax.make_jaxpr(fn)(*args).eqns:
        if eqn.primitive.name == "dot_general":
            dtypes = tuple(str(v.aval.dtype) for v in eqn.invars)
            out.append((dtypes, str(eqn.params["preferred_element_type"]), eqn.params["precision"]))
    return out


def test_bfloat16_path_multiplies_bfloat16_into_float32():
    x = jnp.ones((12, 20), jnp.float32)
    dots = _dots(lambda x: newton_schulz(x, 2, "jordan", dtype="bfloat16"), x)
    assert len(dots) == 2 * 3, dots  # A, A², BX per quintic step
    for dtypes, acc, _ in dots:
        assert dtypes == ("bfloat16", "bfloat16") and acc == "float32", dots
    dots32 = _dots(lambda x: newton_schulz(x, 2, "jordan", dtype="float32"), x)
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert all(d == ("float32", "float32") and p == highest for d, _, p in dots32), dots32
    # The cubic preset skips A² (c = 0): two products per step.
    assert len(_dots(lambda x: newton_schulz(x, 3, "cubic", dtype="bfloat16"), x)) == 3 * 2


def test_output_dtype_follows_input_for_every_ns_dtype():
    x = np.random.default_rng(19).standard_normal(SHAPES[0]).astype(np.float32)
    exact = np_newton_schulz(x, ns_coefficients("jordan", 5))[-1]
    for in_dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        for ns_dtype in ("bfloat16", "float32"):
            out = newton_schulz(jnp.asarray(x, in_dtype), 5, dtype=ns_dtype)
            assert out.dtype == in_dtype, (in_dtype, ns_dtype, out.dtype)
            # The input's own rounding (bfloat16 input: 2^-9) enters like bfloat16 operands do.
            assert rel_fro(np.asarray(out, np.float32), exact) < 5e-2, (in_dtype, ns_dtype)
    with jax.enable_x64(True):
        x64 = jnp.asarray(x, jnp.float64)
        assert newton_schulz(x64, 5, dtype="bfloat16").dtype == jnp.float64
        out64 = newton_schulz(x64, 5, dtype="float32")  # "at least float32": float64 here
        np.testing.assert_allclose(np.asarray(out64), exact, rtol=0, atol=1e-12)


def test_precision_is_pinned_under_a_tensorfloat32_default():
    # On a GPU, float32 dots at DEFAULT precision run as TF32 (10-bit mantissa) and float32
    # comparisons with optax then fail. XLA:CPU ignores precision, so the numbers here cannot
    # show it; the lowered program can: under jax.default_matmul_precision("tensorfloat32") an
    # unpinned dot lowers with precision HIGH, a pinned one with HIGHEST.
    x = jnp.ones((12, 20), jnp.float32)
    coeffs = jnp.asarray(NS_PRESETS["jordan"][0])

    def precisions(fn, pin=None):
        with jax.default_matmul_precision("tensorfloat32"):
            with jax.default_matmul_precision(pin) if pin else contextlib.nullcontext():
                text = jax.jit(fn).lower(x).as_text()
        return set(re.findall(r"precision = \[(\w+), \w+\]", text))

    assert precisions(lambda x: newton_schulz(x, 5, dtype="float32")) == {"HIGHEST"}
    theirs = lambda x: optax_muon.orthogonalize_via_newton_schulz(x, coeffs, 5)
    assert precisions(theirs) == {"HIGH"}, "control: optax alone follows the default (TF32)"
    assert precisions(theirs, pin="float32") == {"HIGHEST"}, "the pin the optax tests use"


def test_svd_polar_factor_matches_numpy_float64():
    # FedMuon (Liu et al.) Alg. 2's UVᵀ = SVD(M): float32 SVD against float64 NumPy. One batch
    # holds a full-rank, a rank-3 and a zero matrix: a rank-deficient matrix keeps only its
    # range (U_r V_rᵀ, the limit of Newton–Schulz), so zero stays zero.
    rng = np.random.default_rng(20)
    tall = rng.standard_normal((20, 12)).astype(np.float32)
    got = polar_factor_svd(tall)
    assert got.dtype == jnp.float32 and got.shape == tall.shape
    np.testing.assert_allclose(got, polar(tall), rtol=0, atol=2e-5, err_msg="tall")
    u, v = rng.standard_normal((10, 3)), rng.standard_normal((16, 3))
    batch = np.stack([rng.standard_normal((10, 16)), u @ v.T, np.zeros((10, 16))])
    got = np.asarray(polar_factor_svd(batch.astype(np.float32)))
    uu, _, vt = np.linalg.svd(u @ v.T)
    np.testing.assert_allclose(got[0], polar(batch[0]), rtol=0, atol=2e-5, err_msg="wide")
    np.testing.assert_allclose(got[1], uu[:, :3] @ vt[:3], rtol=0, atol=2e-5, err_msg="rank 3")
    assert np.all(got[2] == 0.0), "a zero matrix must give zeros"
    with jax.enable_x64(True):
        x = rng.standard_normal((7, 11))
        np.testing.assert_allclose(polar_factor_svd(jnp.asarray(x)), polar(x), atol=1e-13)


def test_complex_input_is_refused():
    z = jnp.ones((3, 4), jnp.complex64)
    with pytest.raises(ValueError, match="complex array.*real matrices only"):
        newton_schulz(z)
    with pytest.raises(ValueError, match="complex array.*real matrices only"):
        polar_factor_svd(z)


@pytest.mark.parametrize("default_precision", [None, "tensorfloat32"])
def test_agrees_with_optax_contrib_orthogonalize(default_precision):
    # optax.contrib's orthogonalize_via_newton_schulz with the same coefficients and eps:
    # same normalization (‖x‖_F + eps) and iteration, so the same result up to float32 round-off.
    # Both sides pinned to float32 products: ours by dtype="float32" (HIGHEST), optax's by
    # jax.default_matmul_precision("float32"), whatever the ambient default (TF32 on a GPU;
    # the "tensorfloat32" case is its CPU proxy, see test_precision_is_pinned_...).
    x = np.random.default_rng(10).standard_normal((24, 40)).astype(np.float32)
    outer = jax.default_matmul_precision(default_precision)
    with outer if default_precision else contextlib.nullcontext():
        theirs_fn = jax.jit(
            lambda m, abc: optax_muon.orthogonalize_via_newton_schulz(m, abc, 5, eps=1e-8)
        )
        for coeffs in ("jordan", "classic"):
            for m in (x, x.T):
                ours = newton_schulz(m, 5, coeffs, eps=1e-8, dtype="float32")
                with jax.default_matmul_precision("float32"):
                    theirs = theirs_fn(m, jnp.asarray(NS_PRESETS[coeffs][0]))
                np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=2e-6)


def test_flop_count():
    # Per step on min side m=256, n=1024: 4·m²·n + 2·m³.
    assert newton_schulz_flops((1024, 256), 5) == 5 * (4 * 256**2 * 1024 + 2 * 256**3)
    assert newton_schulz_flops((3, 8, 8), 1, quintic=False) == 3 * 4 * 8**3


def test_errors():
    x = jnp.ones((3, 4))
    with pytest.raises(ValueError, match=r"Unknown Newton.*'nope'.*classic.*cubic.*jordan"):
        newton_schulz(x, 5, "nope")
    with pytest.raises(ValueError, match="steps must be >= 0, got -1"):
        newton_schulz(x, -1)
    with pytest.raises(ValueError, match="steps must be a Python int"):
        newton_schulz(x, 2.5)
    with pytest.raises(ValueError, match=r"rank >= 2, got shape \(4,\)"):
        newton_schulz(jnp.ones(4))
    with pytest.raises(ValueError, match="tuple of three numbers"):
        newton_schulz(x, 2, (1.0, 2.0))
    with pytest.raises(ValueError, match="tuple of three numbers"):
        newton_schulz(x, 2, [(1.0, 2.0, 3.0), (1.0,)])


@pytest.mark.parametrize("shape", [(1024, 1030), (1031, 1025)])
def test_symmetric_blocks_from_1024_rows_match_float64_numpy(shape):
    """From `SYMMETRIC_BLOCKS_MIN` (1024) on, on CPU, A = XXᵀ and A² come from three half-size
    blocks each: the same iteration, to float64 round-off (an odd side splits unevenly). The
    lowered program has 3 + 6 + 1 products per step there, and 3 at a smaller side of 1023."""
    x = np.random.default_rng(5).standard_normal(shape)
    with jax.enable_x64(True):
        got = np.asarray(fast_jit(lambda x: newton_schulz(x, 2, "jordan"))(x))
    ref = np_newton_schulz(x, ns_coefficients("jordan", 2))[-1]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)

    def products(shape):
        lowered = jax.jit(lambda x: newton_schulz(x, 1, "jordan")).lower(jnp.zeros(shape))
        return lowered.as_text().count("stablehlo.dot_general")

    assert SYMMETRIC_BLOCKS_MIN == 1024
    assert products(shape) == (10 if jax.default_backend() == "cpu" else 3)
    smaller = tuple(1023 if d == min(shape) else d for d in shape)
    assert products(smaller) == 3
