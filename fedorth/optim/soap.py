"""SOAP: Shampoo's eigenbasis with Adam running inside it (Vyas et al. 2024, arXiv:2409.11321).

For a leaf with (possibly merged) axes ``d_1, ..., d_k`` SOAP keeps one factor per axis,
``GG_i = EMA_{β_s}(G_(i) G_(i)ᵀ)`` (``L = GGᵀ`` and ``R = GᵀG`` for a matrix), and the factors'
eigenbases ``Q_i``. One step, with ``P(X) = X ×_1 Q_1ᵀ ··· ×_k Q_kᵀ`` (``Q_Lᵀ G Q_R`` for a
matrix) and ``P⁻¹(X) = X ×_1 Q_1 ··· ×_k Q_k``::

    G' = P(G)                                      rotate into the eigenbasis
    m ← β₁ m + (1 − β₁) G',  v ← β₂ v + (1 − β₂) G'²   Adam moments, rotated basis
    u = √(1 − β₂ᵗ) / (1 − β₁ᵗ) · P⁻¹(m / (√v + ε))      the returned direction
    GG_i ← β_s GG_i + (1 − β_s) G_(i) G_(i)ᵀ            then, every f steps, refresh Q_i

The refresh is one power iteration and a QR, ``Q_i ← qr(GG_i Q_i[:, σ])`` with ``σ`` the columns
sorted by the estimated eigenvalues ``diag(Q_iᵀ GG_i Q_i)`` (descending), ``v`` permuted by ``σ``
along axis ``i`` and ``m`` moved into the new basis. The very first step only accumulates the
factors and builds ``Q_i`` by ``eigh`` (descending order) and returns a zero update, so the
current gradient never enters its own projection.

This follows the authors' reference ``soap.py`` (github nikhilvyas/SOAP) step for step; FedPAC (Liu
et al.)
Alg. 4 (Local SOAP) and Alg. 5 (FedPAC_SOAP) restate it. Choices where the reference is implicit:

* ``t`` in the bias correction is the reference's ``state["step"]``: the number of steps that
  made an update (the first, update-free call is not counted). The state keeps its own
  ``moment_count``, the number of calls since the moments were last zero, apart from ``count``
  (the schedule counter): the update-free call is the one with ``moment_count = 0``, and ``t`` is
  ``moment_count`` before the call. In a plain run ``moment_count = count``; FedPAC's Θ
  alignment restarts the moments (and ``moment_count``) each round while ``count`` runs on
  (:func:`soap_align_mask`), so each round starts with the update-free call, as every round of
  Local SOAP (whose whole state restarts) does: both take ``K − 1`` Adam steps per round. The
  refresh runs when ``count % precondition_frequency == 0`` on a call with an update, on the
  factors that already include the current gradient, as in the reference.
* The reference maps ``m`` back and forth through the same basis on steps without a refresh; that
  round trip is the identity (``Q`` is orthogonal) and is skipped here.
* ``eigh``/``qr`` run in ``promote(dtype, float32)``: low precision is upcast to float32 as in
  the reference; float64 is kept (the reference would downcast it to float32). The reference's
  retry of a failed ``eigh`` in float64 has no JAX counterpart (JAX returns NaNs instead of
  raising).
* All products use ``Precision.HIGHEST`` (the reference runs full float32 matmuls; JAX's default
  on GPU/TPU would use TF32/bfloat16 passes).
* With ``merge_dims`` the moments are stored in the merged shape (the state then describes its
  own layout); ``data_format`` (a PyTorch NHWC detail) is not needed for Flax kernels.

Numerics worth knowing (a property of the method, shared by the reference): a factor of an axis
longer than the other axes' product, e.g. ``L`` of a ``64 x 4`` kernel, or of a ``4096 x 384``
one for its first steps (rank <= batch size per step), is rank-deficient, and ``eigh`` may return
any orthonormal basis of its null space. New gradients do reach that null space, and Adam's
coordinate-wise ``m / (√v + ε)`` (a sign on the first step) then depends on which basis was
returned. The same holds, as for plain Adam, for any coordinate whose gradient is at rounding
level (e.g. a bias behind dead units). So rounding-level changes (another summation order,
``vmap`` instead of a loop) can move an update by up to ``±lr`` per coordinate: in a 2-client toy
CNN round (lr 0.1) the ``vmap`` and ``sequential`` strategies differ by up to 0.1 in some
weights, while the sharded round, which runs the same per-client code, agrees with the sequential
one to 1e-8 after one round (``tests/test_bench.py``). Compare SOAP runs across strategies or
machines by their curves, not bit for bit. ``max_precond_dim`` below such axes leaves them
unrotated, which makes the bases unique (up to sign, which cancels).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fedorth.optim import federated, linalg

PyTree = Any
_HIGHEST = lax.Precision.HIGHEST
# Bases this wide or wider rotate gradients by row-major GEMMs on CPU (`_rotate_leading`).
ROW_MAJOR_BASIS = 1024


class SoapState(NamedTuple):
    """State of :func:`scale_by_soap`.

    Per leaf, ``GG`` and ``Q`` hold a tuple with one entry per (merged) axis: a ``[d, d]`` factor
    and its eigenbasis, or ``None`` for an axis left unrotated (``d > max_precond_dim``, or a 1-D
    leaf without ``precondition_1d``). Federated averaging must average ``GG`` and rebuild ``Q``
    (:func:`average_soap_states`), never average ``Q``.
    """

    # Refreshed through fedorth.optim.linalg's host LAPACK calls on CPU (QR/eigh of GG):
    # read by linalg.state_refreshed_on_host.
    HOST_LAPACK = True

    count: jax.Array  # shape=(), int32: calls so far; shared schedule counter
    exp_avg: PyTree  # first moment, in the rotated basis (merged shape with merge_dims)
    exp_avg_sq: PyTree  # second moment, in the rotated basis
    GG: PyTree  # per leaf: tuple of factors [d, d] (L = GGᵀ, R = GᵀG) or None
    Q: PyTree  # per leaf: tuple of eigenbases [d, d] or None
    # shape=(), int32: calls since the moments were zero; the first of them is the update-free
    # one, so the t of the bias correction is moment_count before the call (= count in a plain
    # run; restarts with the moments each round under Theta alignment, soap_align_mask).
    moment_count: jax.Array


# ----------------------------------------------------------------------------- leaf layout


def _merged_shape(shape: tuple[int, ...], max_precond_dim: int) -> tuple[int, ...]:
    """Merges consecutive axes while their product stays <= max_precond_dim (reference rule)."""
    new_shape = []
    current = 1
    for size in shape:
        if current * size > max_precond_dim:
            if current > 1:
                new_shape.append(current)
                current = size
            else:
                new_shape.append(size)
                current = 1
        else:
            current *= size
    if current > 1 or not new_shape:
        new_shape.append(current)
    return tuple(new_shape)


def _layout(shape, *, max_precond_dim, merge_dims, precondition_1d):
    """Returns (working shape, tuple of bools: is each working axis rotated)."""
    shape = tuple(shape)
    if len(shape) == 1:
        return shape, (precondition_1d and shape[0] <= max_precond_dim,)
    work = _merged_shape(shape, max_precond_dim) if merge_dims else shape
    return work, tuple(size <= max_precond_dim for size in work)


# ----------------------------------------------------------------------------- linear algebra


def project(x: jax.Array, qs: tuple) -> jax.Array:
    """Rotates ``x`` (working shape) into the eigenbasis: ``x ×_1 Q_1ᵀ ··· ×_k Q_kᵀ``."""
    for q in qs:
        x = jnp.moveaxis(x, 0, -1) if q is None else _rotate_leading(x, q.astype(x.dtype), 0)
    return x


def project_back(x: jax.Array, qs: tuple) -> jax.Array:
    """Rotates ``x`` back to the original space: ``x ×_1 Q_1 ··· ×_k Q_k``."""
    for q in qs:
        x = jnp.moveaxis(x, 0, -1) if q is None else _rotate_leading(x, q.astype(x.dtype), 1)
    return x


def _rotate_leading(x: jax.Array, q: jax.Array, q_axis: int) -> jax.Array:
    """``tensordot(x, q, ((0,), (q_axis,)))``: contracts ``x``'s leading axis with ``q``'s rows
    (``q_axis = 0``, ``Qᵀ`` applied) or columns (``q_axis = 1``, ``Q`` applied); the new axis
    comes last.

    On CPU the product is formed as a plain row-major GEMM: ``x``'s rows ``[d, rest]`` are
    transposed into ``[rest, d]`` before ``@ Q`` (``q_axis = 0``), and ``Q @ [d, rest]`` is
    transposed after (``q_axis = 1``), each transpose kept as its own copy by
    ``lax.optimization_barrier`` (XLA would otherwise fold it back into the dot). XLA:CPU runs
    ``tensordot``'s transposed-operand GEMMs 2-3x slower: a ``[4096, 384]`` gradient rotated by a
    ``4096²`` basis took 160 / 270 ms (``Qᵀ`` / ``Q``) against 100 / 82 ms this way
    (docs/PERFORMANCE.md). The sums are the same products in another order, so the results
    differ from ``tensordot``'s in float rounding. Only for bases of at least
    :data:`ROW_MAJOR_BASIS` (1024) rows: below, the two forms were within ±20% of each other
    (``d = 128``-``384``), and ``tensordot`` is kept. Other backends keep ``tensordot``.
    """

    def default(x, q):
        return jnp.tensordot(x, q, axes=((0,), (q_axis,)), precision=_HIGHEST)

    if x.shape[0] < ROW_MAJOR_BASIS:
        return default(x, q)

    def cpu(x, q):
        rows = x.reshape(x.shape[0], -1)
        if q_axis == 0:
            out = jnp.dot(lax.optimization_barrier(rows.T), q, precision=_HIGHEST)
        else:
            out = lax.optimization_barrier(jnp.dot(q, rows, precision=_HIGHEST)).T
        return out.reshape(*x.shape[1:], q.shape[1 - q_axis])

    return lax.platform_dependent(x, q, cpu=cpu, default=default)


def _compute_dtype(*dtypes) -> jnp.dtype:
    """Arithmetic dtype: the promotion of ``dtypes`` with float32 (never below float32).

    Low-precision states are computed in float32 and stored back in their dtype: in float16,
    ``eps = 1e-8`` rounds to 0 and a zero rotated coordinate gave ``0 / (0 + 0) = NaN`` on the
    first real update (and ``G Gᵀ`` overflows float16 at gradient entries of order 10).
    """
    out = jnp.dtype(jnp.float32)
    for d in dtypes:
        out = jnp.promote_types(out, d)
    return out


def _state_dtype(param_dtype) -> jnp.dtype:
    """Default state dtype: the param's, except float32 for float16 params.

    A float16 second moment underflows: ``(1 − β₂) g²`` is below float16's smallest subnormal
    (6e-8) for ``|g| < 1e-3`` at β₂ = 0.95, while the first moment ``(1 − β₁) g`` is not, and
    ``m / (√0 + ε)`` is then ``m / 1e-8``. bfloat16 has float32's exponent range and is kept.
    """
    return jnp.dtype(jnp.float32) if jnp.dtype(param_dtype) == jnp.float16 else param_dtype


def _factor_update(g: jax.Array, ggs: tuple, shampoo_beta: float) -> tuple:
    """``GG_i ← GG_i + (1 − β_s)(G_(i) G_(i)ᵀ − GG_i)`` for every rotated axis (``lerp_``)."""
    out = []
    for axis, gg in enumerate(ggs):
        if gg is None:
            out.append(None)
            continue
        others = tuple(a for a in range(g.ndim) if a != axis)
        wide = g.astype(_compute_dtype(g.dtype, gg.dtype))
        outer = jnp.tensordot(wide, wide, axes=(others, others), precision=_HIGHEST)
        gg_new = gg + (1.0 - shampoo_beta) * (outer.astype(gg.dtype) - gg)
        out.append(gg_new.astype(gg.dtype))
    return tuple(out)


def eigenbasis(gg: jax.Array) -> jax.Array:
    """Eigenvectors of a factor, largest eigenvalue first (reference ``get_orthogonal_matrix``)."""
    compute = jnp.promote_types(gg.dtype, jnp.float32)
    m = gg.astype(compute)
    # The reference adds 1e-30·I before eigh; kept for bit-level fidelity on zero factors.
    _, q = linalg.eigh(m + 1e-30 * jnp.eye(m.shape[0], dtype=compute))
    return jnp.flip(q, axis=1).astype(gg.dtype)


def _copy(x):
    return None if x is None else jnp.copy(x)


def _eigenbases(ggs: tuple) -> tuple:
    return tuple(None if gg is None else eigenbasis(gg) for gg in ggs)


def _refresh(ggs: tuple, qs: tuple, exp_avg_sq: jax.Array) -> tuple[tuple, jax.Array]:
    """Power iteration + QR per axis, permuting ``exp_avg_sq`` (``get_orthogonal_matrix_QR``)."""
    new_qs = []
    for axis, (gg, q) in enumerate(zip(ggs, qs, strict=True)):
        if gg is None:
            new_qs.append(None)
            continue
        compute = jnp.promote_types(gg.dtype, jnp.float32)
        m, o = gg.astype(compute), q.astype(compute)
        mo = jnp.matmul(m, o, precision=_HIGHEST)
        estimated = jnp.sum(o * mo, axis=0)  # diag(oᵀ m o)
        order = jnp.argsort(estimated, descending=True)
        exp_avg_sq = jnp.take(exp_avg_sq, order, axis=axis)
        new_q, _ = linalg.qr(mo[:, order])  # m @ o[:, order]
        new_qs.append(new_q.astype(q.dtype))
    return tuple(new_qs), exp_avg_sq


# ----------------------------------------------------------------------------- transforms


def _branch(pred: jax.Array, true_fn, false_fn):
    """``lax.cond`` on a traced predicate; a Python branch on a concrete one (eager calls).

    The predicate is always a function of the shared counter, so under ``jit`` (and ``vmap`` with
    the counter unbatched) it stays a real branch; eagerly, a ``lax.cond`` would recompile its
    freshly traced branches on every call.
    """
    if isinstance(pred, jax.core.Tracer):
        return lax.cond(pred, true_fn, false_fn, None)
    return true_fn(None) if bool(pred) else false_fn(None)


_NOT_PARAMS = "not a params tree"


def _is_params_placeholder(params: Any) -> bool:
    """Whether ``init`` was called by ``optax.tree.map_params`` (its private placeholder node)."""
    return type(params).__name__ == "_ParamsPlaceholder"


def _is_number(value: Any) -> bool:
    """A Python number: arrays (e.g. from ``optax.inject_hyperparams``) are not validated."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_unit_interval(name: str, value: float) -> None:
    if _is_number(value) and not 0.0 <= value < 1.0:
        raise ValueError(f"scale_by_soap: {name}={value!r} must lie in [0, 1).")


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    *,
    shampoo_beta: float | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    dtype: Any = None,
) -> optax.GradientTransformation:
    r"""Rescales updates by SOAP: Adam in the eigenbasis of Shampoo's factors.

    .. math::
        G' = Q_L^\top G Q_R,\quad m \leftarrow \beta_1 m + (1-\beta_1) G',\quad
        v \leftarrow \beta_2 v + (1-\beta_2) G'^{2},\quad
        u = \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\, Q_L \frac{m}{\sqrt{v}+\epsilon} Q_R^\top

    then ``L ← β_s L + (1 − β_s) GGᵀ``, ``R ← β_s R + (1 − β_s) GᵀG`` and, every
    ``precondition_frequency`` steps, ``Q ← qr(L Q)`` (module docstring). The first call only
    builds ``L, R`` and ``Q = eigh(·)`` and returns zeros. Axes longer than ``max_precond_dim``
    stay unrotated; 1-D leaves get plain Adam unless ``precondition_1d``.

    Vyas et al. 2024, reference ``soap.py`` (github nikhilvyas/SOAP); FedPAC (Liu et al.) Alg. 4.

    Args:
      b1: Adam's first-moment decay, in [0, 1).
      b2: Adam's second-moment decay, in [0, 1).
      shampoo_beta: decay of the factors ``L, R``, in [0, 1); ``None`` uses ``b2``.
      eps: added to ``√v``.
      precondition_frequency: refresh the eigenbases every this many steps (>= 1).
      max_precond_dim: axes (after merging) longer than this are not rotated (>= 0).
      merge_dims: merge consecutive axes while their product is <= ``max_precond_dim``.
      precondition_1d: rotate 1-D leaves too (with a ``[d, d]`` factor).
      normalize_grads: divide each leaf's direction by its RMS (before the step size).
      correct_bias: apply Adam's bias correction ``√(1 − β₂ᵗ)/(1 − β₁ᵗ)``.
      dtype: dtype of the state (moments, factors, bases); ``None`` uses each param's dtype,
        float32 for float16 params (a float16 second moment underflows). The arithmetic runs in
        at least float32 whatever the state's dtype (``ε`` would round to 0 in float16).

    Returns:
      An ``optax.GradientTransformation`` with :class:`SoapState`. Its direction is not scaled by
      a learning rate (chain with ``optax.scale_by_learning_rate``).
    """
    _check_unit_interval("b1", b1)
    _check_unit_interval("b2", b2)
    if shampoo_beta is None:
        shampoo_beta = b2
    _check_unit_interval("shampoo_beta", shampoo_beta)
    if _is_number(eps) and not eps >= 0.0:
        raise ValueError(f"scale_by_soap: eps={eps!r} must be >= 0.")
    if (
        isinstance(precondition_frequency, bool)
        or not isinstance(precondition_frequency, int)
        or precondition_frequency < 1
    ):
        raise ValueError(
            f"scale_by_soap: precondition_frequency={precondition_frequency!r} must be an int >= 1."
        )
    if (
        isinstance(max_precond_dim, bool)
        or not isinstance(max_precond_dim, int)
        or max_precond_dim < 0
    ):
        raise ValueError(f"scale_by_soap: max_precond_dim={max_precond_dim!r} must be an int >= 0.")
    if dtype is not None:
        dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"scale_by_soap: dtype={dtype} must be a floating dtype or None.")
    layout = lambda shape: _layout(
        shape,
        max_precond_dim=max_precond_dim,
        merge_dims=merge_dims,
        precondition_1d=precondition_1d,
    )

    def init_fn(params):
        if _is_params_placeholder(params):
            # optax.tree.map_params: the moments are trees like the params; the factors and
            # bases (a tuple per leaf, one entry per axis) are not, so they become leaves here
            # and map_params passes them to `transform_non_params` (or keeps them).
            return SoapState(
                count=jnp.zeros([], jnp.int32),
                exp_avg=params,
                exp_avg_sq=params,
                GG=_NOT_PARAMS,
                Q=_NOT_PARAMS,
                moment_count=jnp.zeros([], jnp.int32),
            )
        leaves, treedef = jax.tree.flatten(params)
        moments, factors = [], []
        for p in leaves:
            work, rotated = layout(p.shape)
            state_dtype = _state_dtype(p.dtype) if dtype is None else dtype
            moments.append(jnp.zeros(work, state_dtype))
            factors.append(
                tuple(
                    jnp.zeros((d, d), state_dtype) if r else None
                    for d, r in zip(work, rotated, strict=True)
                )
            )
        return SoapState(
            count=jnp.zeros([], jnp.int32),
            exp_avg=treedef.unflatten(moments),
            exp_avg_sq=treedef.unflatten([jnp.zeros_like(m) for m in moments]),
            GG=treedef.unflatten(factors),
            # Placeholder bases until the first step builds them from the factors.
            Q=treedef.unflatten([tuple(_copy(f) for f in fs) for fs in factors]),
            moment_count=jnp.zeros([], jnp.int32),
        )

    def update_fn(updates, state, params=None):
        del params
        count = state.count
        # Calls since the moments were zero: the first (0) is update-free; then t of the bias
        # correction is this count (the update-free call is not an Adam step).
        step = state.moment_count
        grads, treedef = jax.tree.flatten(updates)
        mus = treedef.flatten_up_to(state.exp_avg)
        nus = treedef.flatten_up_to(state.exp_avg_sq)
        ggs = treedef.flatten_up_to(state.GG)
        qs = treedef.flatten_up_to(state.Q)
        # Gradients in the working (merged) shape of each leaf.
        works = [g.reshape(mu.shape) for g, mu in zip(grads, mus, strict=True)]

        def first_step(_):
            # Reference: accumulate L/R, build Q by eigh, make no update.
            new_ggs = [
                _factor_update(w, gg, shampoo_beta) for w, gg in zip(works, ggs, strict=True)
            ]
            new_qs = [_eigenbases(gg) for gg in new_ggs]
            zeros = [jnp.zeros_like(g) for g in grads]
            return zeros, mus, nus, new_ggs, new_qs, optax.safe_increment(step)

        def later_step(_):
            directions, new_mus, new_nus, new_ggs = [], [], [], []
            for g, w, mu, nu, gg, q in zip(grads, works, mus, nus, ggs, qs, strict=True):
                state_dtype = mu.dtype
                compute = _compute_dtype(g.dtype, state_dtype)
                g_rot = project(w.astype(compute), q)
                mu = b1 * mu.astype(compute) + (1.0 - b1) * g_rot
                nu = b2 * nu.astype(compute) + (1.0 - b2) * jnp.square(g_rot)
                direction = project_back(mu / (jnp.sqrt(nu) + eps), q)
                if normalize_grads:
                    direction = direction / (1e-30 + jnp.sqrt(jnp.mean(jnp.square(direction))))
                if correct_bias:
                    t = step.astype(compute)
                    direction = direction * (jnp.sqrt(1.0 - b2**t) / (1.0 - b1**t))
                directions.append(direction.reshape(g.shape).astype(g.dtype))
                new_mus.append(mu.astype(state_dtype))
                new_nus.append(nu.astype(state_dtype))
                new_ggs.append(_factor_update(w, gg, shampoo_beta))

            def refresh(_):
                out_mus, out_nus, out_qs = [], [], []
                for mu, nu, gg, q in zip(new_mus, new_nus, new_ggs, qs, strict=True):
                    mu_original = project_back(mu, q)
                    new_q, nu = _refresh(gg, q, nu)
                    out_mus.append(project(mu_original, new_q).astype(mu.dtype))
                    out_nus.append(nu)
                    out_qs.append(new_q)
                return out_mus, out_nus, out_qs

            def keep(_):
                return new_mus, new_nus, qs

            due = count % precondition_frequency == 0
            out_mus, out_nus, out_qs = _branch(due, refresh, keep)
            return directions, out_mus, out_nus, new_ggs, out_qs, optax.safe_increment(step)

        directions, mus, nus, ggs, qs, moment_count = _branch(step == 0, first_step, later_step)
        new_state = SoapState(
            count=optax.safe_increment(count),
            exp_avg=treedef.unflatten(mus),
            exp_avg_sq=treedef.unflatten(nus),
            GG=treedef.unflatten(ggs),
            Q=treedef.unflatten(qs),
            moment_count=moment_count,
        )
        return treedef.unflatten(directions), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def soap(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.95,
    b2: float = 0.95,
    *,
    weight_decay: float = 0.01,
    mask: Any = None,
    shampoo_beta: float | None = None,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    correct_bias: bool = True,
    dtype: Any = None,
) -> optax.GradientTransformation:
    r"""SOAP with decoupled weight decay: ``x ← x − η (u_SOAP + λ x)``.

    ``optax.chain(scale_by_soap(...), optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate))``. The decay is multiplied by the learning rate,
    as in the reference (``p ← p − lr·wd·p``). Two differences from the reference, both of order
    ``η·λ``: the reference decays the already-updated weights (``p − η u``; the difference is
    ``η²·λ·u``), and it skips the decay on its update-free first step, where this chain decays.

    Vyas et al. 2024, reference ``soap.py``; FedPAC (Liu et al.) Alg. 4 and Tables 8–10 (lr 3e-3,
    betas (0.95, 0.95), weight decay 0.01).

    Args:
      learning_rate: a scalar or an optax schedule.
      b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim, merge_dims,
        precondition_1d, normalize_grads, correct_bias, dtype: as in :func:`scale_by_soap`.
      weight_decay: decoupled weight decay ``λ`` (>= 0).
      mask: a pytree of bools or a callable, as in ``optax.add_decayed_weights``.

    With ``optax.inject_hyperparams(soap, static_args=("precondition_frequency",
    "max_precond_dim"))`` the float hyperparameters (learning rate, betas, eps, weight decay) can
    be changed inside the state; injected values are not range-checked.

    Returns:
      An ``optax.GradientTransformation`` whose first state is a :class:`SoapState`.
    """
    if _is_number(weight_decay) and not weight_decay >= 0.0:
        raise ValueError(f"soap: weight_decay={weight_decay!r} must be >= 0.")
    return optax.chain(
        scale_by_soap(
            b1,
            b2,
            shampoo_beta=shampoo_beta,
            eps=eps,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            merge_dims=merge_dims,
            precondition_1d=precondition_1d,
            normalize_grads=normalize_grads,
            correct_bias=correct_bias,
            dtype=dtype,
        ),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


# ----------------------------------------------------------------------------- federated


def average_soap_states(state_C: SoapState, mask: SoapState | None = None) -> SoapState:
    r"""Averages client SOAP states over the leading client axis (FedPAC_SOAP alignment).

    .. math::
        \bar{GG}_i = \tfrac{1}{C}\textstyle\sum_c GG_i^{(c)},\quad
        \bar Q_i = \mathrm{eigh}(\bar{GG}_i),\quad
        \bar m = \bar P\big(\tfrac{1}{C}\textstyle\sum_c P_c^{-1}(m^{(c)})\big),\quad
        \bar v = \tfrac{1}{C}\textstyle\sum_c v^{(c)}

    The factors (``Θ = {L, R}`` of FedPAC (Liu et al.) §3.2) are averaged and the eigenbases
    rebuilt from them as at initialization (descending eigenvalues), never averaged: clients do
    not send ``Q`` (:func:`soap_upload_mask`), and the ``_light`` upload never truncates it. The
    first moment is averaged in the original space, ``P_c⁻¹(m_c)`` (what a client sends; formed
    here from the client's own exact ``Q_c``), and rotated into the new basis. The second moment
    is averaged as is, which is an approximation: it lives in each client's basis, but clients
    start a round from the same (server) basis and their bases differ only by the refreshes made
    during the round, each sorted by decreasing eigenvalue like the rebuilt basis.

    FedPAC (Liu et al.) Alg. 5 (FedPAC_SOAP) with the alignment step of Alg. 2 line 16. With
    FedPAC's default Θ alignment (:func:`soap_align_mask`) only the factors (and ``count``)
    reach the clients; the rebuilt bases and the averaged moments matter for
    ``fed.options.aligned="state"`` (the whole state, a fedorth extension).

    Under Θ alignment (``mask``: :func:`soap_align_mask`, the factors and ``count``) no client
    reads the server's bases or moments: each client's round opens with the update-free call,
    which rebuilds ``Q`` from the aligned factors plus its first gradient, and restarts ``m, v``.
    They are then not computed and hold ``init``'s zeros: no ``eigh`` of the averaged factors,
    no rotation of the moments (one ``eigh`` per factor and round fewer than with the whole
    state; docs/FIDELITY.md).

    Args:
      state_C: a :class:`SoapState` whose array leaves carry a leading client axis; ``count`` and
        ``moment_count`` may be shared scalars or stacked (then client 0's are taken).
      mask: ``None`` (the whole state), or a :class:`SoapState` of bools: the fields the result
        must hold (``federated.average_states``); ``Q``, ``exp_avg`` and ``exp_avg_sq`` are
        computed only where some of their leaves are selected, else zeros.

    Returns:
      The server's :class:`SoapState`, without the client axis.
    """
    shared = lambda c: c if c.ndim == 0 else c[0]  # noqa: E731
    treedef = jax.tree.structure(state_C.exp_avg)
    mean = federated.mean_over_clients  # jnp.mean(x, axis=0), fast on XLA:CPU too
    zeros = lambda x: jnp.zeros(x.shape[1:], x.dtype)  # noqa: E731  (init's, per client)

    def needed(field: str) -> bool:
        return mask is None or any(jax.tree.leaves(getattr(mask, field)))

    mus_C = treedef.flatten_up_to(state_C.exp_avg)
    qs_C = treedef.flatten_up_to(state_C.Q)
    ggs = [
        tuple(None if f is None else mean(f) for f in fs)
        for fs in treedef.flatten_up_to(state_C.GG)
    ]
    if needed("Q") or needed("exp_avg"):
        qs = [_eigenbases(gg) for gg in ggs]
    else:
        qs = [tuple(None if q is None else zeros(q) for q in q_C) for q_C in qs_C]
    mus = []
    for mu_C, q_C, q in zip(mus_C, qs_C, qs, strict=True):
        if needed("exp_avg"):
            original_C = jax.vmap(project_back)(mu_C, q_C)
            mus.append(project(mean(original_C), q).astype(mu_C.dtype))
        else:
            mus.append(zeros(mu_C))
    return SoapState(
        count=shared(state_C.count),
        exp_avg=treedef.unflatten(mus),
        exp_avg_sq=jax.tree.map(mean if needed("exp_avg_sq") else zeros, state_C.exp_avg_sq),
        GG=treedef.unflatten(ggs),
        Q=treedef.unflatten(qs),
        moment_count=shared(state_C.moment_count),
    )


def _soap_mask(
    state: SoapState,
    *,
    count: bool = False,
    moments: bool = False,
    factors: bool = False,
    bases: bool = False,
) -> SoapState:
    """A ``SoapState`` of bools: ``count``, the moments ``m, v``, the factors ``L, R`` (``GG``),
    the bases ``Q``; ``moment_count`` is never selected (it restarts with the moments)."""
    fill = lambda tree, value: jax.tree.map(lambda _: value, tree)  # noqa: E731
    return SoapState(
        count=count,
        exp_avg=fill(state.exp_avg, moments),
        exp_avg_sq=fill(state.exp_avg_sq, moments),
        GG=fill(state.GG, factors),
        Q=fill(state.Q, bases),
        moment_count=False,
    )


def soap_upload_mask(state: SoapState) -> SoapState:
    """What a SOAP client can upload: the factors ``L, R`` and the moments, never ``Q``.

    FedPAC_SOAP uploads the part of this that it aligns: ``L, R`` by default
    (:func:`soap_align_mask`), the moments too with ``fed.options.aligned="state"``.

    The eigenbases are rebuilt from the averaged factors (by the server with the whole state,
    :func:`average_soap_states`, by each client's update-free call under Θ alignment), so ``Q``
    is neither sent nor low-rank compressed by the ``_light`` upload: a truncated ``Q``
    is no longer orthogonal, and rotating a moment with it loses it (FedPAC (Liu et al.) Alg. 5;
    Table 6's FedPAC_SOAP_light uploads the preconditioner by SVD, and the preconditioner is
    ``Θ = {L, R}``, §3.2). The first moment enters the average through ``P_c⁻¹(m_c)``, the
    moment in the original coordinates, which the client can compute and send instead of ``m_c``
    in its own basis (same size); the engine keeps ``m_c`` and the client's ``Q_c`` in the stacked
    state only to form ``P_c⁻¹(m_c)`` on the server side. A rank-k truncation commutes with
    orthogonal rotations of the rows and columns of the matrix view (``compress.matrix_view``:
    the rows of a ``(d_1, ..., d_k)`` leaf are rotated by ``Q_1 ⊗ ··· ⊗ Q_{k−1}``), so
    compressing ``m_c`` and rotating it back with the exact ``Q_c`` is compressing ``P_c⁻¹(m_c)``.
    """
    return _soap_mask(state, moments=True, factors=True)


def soap_theta_mask(state: SoapState) -> SoapState:
    """SOAP's preconditioner state ``Θ = {L, R}`` (FedPAC (Liu et al.) §3.2): the factors ``GG``.

    Not ``Q`` (its columns' signs, and their order inside ties, are arbitrary), nor the moments
    (stored in each client's own basis).
    """
    return _soap_mask(state, factors=True)


def soap_align_mask(state: SoapState) -> SoapState:
    """What FedPAC_SOAP's Θ alignment warm-starts from the server (FedPAC (Liu et al.) Alg. 2).

    The server's average of ``Θ = {L, R}`` (line 16; clients upload ``GG`` only, ``Q`` is never
    sent), and ``count``, the shared schedule counter, so that the basis refresh runs every
    ``precondition_frequency`` steps of the whole training (``(rK + k) mod f``, as Alg. 9 line 9
    counts Sophia's Hessian refresh).

    Not the Adam moments ``m, v`` (not in ``Θ``; they restart from zero each round, as in Local
    SOAP, FedPAC being Local-X plus alignment and correction) and, with them, ``moment_count``:
    each round starts, as a fresh SOAP and every round of Local SOAP do, with the reference's
    update-free call, which adds the round's first gradient to the aligned ``L, R`` and rebuilds
    ``Q`` from them by ``eigh`` (the authors' ``main_FedPAC.py`` does this on every round's first
    step, for Local SOAP and FedPAC_SOAP alike; Alg. 4/5 have no update-free step). Both methods
    take ``K − 1`` Adam steps per round, and the bias correction ``√(1 − β₂ᵗ)/(1 − β₁ᵗ)`` counts
    ``t`` from the round's second step.

    Nor ``Q``: that call replaces it before any use, so a basis the server rebuilt from the
    averaged factors (``Q`` is a function of ``Θ``, §3.2's ``P_Θ``) would reach no parameter.
    The server's average then skips it (:func:`average_soap_states` with this mask): one
    ``eigh`` per factor and round fewer, the same parameters.
    """
    return _soap_mask(state, count=True, factors=True)


federated.register_average(
    SoapState,
    average_soap_states,
    upload_mask=soap_upload_mask,
    theta_mask=soap_theta_mask,
    align_mask=soap_align_mask,
    partial=True,
)

__all__ = [
    "SoapState",
    "average_soap_states",
    "eigenbasis",
    "project",
    "project_back",
    "scale_by_soap",
    "soap",
    "soap_align_mask",
    "soap_theta_mask",
    "soap_upload_mask",
]
