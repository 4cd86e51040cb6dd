"""Newton–Schulz orthogonalization: an approximate polar factor UVᵀ by matrix products only.

Every preset runs the odd quintic iteration of Muon (Jordan et al. 2024,
github.com/KellerJordan/Muon), FedMuon-LMO (bias-corrected LMO) Algorithm 2 and FedPAC
(Liu et al.) Algorithms 6/7::

    X₀ = G / (‖G‖_F + ε)                      (per matrix of the batch)
    X_{t+1} = a_t X_t + (b_t A_t + c_t A_t²) X_t,   A_t = X_t X_tᵀ

which maps each singular value σ of X_t to p_t(σ) = a_t σ + b_t σ³ + c_t σ⁵ and leaves the
singular vectors alone, so X_T = U p_T(…p_1(Σ/‖G‖_F)…) Vᵀ. Tall inputs (m > n) are handled on
their n × n side, X ← aX + X(bA + cA²) with A = XᵀX, which equals transposing, iterating and
transposing back (FedPAC (Liu et al.) Alg. 6 lines 22/28) without materializing any transpose.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Coeffs = tuple[float, float, float]

# Jordan's quintic (KellerJordan/Muon, modded-nanogpt; FedPAC (Liu et al.) Alg. 6 line 29).
# Maximizes the slope at 0; it does not converge to 1 but plateaus in a band around it.
_JORDAN: Coeffs = (3.4445, -4.7750, 2.0315)
# The classical degree-5 Newton–Schulz/Padé iteration p(x) = (15x − 10x³ + 3x⁵)/8
# (FedMuon-LMO (bias-corrected LMO) Algorithm 2 and Theorem 3): converges to sign(σ) for
# σ ∈ (0, 1], slowly at first.
_CLASSIC: Coeffs = (15 / 8, -5 / 4, 3 / 8)
# The cubic Newton–Schulz X ← ½X(3I − XᵀX) of FedPAC (Liu et al.) Algorithm 7 line 24.
_CUBIC: Coeffs = (3 / 2, -1 / 2, 0.0)

# Amsel, Persson, Musco & Gower 2025, "The Polar Express", Algorithm 1 (degree 5): the raw
# per-step optimal polynomials, then the published safety factor 1.01 (a/1.01, b/1.01³,
# c/1.01⁵) on all but the last, and Algorithm 1's input scaling X₀ = G/(1.01‖G‖_F + 1e-7)
# folded into the first tuple (p(x/1.01) has coefficients a/1.01, b/1.01³, c/1.01⁵), so that
# every preset shares the X₀ = G/(‖G‖_F + ε) normalization. The last tuple is the classical
# (15/8, −5/4, 3/8) and is repeated when more steps are asked for (as Algorithm 1 does).
_POLAR_EXPRESS_RAW: tuple[Coeffs, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_SAFETY = 1.01


def _safety(c: Coeffs, s: float) -> Coeffs:
    return (c[0] / s, c[1] / s**3, c[2] / s**5)


_POLAR_EXPRESS: tuple[Coeffs, ...] = (
    _safety(_safety(_POLAR_EXPRESS_RAW[0], POLAR_EXPRESS_SAFETY), POLAR_EXPRESS_SAFETY),
    *(_safety(c, POLAR_EXPRESS_SAFETY) for c in _POLAR_EXPRESS_RAW[1:-1]),
    _POLAR_EXPRESS_RAW[-1],
)

NS_PRESETS: dict[str, tuple[Coeffs, ...]] = {
    "jordan": (_JORDAN,),
    "classic": (_CLASSIC,),
    "cubic": (_CUBIC,),
    "polar_express": _POLAR_EXPRESS,
}

# Longer schedules run in a `lax.scan` (bounded compile time); shorter ones are unrolled so
# XLA sees, and fuses, every step.
_UNROLL_LIMIT = 10

# From this size of the Gram matrix on, on CPU, `newton_schulz` forms A = XXᵀ and A² from three of
# their four half-size blocks (A12 gives A21 = A12ᵀ): 3/4 of those products' FLOPs. Measured on a
# 2-core CPU, five Jordan steps (docs/PERFORMANCE.md, "Newton–Schulz from symmetric blocks"):
# 1024 × 3072 in 451 ms against 516 ms, 1024 × 1024 in 194 ms against 229 ms.
SYMMETRIC_BLOCKS_MIN = 1024


def _symmetric(a11: jax.Array, a12: jax.Array, a22: jax.Array) -> jax.Array:
    """The symmetric matrix [[a11, a12], [a12ᵀ, a22]] (over the last two axes)."""
    top = jnp.concatenate([a11, a12], axis=-1)
    bottom = jnp.concatenate([jnp.swapaxes(a12, -1, -2), a22], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def _as_coeff_tuple(value: Any) -> Coeffs | None:
    """Returns `value` as three floats if it is a length-3 sequence of numbers, else None."""
    try:
        items = list(value)
    except TypeError:
        return None
    if len(items) != 3 or not all(np.ndim(v) == 0 for v in items):
        return None
    try:
        return tuple(float(v) for v in items)  # type: ignore[return-value]
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def ns_coefficients(coeffs: str | Sequence[Any] = "jordan", steps: int = 5) -> tuple[Coeffs, ...]:
    """Resolves `coeffs` into the `steps` per-step tuples (a_t, b_t, c_t) that the iteration uses.

    Args:
      coeffs: a preset name (`"jordan"`, `"classic"`, `"cubic"`, `"polar_express"`), one tuple
        `(a, b, c)` used at every step, or a sequence of per-step tuples. A schedule longer than
        `steps` is cut to its first `steps` tuples; a shorter one repeats its last tuple (the
        rule of Polar Express Algorithm 1).
      steps: number of iterations T ≥ 0 (a Python int: it fixes the program).

    Returns:
      A tuple of `steps` tuples of Python floats.
    """
    try:
        steps = operator.index(steps)
    except TypeError:
        raise ValueError(
            f"steps must be a Python int (it is static: it fixes the number of matmuls), "
            f"got {steps!r} of type {type(steps).__name__}."
        ) from None
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}.")
    if isinstance(coeffs, str):
        if coeffs not in NS_PRESETS:
            raise ValueError(
                f"Unknown Newton–Schulz coefficient preset coeffs={coeffs!r}; valid presets are "
                f"{sorted(NS_PRESETS)} (or pass a tuple (a, b, c) or a list of such tuples)."
            )
        schedule = NS_PRESETS[coeffs]
    else:
        single = _as_coeff_tuple(coeffs)
        if single is not None:
            schedule = (single,)
        else:
            try:
                schedule = tuple(_as_coeff_tuple(c) for c in coeffs)
            except TypeError:
                schedule = (None,)
            if not schedule or any(c is None for c in schedule):
                raise ValueError(
                    "coeffs must be a preset name, a tuple of three numbers (a, b, c) or a "
                    f"non-empty sequence of such tuples; got {coeffs!r}."
                )
    if steps <= len(schedule):
        return tuple(schedule[:steps])
    return tuple(schedule) + (schedule[-1],) * (steps - len(schedule))


NS_DTYPES = ("auto", "bfloat16", "float32")


def default_ns_dtype(platform: str | None = None) -> str:
    """The matmul operand dtype `newton_schulz` uses for `dtype=None`/`"auto"` on `platform`.

    `"bfloat16"` on accelerators (`"gpu"`, `"tpu"`, ...): the Muon reference
    (github.com/KellerJordan/Muon, `zeropower_via_newtonschulz5`) runs the iteration in bfloat16,
    and NS only needs its singular values in a band around 1 (Jordan's quintic lands in
    [0.68, 1.13] anyway), while float32 products on a GPU run at TF32 or slower (on an H100 a
    float32-HIGHEST NS made an mlp FedPAC_Muon round 1.74x the PyTorch peer). `"float32"` on
    `"cpu"`: XLA:CPU has no fast bfloat16 dot, so bfloat16 there costs time and precision and
    buys nothing (measured on the 2-core development CPU, jit, 5 Jordan steps on 768 × 192:
    25 ms in float32, 61 ms in bfloat16).

    Args:
      platform: a JAX platform name; default `jax.default_backend()` (read when traced).

    Returns:
      `"bfloat16"` or `"float32"`.
    """
    platform = jax.default_backend() if platform is None else platform
    return "float32" if platform == "cpu" else "bfloat16"


def resolve_ns_dtype(dtype: Any = None) -> str:
    """`"bfloat16"` or `"float32"` for `dtype` in (None, `"auto"`, `"bfloat16"`, `"float32"`,
    `jnp.bfloat16`, `jnp.float32`); ValueError naming the choices otherwise."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return default_ns_dtype()
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in ("bfloat16", "float32"):
        raise ValueError(
            f"Unknown Newton–Schulz dtype {dtype!r}; valid choices are {list(NS_DTYPES)} "
            "(None means 'auto': bfloat16 on GPU/TPU, float32 on CPU)."
        )
    return name


def newton_schulz(
    x: jax.Array,
    steps: int = 5,
    coeffs: str | Sequence[Any] = "jordan",
    eps: float = 1e-7,
    *,
    precision: jax.lax.Precision | str | None = None,
    dtype: Any = None,
) -> jax.Array:
    r"""Approximates the polar factor UVᵀ of each matrix in `x` by a Newton–Schulz iteration.

    .. math::
      X_0 = x / (\|x\|_F + ε), \quad
      X_{t+1} = a_t X_t + (b_t A_t + c_t A_t^2) X_t, \quad A_t = X_t X_t^\top.

    With `steps=0` the result is x/(‖x‖_F + ε), the T = 0 of FedMuon-LMO (bias-corrected LMO)
    Alg. 2 (the normalized gradient). A zero matrix gives zeros. Tall matrices (m > n) iterate
    on A = XᵀX (n × n) and X ← aX + X(bA + cA²), the transposed form of the same iteration
    (FedPAC (Liu et al.) Alg. 6 transposes explicitly; the results agree), so A is always built
    on the smaller side: per step 2·m·m·n + 2·m³ + 2·m·m·n FLOPs for m = min(rows, cols) (the A²
    term is skipped when c = 0). On CPU, from m = `SYMMETRIC_BLOCKS_MIN` (1024) on, A and A² are
    formed from three of their four half-size blocks (both are symmetric): the same iteration in
    3/4 of those two products' FLOPs, equal up to float round-off.

    Presets: `"jordan"` (3.4445, −4.7750, 2.0315), Jordan's Muon and FedPAC (Liu et al.) Alg. 6;
    singular values end in a band around 1 rather than at 1. `"classic"` (15/8, −5/4, 3/8),
    FedMuon-LMO (bias-corrected LMO) Alg. 2 / Theorem 3, converges to UVᵀ. `"cubic"`
    (3/2, −1/2, 0), FedPAC (Liu et al.) Alg. 7 line 24's X ← ½X(3I − XᵀX). `"polar_express"`,
    the per-step schedule of Amsel et al. 2025 Alg. 1 with its 1.01 safety factor (its input
    scaling by 1.01 is folded into the first step, see `_POLAR_EXPRESS`); past its 8 tuples the
    last (classical) tuple repeats.

    Precision: with `dtype="bfloat16"` every product takes bfloat16 operands and accumulates in
    float32 (`preferred_element_type=float32`, what tensor cores do); the Gram matrix, B and the
    update aX + BX are formed in float32 and rounded to bfloat16 before they enter the next
    product, as in the Muon reference (`X = G.bfloat16()`), except that the Frobenius norm is
    taken in float32. Expect a relative error of about 1e-2 against the exact iteration (an
    8-bit mantissa, rounding unit 2⁻⁹, through 3 products per step). With `dtype="float32"` the
    operands are float32 (float64 when `x` is float64) and the result is the exact iteration up
    to float32 round-off (about 1e-6).

    Args:
      x: array `[..., m, n]` (rank ≥ 2); leading axes are a batch, each matrix is normalized
        by its own Frobenius norm.
      steps: number of iterations T ≥ 0 (Python int).
      coeffs: a preset name, a tuple (a, b, c), or a list of per-step tuples (see
        `ns_coefficients` for how a schedule is cut or extended to `steps`).
      eps: added to the Frobenius norm before dividing.
      precision: matmul precision. None (the default) pins float32 operands to `HIGHEST`
        (full float32 products on every backend, whatever `jax.default_matmul_precision` says:
        no TF32 passes) and leaves bfloat16 operands at `DEFAULT` (one bfloat16 pass, which is
        exact for bfloat16 operands).
      dtype: matmul operand dtype, `"bfloat16"`, `"float32"`, or None/`"auto"` for
        `default_ns_dtype()` (bfloat16 on GPU/TPU, float32 on CPU; see there for the reason).

    Returns:
      An array of the shape and (floating) dtype of `x`.
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(
            f"newton_schulz expects an array [..., m, n] of rank >= 2, got shape {x.shape}; "
            "orthogonalize vectors with x / norm(x) or reshape them into matrices first."
        )
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise ValueError(
            f"newton_schulz got a complex array ({x.dtype}); it orthogonalizes real matrices "
            "only (XXᵀ would need the conjugate transpose)."
        )
    schedule = ns_coefficients(coeffs, steps)
    out_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    norm_dtype = jnp.promote_types(out_dtype, jnp.float32)
    if resolve_ns_dtype(dtype) == "bfloat16":
        compute_dtype = jnp.dtype(jnp.bfloat16)
    else:  # "float32" means at least float32: float64 input (under x64) iterates in float64
        compute_dtype = jnp.dtype(norm_dtype)
    acc_dtype = jnp.promote_types(compute_dtype, jnp.float32)
    if precision is None:
        low = compute_dtype == jnp.bfloat16
        precision = jax.lax.Precision.DEFAULT if low else jax.lax.Precision.HIGHEST

    x_acc = x.astype(norm_dtype)
    norm = jnp.sqrt(jnp.sum(jnp.square(x_acc), axis=(-2, -1), keepdims=True))
    # Division by (‖x‖ + ε) keeps a zero matrix at zero instead of producing NaN.
    X = (x_acc / (norm + eps)).astype(compute_dtype)
    if not schedule:
        return X.astype(out_dtype)

    tall = x.shape[-2] > x.shape[-1]
    # Gram matrix on the smaller side: A = XXᵀ (m × m) for wide, A = XᵀX (n × n) for tall.
    gram_spec = "...ik,...jk->...ij" if not tall else "...ki,...kj->...ij"
    # Apply B to the iterate from the side A lives on: BX for wide, XB for tall.
    apply_spec = "...ij,...jk->...ik"
    has_quintic = any(c != 0.0 for _, _, c in schedule)

    def mm(spec, lhs, rhs):
        return jnp.einsum(spec, lhs, rhs, precision=precision, preferred_element_type=acc_dtype)

    def plain_gram(X):
        return mm(gram_spec, X, X)

    def plain_square(A):
        return mm(apply_spec, A, A)

    gram, square = plain_gram, plain_square
    if min(x.shape[-2:]) >= SYMMETRIC_BLOCKS_MIN:
        h = min(x.shape[-2:]) // 2

        def blocks_gram(X):
            lo, hi = (X[..., :, :h], X[..., :, h:]) if tall else (X[..., :h, :], X[..., h:, :])
            return _symmetric(mm(gram_spec, lo, lo), mm(gram_spec, lo, hi), mm(gram_spec, hi, hi))

        def blocks_square(A):
            a11, a12, a22 = A[..., :h, :h], A[..., :h, h:], A[..., h:, h:]
            a21 = jnp.swapaxes(a12, -1, -2)
            return _symmetric(
                mm(apply_spec, a11, a11) + mm(apply_spec, a12, a21),
                mm(apply_spec, a11, a12) + mm(apply_spec, a12, a22),
                mm(apply_spec, a21, a12) + mm(apply_spec, a22, a22),
            )

        def gram(X):
            return jax.lax.platform_dependent(X, cpu=blocks_gram, default=plain_gram)

        def square(A):
            return jax.lax.platform_dependent(A, cpu=blocks_square, default=plain_square)

    def step(X, a, b, c):
        A = gram(X)
        if has_quintic:
            B = b * A + c * square(A.astype(compute_dtype))
        else:
            B = b * A
        B = B.astype(compute_dtype)
        BX = mm(apply_spec, X, B) if tall else mm(apply_spec, B, X)
        return (a * X.astype(acc_dtype) + BX).astype(compute_dtype)

    if len(schedule) <= _UNROLL_LIMIT:
        for a, b, c in schedule:
            X = step(X, a, b, c)
    else:
        table = jnp.asarray(np.asarray(schedule, dtype=np.float64), dtype=acc_dtype)
        X, _ = jax.lax.scan(lambda X, abc: (step(X, abc[0], abc[1], abc[2]), None), X, table)
    return X.astype(out_dtype)


def polar_factor_svd(x: jax.Array, *, precision: jax.lax.Precision | str | None = None):
    r"""The exact polar factor UVᵀ of each matrix in `x`, by SVD (FedMuon (Liu et al.) Alg. 2).

    .. math::
      x = U Σ V^\top \;\Rightarrow\; \text{polar}(x) = U_r V_r^\top,

    where r counts the singular values above max(m, n)·ε_mach·σ_max (NumPy's `matrix_rank`
    rule). For full-rank x this is UVᵀ; for a rank-deficient x the directions of its null space
    are dropped, which is the limit of every convergent Newton–Schulz preset (σ = 0 stays 0) and
    keeps a zero matrix at zero (a plain UVᵀ of a zero matrix is an arbitrary orthogonal
    matrix). The SVD runs in float32 (float64 for float64 input); bfloat16 input is upcast.

    Args:
      x: array `[..., m, n]` (rank ≥ 2).
      precision: precision of the U_r V_rᵀ product; None means `HIGHEST`.

    Returns:
      An array of the shape and (floating) dtype of `x`.
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"polar_factor_svd expects an array of rank >= 2, got shape {x.shape}.")
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise ValueError(f"polar_factor_svd got a complex array ({x.dtype}); real matrices only.")
    out_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    work = x.astype(jnp.promote_types(out_dtype, jnp.float32))
    u, s, vt = jnp.linalg.svd(work, full_matrices=False)
    tol = max(x.shape[-2:]) * jnp.finfo(work.dtype).eps * s[..., :1]
    keep = (s > tol).astype(work.dtype)
    precision = jax.lax.Precision.HIGHEST if precision is None else precision
    out = jnp.einsum("...ik,...kj->...ij", u * keep[..., None, :], vt, precision=precision)
    return out.astype(out_dtype)


def newton_schulz_flops(shape: Sequence[int], steps: int, *, quintic: bool = True) -> int:
    """Counts the FLOPs of `newton_schulz` on an array of `shape` (multiply-adds count 2).

    Per step on an m × n matrix with m = min of the two: 2·m·m·n for A, 2·m³ for A² (when
    `quintic`), 2·m·m·n for BX; the O(m·n) scalings and the norm are not counted.

    Args:
      shape: `[..., rows, cols]`.
      steps: number of iterations.
      quintic: whether the A² product runs (every preset except `"cubic"`).

    Returns:
      The FLOP count as a Python int.
    """
    *batch, rows, cols = shape
    m, n = min(rows, cols), max(rows, cols)
    per_step = 4 * m * m * n + (2 * m**3 if quintic else 0)
    return math.prod(batch) * steps * per_step
