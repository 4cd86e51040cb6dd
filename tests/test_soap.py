"""Tests for fedorth.optim.soap against a float64 NumPy port of the authors' reference.

`RefSOAP` below re-implements github nikhilvyas/SOAP `soap.py` (Vyas et al. 2024) in NumPy,
method by method (init_preconditioner, project, update_preconditioner, project_back,
get_orthogonal_matrix, get_orthogonal_matrix_QR, merge_dims), in float64 throughout.

Eigenvector ambiguity. SOAP's trajectory does not depend on the signs of the basis vectors (Adam
is elementwise and each coordinate is rotated in and out with the same vector), nor on their
order inside a block of equal eigenvalues whose eigenvectors are coordinate axes (Adam is
permutation-equivariant, and the first refresh sorts the columns). It does depend on which
orthonormal basis `eigh` returns inside a degenerate eigenspace. So every factor here is either
generic and full rank at the first step (distinct eigenvalues), or the first gradient has zero
rows/columns, which makes the factor block diagonal with an exactly zero block whose eigenvectors
are coordinate axes for any LAPACK `eigh`; and every factor is full rank by the first refresh
(QR of a rank-deficient product would be ambiguous too). Under these conditions NumPy's and
XLA's LAPACK give the same trajectory up to rounding.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optim_battery as battery
import pytest
from helpers import equations, fast_jit

from fedorth.optim import SoapState, average_soap_states, federated, scale_by_soap, soap
from fedorth.optim.soap import eigenbasis, project, project_back

# float64 vs float64: the two implementations differ only in summation order (NumPy vs XLA)
# amplified by eigenvector conditioning (1/eigengap) over tens of steps.
RTOL, ATOL = 1e-9, 1e-11


# --------------------------------------------------------------------------------------
# Float64 NumPy port of the reference optimizer (one param list, one param group).


class RefSOAP:
    def __init__(
        self,
        params,
        lr=3e-3,
        betas=(0.95, 0.95),
        shampoo_beta=-1,
        eps=1e-8,
        weight_decay=0.01,
        precondition_frequency=10,
        max_precond_dim=10000,
        merge_dims=False,
        precondition_1d=False,
        normalize_grads=False,
        correct_bias=True,
    ):
        self.params = [np.array(p, np.float64) for p in params]
        self.group = dict(
            lr=lr,
            betas=betas,
            shampoo_beta=shampoo_beta,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            merge_dims=merge_dims,
            precondition_1d=precondition_1d,
            normalize_grads=normalize_grads,
            correct_bias=correct_bias,
        )
        self.state = [{} for _ in self.params]

    @staticmethod
    def merge_dims_fn(grad, max_precond_dim):
        new_shape, curr_shape = [], 1
        for sh in grad.shape:
            temp_shape = curr_shape * sh
            if temp_shape > max_precond_dim:
                if curr_shape > 1:
                    new_shape.append(curr_shape)
                    curr_shape = sh
                else:
                    new_shape.append(sh)
                    curr_shape = 1
            else:
                curr_shape = temp_shape
        if curr_shape > 1 or len(new_shape) == 0:
            new_shape.append(curr_shape)
        return grad.reshape(new_shape)

    def step(self, grads):
        group = self.group
        for i, grad in enumerate(grads):
            grad = np.asarray(grad, np.float64)
            p, state = self.params[i], self.state[i]
            if "step" not in state:
                state["step"] = 0
            if "exp_avg" not in state:
                state["exp_avg"] = np.zeros_like(grad)
                state["exp_avg_sq"] = np.zeros_like(grad)
            if "Q" not in state:
                sb = group["shampoo_beta"] if group["shampoo_beta"] >= 0 else group["betas"][1]
                self.init_preconditioner(grad, state, group["precondition_frequency"], sb)
                self.update_preconditioner(grad, state)
                continue
            grad_projected = self.project(grad, state)
            beta1, beta2 = group["betas"]
            state["step"] += 1
            state["exp_avg"] = state["exp_avg"] * beta1 + (1.0 - beta1) * grad_projected
            state["exp_avg_sq"] = state["exp_avg_sq"] * beta2 + (1.0 - beta2) * grad_projected**2
            denom = np.sqrt(state["exp_avg_sq"]) + group["eps"]
            step_size = group["lr"]
            if group["correct_bias"]:
                bias_correction1 = 1.0 - beta1 ** state["step"]
                bias_correction2 = 1.0 - beta2 ** state["step"]
                step_size = step_size * bias_correction2**0.5 / bias_correction1
            norm_grad = self.project_back(state["exp_avg"] / denom, state)
            if group["normalize_grads"]:
                norm_grad = norm_grad / (1e-30 + np.mean(norm_grad**2) ** 0.5)
            p = p - step_size * norm_grad
            if group["weight_decay"] > 0.0:
                p = p - group["lr"] * group["weight_decay"] * p
            self.params[i] = p
            self.update_preconditioner(grad, state)
        return self.params

    def init_preconditioner(self, grad, state, precondition_frequency, shampoo_beta):
        group = self.group
        state["GG"] = []
        if grad.ndim == 1:
            if not group["precondition_1d"] or grad.shape[0] > group["max_precond_dim"]:
                state["GG"].append([])
            else:
                state["GG"].append(np.zeros((grad.shape[0], grad.shape[0])))
        else:
            if group["merge_dims"]:
                grad = self.merge_dims_fn(grad, group["max_precond_dim"])
            for sh in grad.shape:
                if sh > group["max_precond_dim"]:
                    state["GG"].append([])
                else:
                    state["GG"].append(np.zeros((sh, sh)))
        state["Q"] = None
        state["precondition_frequency"] = precondition_frequency
        state["shampoo_beta"] = shampoo_beta

    def _rotate(self, grad, state, contract):
        original_shape = grad.shape
        if self.group["merge_dims"]:
            grad = self.merge_dims_fn(grad, self.group["max_precond_dim"])
        for mat in state["Q"]:
            if len(mat) > 0:
                grad = np.tensordot(grad, mat, axes=([0], [contract]))
            else:
                grad = np.transpose(grad, list(range(1, grad.ndim)) + [0])
        if self.group["merge_dims"]:
            grad = grad.reshape(original_shape)
        return grad

    def project(self, grad, state):
        return self._rotate(grad, state, 0)

    def project_back(self, grad, state):
        return self._rotate(grad, state, 1)

    def update_preconditioner(self, grad, state):
        group = self.group
        if state["Q"] is not None:
            state["exp_avg"] = self.project_back(state["exp_avg"], state)
        w = 1 - state["shampoo_beta"]
        if grad.ndim == 1:
            if group["precondition_1d"] and grad.shape[0] <= group["max_precond_dim"]:
                gg = state["GG"][0]
                state["GG"][0] = gg + w * (np.outer(grad, grad) - gg)
        else:
            new_grad = grad
            if group["merge_dims"]:
                new_grad = self.merge_dims_fn(grad, group["max_precond_dim"])
            for idx, sh in enumerate(new_grad.shape):
                if sh <= group["max_precond_dim"]:
                    others = [*itertools.chain(range(idx), range(idx + 1, new_grad.ndim))]
                    outer = np.tensordot(new_grad, new_grad, axes=[others, others])
                    gg = state["GG"][idx]
                    state["GG"][idx] = gg + w * (outer - gg)
        if state["Q"] is None:
            state["Q"] = self.get_orthogonal_matrix(state["GG"])
        if state["step"] > 0 and state["step"] % state["precondition_frequency"] == 0:
            state["Q"] = self.get_orthogonal_matrix_QR(state)
        if state["step"] > 0:
            state["exp_avg"] = self.project(state["exp_avg"], state)

    @staticmethod
    def get_orthogonal_matrix(mats):
        final = []
        for m in mats:
            if len(m) == 0:
                final.append([])
                continue
            _, q = np.linalg.eigh(m + 1e-30 * np.eye(m.shape[0]))
            final.append(np.flip(q, 1))
        return final

    def get_orthogonal_matrix_QR(self, state):
        orig_shape = state["exp_avg_sq"].shape
        exp_avg_sq = state["exp_avg_sq"]
        if self.group["merge_dims"]:
            exp_avg_sq = self.merge_dims_fn(exp_avg_sq, self.group["max_precond_dim"])
        final = []
        for ind, (m, o) in enumerate(zip(state["GG"], state["Q"], strict=True)):
            if len(m) == 0:
                final.append([])
                continue
            est_eig = np.diag(o.T @ m @ o)
            sort_idx = np.argsort(-est_eig, kind="stable")
            exp_avg_sq = np.take(exp_avg_sq, sort_idx, axis=ind)
            o = o[:, sort_idx]
            q, _ = np.linalg.qr(m @ o)
            final.append(q)
        state["exp_avg_sq"] = exp_avg_sq.reshape(orig_shape)
        return final


# --------------------------------------------------------------------------------------
# Gradient sequences (see the module docstring for why some first gradients have zero blocks).


def gradient_sequence(seed, shapes, steps, *, zero_rows=None, zero_cols=None, one_hot=()):
    """`steps` dicts of float64 Gaussian gradients. For the first gradient: rows >= zero_rows[k]
    (columns >= zero_cols[k]) of leaf k are zeroed, and leaves in `one_hot` keep one entry."""
    rng = np.random.default_rng(seed)
    seq = [{k: rng.normal(size=s) for k, s in shapes.items()} for _ in range(steps)]
    for k, r in (zero_rows or {}).items():
        seq[0][k][r:] = 0.0
    for k, c in (zero_cols or {}).items():
        seq[0][k][:, c:] = 0.0
    for k in one_hot:
        keep = seq[0][k][1]
        seq[0][k][:] = 0.0
        seq[0][k][1] = keep
    return seq


CASES = {
    # name: (shapes, kwargs, first-gradient structure). 24 steps; refreshes at counts f, 2f, ...
    "square_tall_wide_3d_1d_scalar": (
        {"sq": (5, 5), "tall": (7, 4), "wide": (4, 7), "t3": (3, 4, 2), "vec": (6,), "s": ()},
        dict(precondition_frequency=3),
        dict(zero_rows={"tall": 4}, zero_cols={"wide": 4}),
    ),
    "one_sided": (
        {"tall": (10, 3), "wide": (3, 10), "vec": (12,)},
        dict(precondition_frequency=4, max_precond_dim=8, b1=0.9, b2=0.99),
        {},
    ),
    "precondition_1d": (
        {"v4": (4,), "v9": (9,), "m": (3, 3)},
        dict(precondition_frequency=3, max_precond_dim=8, precondition_1d=True),
        dict(one_hot=("v4",)),
    ),
    "merge_dims": (
        # (2, 2, 5) merges to (4, 5) with max 4: a rotated 4 side and an unrotated 5 side; a
        # scalar merges to (1,) with a 1x1 factor; (3, 2) merges to (6,) > 4: unrotated.
        {"k": (2, 2, 5), "s": (), "m": (3, 2)},
        dict(precondition_frequency=2, max_precond_dim=4, merge_dims=True),
        {},
    ),
    "flags": (
        {"sq": (4, 4), "tall": (6, 3), "vec": (5,)},
        dict(
            precondition_frequency=1,
            shampoo_beta=0.8,
            b1=0.5,
            b2=0.9,
            eps=1e-3,
            normalize_grads=True,
            correct_bias=False,
        ),
        dict(zero_rows={"tall": 3}),
    ),
}


def ref_kwargs(kwargs):
    out = dict(kwargs)
    out["betas"] = (out.pop("b1", 0.95), out.pop("b2", 0.95))
    if out.get("shampoo_beta") is None:
        out["shampoo_beta"] = -1
    return out


def run_both(shapes, kwargs, structure, steps=24, seed=0):
    """Feeds the same gradients to scale_by_soap (x64, jitted) and RefSOAP (lr=1, no decay)."""
    grads = gradient_sequence(seed, shapes, steps, **structure)
    names = list(shapes)
    ref = RefSOAP(
        [np.zeros(shapes[k]) for k in names], lr=1.0, weight_decay=0.0, **ref_kwargs(kwargs)
    )
    tx = scale_by_soap(**kwargs)
    params = {k: jnp.zeros(s, jnp.float64) for k, s in shapes.items()}
    state = tx.init(params)
    update = fast_jit(tx.update)
    ours, theirs = [], []
    for g in grads:
        before = [p.copy() for p in ref.params]
        after = ref.step([g[k] for k in names])
        theirs.append({k: b - a for k, b, a in zip(names, before, after, strict=True)})
        u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state)
        ours.append(u)
    return ours, theirs, state, ref


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_step_for_step(x64, case):
    shapes, kwargs, structure = CASES[case]
    ours, theirs, state, ref = run_both(shapes, kwargs, structure)
    assert state.count.dtype == jnp.int32 and int(state.count) == len(ours)
    # moment_count counts the calls since the moments were zero, the update-free first one
    # included: the reference's step (the bias correction's t) is moment_count - 1 after it.
    assert state.moment_count.dtype == jnp.int32 and int(state.moment_count) == len(ours)
    for t, (u, r) in enumerate(zip(ours, theirs, strict=True)):
        for k in shapes:
            assert u[k].dtype == jnp.float64
            np.testing.assert_allclose(
                np.asarray(u[k]),
                r[k],
                rtol=RTOL,
                atol=ATOL,
                err_msg=f"{case}: leaf {k!r} at call {t} differs from the reference",
            )
    for i, k in enumerate(shapes):
        st = ref.state[i]
        ggs, qs = state.GG[k], state.Q[k]
        assert len(ggs) == len(st["GG"])
        for gg, gg_ref, q, q_ref in zip(ggs, st["GG"], qs, st["Q"], strict=True):
            if len(gg_ref) == 0:
                assert gg is None and q is None, f"{case}/{k}: expected an unrotated axis"
                continue
            # Factors are basis-free: compare directly.
            np.testing.assert_allclose(np.asarray(gg), gg_ref, rtol=RTOL, atol=ATOL)
            # Bases after a refresh are unique up to column signs.
            q = np.asarray(q)
            signs = np.sign(np.sum(q * q_ref, axis=0))
            np.testing.assert_allclose(q * signs, q_ref, rtol=0, atol=1e-8, err_msg=f"{case}/{k} Q")
        # First moment in the original space is basis-free; second moment is sign-free.
        mu = np.asarray(fast_jit(project_back)(state.exp_avg[k], qs)).reshape(shapes[k])
        mu_ref = ref.project_back(st["exp_avg"], st)
        np.testing.assert_allclose(mu, mu_ref, rtol=RTOL, atol=ATOL, err_msg=f"{case}/{k} m")
        np.testing.assert_allclose(
            np.asarray(state.exp_avg_sq[k]).reshape(shapes[k]),
            st["exp_avg_sq"],
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"{case}/{k} v",
        )


def test_first_step_builds_basis_and_makes_no_update():
    """Call 1: zero update, L = (1-β_s)GGᵀ, R = (1-β_s)GᵀG, Q diagonalizes them (descending)."""
    rng = np.random.default_rng(1)
    g = rng.normal(size=(5, 3)).astype(np.float32)
    tx = scale_by_soap(b2=0.9)
    state = tx.init({"w": jnp.zeros((5, 3))})
    u, state = fast_jit(tx.update)({"w": jnp.asarray(g)}, state)
    np.testing.assert_array_equal(np.asarray(u["w"]), 0.0, err_msg="first step must not update")
    np.testing.assert_array_equal(np.asarray(state.exp_avg["w"]), 0.0)
    np.testing.assert_array_equal(np.asarray(state.exp_avg_sq["w"]), 0.0)
    lhs, rhs = state.GG["w"]
    np.testing.assert_allclose(np.asarray(lhs), 0.1 * g @ g.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(rhs), 0.1 * g.T @ g, rtol=1e-5, atol=1e-6)
    for factor, q in zip(state.GG["w"], state.Q["w"], strict=True):
        factor, q = np.asarray(factor, np.float64), np.asarray(q, np.float64)
        np.testing.assert_allclose(q.T @ q, np.eye(len(q)), atol=1e-5, err_msg="Q not orthogonal")
        d = q.T @ factor @ q
        np.testing.assert_allclose(
            d, np.diag(np.diag(d)), atol=1e-5, err_msg="Q does not diagonalize"
        )
        assert np.all(np.diff(np.diag(d)) <= 1e-6), "eigenvalues must be in descending order"


def test_second_step_is_signed_adam_step_for_1d():
    """For a 1-D leaf (plain Adam) the reference's t is 1 on call 2: √(1−β₂)/(1−β₁)·
    (1−β₁)g/(√(1−β₂)|g| + ε) = g/(|g| + ε/√(1−β₂))."""
    g1, g2 = jnp.array([1.0, -2.0, 3.0]), jnp.array([0.5, -4.0, 1e-3])
    tx = scale_by_soap(b1=0.9, b2=0.99, eps=1e-8)
    state = tx.init({"b": jnp.zeros(3)})
    _, state = tx.update({"b": g1}, state)
    u, state = tx.update({"b": g2}, state)
    expected = np.asarray(g2) / (np.abs(np.asarray(g2)) + 1e-8 / np.sqrt(0.01))
    np.testing.assert_allclose(np.asarray(u["b"]), expected, rtol=1e-5)


def test_float32_and_bfloat16_state_track_float64_reference():
    """float32 params (default dtype) and a bfloat16 state follow the float64 reference within
    their precision; updates keep the params' dtype."""
    shapes = {"sq": (5, 5), "vec": (6,)}
    grads = gradient_sequence(2, shapes, 12)
    for dtype, tol in ((None, 2e-4), (jnp.bfloat16, 0.1)):
        tx = scale_by_soap(precondition_frequency=3, dtype=dtype)
        state = tx.init({k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()})
        ref = RefSOAP(
            [np.zeros(s) for s in shapes.values()],
            lr=1.0,
            weight_decay=0.0,
            precondition_frequency=3,
        )
        expected_dtype = jnp.float32 if dtype is None else dtype
        assert (
            state.GG["sq"][0].dtype == expected_dtype
            and state.exp_avg["vec"].dtype == expected_dtype
        )
        for t, g in enumerate(grads):
            before = [p.copy() for p in ref.params]
            after = ref.step(list(g.values()))
            u, state = fast_jit(tx.update)(
                {k: jnp.asarray(v, jnp.float32) for k, v in g.items()}, state
            )
            for (k, v), b, a in zip(u.items(), before, after, strict=True):
                assert v.dtype == jnp.float32
                # Directions are O(1); bfloat16 has 8 mantissa bits.
                np.testing.assert_allclose(np.asarray(v), b - a, atol=tol, err_msg=f"{k} step {t}")


# --------------------------------------------------------------------------------------
# soap(): decoupled weight decay multiplied by the learning rate.


def test_soap_equals_reference_without_decay_and_documented_decay_difference(x64):
    """soap(lr, weight_decay=0) equals the reference exactly; with decay, ours is
    x − lr(u + λx) while the reference decays after the step, (x − lr·u)(1 − lr·λ), and skips the
    first step entirely: the difference is lr²λu (lr·λ·x on call 1), an identity checked here."""
    shapes = {"w": (4, 3), "b": (3,)}
    names = list(shapes)
    grads = gradient_sequence(3, shapes, 8)
    lr, wd = 0.1, 0.3
    apply = fast_jit(optax.apply_updates)
    x = {k: jnp.asarray(np.random.default_rng(4).normal(size=s)) for k, s in shapes.items()}
    for decay in (0.0, wd):
        tx = soap(lr, weight_decay=decay, precondition_frequency=2)
        dir_tx = scale_by_soap(precondition_frequency=2)
        state, dir_state = tx.init(x), dir_tx.init(x)
        assert isinstance(state[0], SoapState)
        # Jitted (one program each, not op-by-op dispatch); float64 far above rounding.
        update, dir_update = fast_jit(tx.update), fast_jit(dir_tx.update)
        ref = RefSOAP(list(x.values()), lr=lr, weight_decay=decay, precondition_frequency=2)
        for t, g in enumerate(grads):
            gj = {k: jnp.asarray(v) for k, v in g.items()}
            ref.params = [np.asarray(x[k]) for k in names]  # the state ignores params
            ref_new = ref.step([g[k] for k in names])
            u, state = update(gj, state, x)
            d, dir_state = dir_update(gj, dir_state)
            new = apply(x, u)
            for k, r in zip(names, ref_new, strict=True):
                xk, dk = np.asarray(x[k]), np.asarray(d[k])
                np.testing.assert_allclose(
                    np.asarray(u[k]), -lr * (dk + decay * xk), rtol=1e-12, atol=1e-14
                )
                gap = lr * decay * xk if t == 0 else lr**2 * decay * dk
                np.testing.assert_allclose(
                    np.asarray(new[k]) + gap, r, rtol=RTOL, atol=ATOL, err_msg=f"{k} call {t}"
                )
            x = new


# --------------------------------------------------------------------------------------
# The shared battery, convergence, and the shared-counter branch.


def battery_inputs(seed=5, clients=2, steps=4):
    """Random float32 params/gradients, single and client-stacked. The shapes keep every factor
    full rank from the first step (square; one-sided (10, 3) with max_precond_dim 8; 1-D Adam):
    a rank-deficient factor's null-space basis is arbitrary, and jit/eager or batched/unbatched
    rounding may pick different ones, which legitimately changes SOAP's trajectory."""
    rng = np.random.default_rng(seed)
    shapes = {"w": (4, 4), "one": (10, 3), "b": (3,)}
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    params = {k: normal(*s) for k, s in shapes.items()}
    grads = [{k: normal(*s) for k, s in shapes.items()} for _ in range(steps)]
    params_C = {k: normal(clients, *s) for k, s in shapes.items()}
    grads_C = [{k: normal(clients, *s) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads, params_C, grads_C


def test_battery():
    """jit == eager, shapes/dtypes kept, traced once, vmap == loop (batched and shared counters),
    chain(clip_by_global_norm, soap) == soap on clipped gradients, inject_hyperparams; 4 calls
    cross a refresh (count 2)."""
    params, grads, params_C, grads_C = battery_inputs()
    # float32; the paths differ in rounding only (eigh/QR/matmul batched or fused differently).
    # soap() = chain(scale_by_soap, add_decayed_weights, scale_by_learning_rate) covers both.
    tx = soap(0.5, weight_decay=0.1, precondition_frequency=2, max_precond_dim=8)
    battery.run_battery(tx, params, grads, params_C, grads_C, rtol=1e-4, atol=1e-5)
    # learning_rate, b1, b2, eps, weight_decay injected; the integers that fix the program static.
    battery.check_inject_hyperparams(
        soap,
        dict(
            learning_rate=0.5,
            b1=0.9,
            b2=0.99,
            weight_decay=0.1,
            precondition_frequency=2,
            max_precond_dim=8,
        ),
        params,
        grads,
        static_args=("precondition_frequency", "max_precond_dim"),
        rtol=1e-4,
        atol=1e-5,
    )


def test_refresh_stays_a_real_branch_under_vmap_with_shared_count():
    """With `count` vmapped with in_axes=None the first-step and refresh conditionals stay
    `cond`s (a batched predicate would turn them into `select_n`, running eigh/QR every step)."""
    params, _, params_C, grads_C = battery_inputs()
    tx = scale_by_soap(precondition_frequency=3)
    axes = SoapState(count=None, exp_avg=0, exp_avg_sq=0, GG=0, Q=0, moment_count=None)
    state_C = jax.vmap(tx.init, out_axes=axes)(params_C)
    update = jax.vmap(tx.update, in_axes=(0, axes), out_axes=(0, axes))
    closed = jax.make_jaxpr(update)(grads_C[0], state_C)

    # fedorth.optim.linalg picks the host or native kernel with a `cond` on `platform_index`;
    # those are not schedule branches. Collect the other conds, at any nesting depth.
    def schedule_conds(jaxpr):
        produced_by = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
        found = []
        for e in jaxpr.eqns:
            if e.primitive.name == "cond":
                if produced_by.get(e.invars[0]) != "platform_index":
                    assert e.invars[0].aval.shape == (), "a batched predicate: not a real branch"
                    found.append(e)
                for branch in e.params["branches"]:
                    found += schedule_conds(branch.jaxpr)
        return found

    conds = schedule_conds(closed.jaxpr)
    assert len(conds) == 2, "expected the first-step and refresh conds to survive vmap"
    inner = " ".join(str(e.params["branches"]) for e in conds)
    assert "eigh[" in inner and "qr[" in inner, "eigh and QR expected inside the branches"


def test_converges_on_quadratic_and_rosenbrock():
    """SOAP with a cosine schedule reaches the minimum of ½‖W − W*‖² (W of shape (4, 3), a
    vector too) and of the row-wise Rosenbrock on a (2, 3) matrix (minimum 0 at W = 1)."""
    loss_fn, params, _ = battery.matrix_quadratic(jax.random.key(0), {"w": (4, 3), "b": (3,)})
    tx = soap(optax.cosine_decay_schedule(0.1, 400), weight_decay=0.0, precondition_frequency=5)
    battery.check_converges(tx, loss_fn, params, steps=400, threshold=1e-4)
    loss_fn, params = battery.matrix_rosenbrock((2, 3))
    tx = soap(optax.cosine_decay_schedule(0.02, 3000), weight_decay=0.0, precondition_frequency=5)
    battery.check_converges(tx, loss_fn, params, steps=3000, threshold=1e-3)


# --------------------------------------------------------------------------------------
# Server-side averaging (FedPAC_SOAP alignment).


def client_states(num_clients=3, steps=5, freq=2):
    """Client-stacked SOAP states after `steps` different gradients each (refreshes included)."""
    shapes = {"w": (5, 3), "one": (12, 3), "b": (4,)}
    tx = scale_by_soap(precondition_frequency=freq, max_precond_dim=8)
    rng = np.random.default_rng(7)
    axes = SoapState(count=None, exp_avg=0, exp_avg_sq=0, GG=0, Q=0, moment_count=None)
    params_C = {k: jnp.zeros((num_clients, *s), jnp.float64) for k, s in shapes.items()}
    state_C = jax.vmap(tx.init, out_axes=axes)(params_C)
    update = fast_jit(jax.vmap(tx.update, in_axes=(0, axes), out_axes=(0, axes)))
    for _ in range(steps):
        g_C = {k: jnp.asarray(rng.normal(size=(num_clients, *s))) for k, s in shapes.items()}
        _, state_C = update(g_C, state_C)
    return tx, shapes, state_C


def test_average_soap_states_rule(x64):
    """Averaged L/R = NumPy mean; new Q = eigh basis of the mean (orthogonal, diagonalizing,
    descending); m in the original space = mean of the clients' m mapped back with their own
    bases; v = mean; the count passes through; average_states dispatches to the rule."""
    _, shapes, state_C = client_states()
    avg = fast_jit(federated.average_states)(state_C)
    assert isinstance(avg, SoapState)
    assert int(avg.count) == int(state_C.count)
    assert int(avg.moment_count) == int(state_C.moment_count) == int(state_C.count)
    back = fast_jit(project_back)  # one program per leaf, not op-by-op dispatch
    for k in shapes:
        mu_back_C = [
            np.asarray(
                back(
                    state_C.exp_avg[k][c],
                    tuple(None if q is None else q[c] for q in state_C.Q[k]),
                )
            )
            for c in range(3)
        ]
        mu_back = np.asarray(back(avg.exp_avg[k], avg.Q[k]))
        np.testing.assert_allclose(mu_back, np.mean(mu_back_C, axis=0), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(
            np.asarray(avg.exp_avg_sq[k]),
            np.mean(np.asarray(state_C.exp_avg_sq[k]), axis=0),
            rtol=1e-14,
        )
        for gg_C, gg, q in zip(state_C.GG[k], avg.GG[k], avg.Q[k], strict=True):
            if gg_C is None:
                assert gg is None and q is None
                continue
            mean = np.mean(np.asarray(gg_C), axis=0)
            np.testing.assert_allclose(np.asarray(gg), mean, rtol=1e-14)
            q = np.asarray(q)
            np.testing.assert_allclose(q.T @ q, np.eye(len(q)), atol=1e-12)
            d = q.T @ mean @ q
            np.testing.assert_allclose(d, np.diag(np.diag(d)), atol=1e-12)
            assert np.all(np.diff(np.diag(d)) <= 1e-12), "eigenvalues must be descending"
    # The registered rule and the direct call agree; a stacked count is accepted too.
    direct = fast_jit(average_soap_states)(state_C._replace(count=jnp.full(3, state_C.count)))
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(avg), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-14)


def test_average_of_identical_states_preserves_the_direction(x64):
    """Averaging C copies of one state whose basis is the eigh basis of its factors gives back
    that state up to eigenvector signs: the next update from the averaged state equals the next
    update from the original one (basis-sign invariant)."""
    tx, shapes, state_C = client_states(steps=5, freq=100)
    first_client = lambda tree: jax.tree.map(lambda x: x[0], tree)
    # count and moment_count are shared
    one = SoapState(state_C.count, *map(first_client, state_C[1:-1]), state_C.moment_count)
    # Make Q the eigh basis of GG (as the rule rebuilds it), moving m with it.
    # Jitted: one program each instead of op-by-op dispatch.
    qs = {
        k: tuple(None if gg is None else fast_jit(eigenbasis)(gg) for gg in one.GG[k])
        for k in shapes
    }
    move = fast_jit(lambda m, q_old, q_new: project(project_back(m, q_old), q_new))
    mus = {k: move(one.exp_avg[k], one.Q[k], qs[k]) for k in shapes}
    one = one._replace(Q=qs, exp_avg=mus)
    stack = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * 4), tree)
    stacked = SoapState(one.count, *map(stack, one[1:-1]), one.moment_count)
    avg = fast_jit(average_soap_states)(stacked)
    for k in shapes:  # the rebuilt bases equal the original ones up to column signs
        for q_avg, q in zip(avg.Q[k], one.Q[k], strict=True):
            if q is not None:
                np.testing.assert_allclose(
                    np.abs(np.asarray(q_avg).T @ np.asarray(q)), np.eye(len(q)), atol=1e-8
                )
    g = {k: jnp.asarray(np.random.default_rng(8).normal(size=s)) for k, s in shapes.items()}
    update = fast_jit(tx.update)
    u_one, _ = update(g, one)
    u_avg, _ = update(g, avg)
    for k in shapes:
        np.testing.assert_allclose(
            np.asarray(u_avg[k]), np.asarray(u_one[k]), rtol=1e-9, atol=1e-11
        )
        for a, b in zip(avg.GG[k], one.GG[k], strict=True):
            if b is not None:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-14)


# --------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(b1=1.0), "b1=1.0"),
        (dict(b1=-0.1), "b1=-0.1"),
        (dict(b2=1.5), "b2=1.5"),
        (dict(shampoo_beta=1.0), "shampoo_beta=1.0"),
        (dict(eps=-1e-8), "eps=-1e-08"),
        (dict(precondition_frequency=0), "precondition_frequency=0"),
        (dict(precondition_frequency=-3), "precondition_frequency=-3"),
        (dict(precondition_frequency=2.5), "precondition_frequency=2.5"),
        (dict(max_precond_dim=-1), "max_precond_dim=-1"),
        (dict(dtype=jnp.int32), "dtype=int32"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scale_by_soap(**kwargs)
    with pytest.raises(ValueError, match=match):
        soap(1e-3, **kwargs)


def test_bad_weight_decay():
    with pytest.raises(ValueError, match="weight_decay=-0.1"):
        soap(1e-3, weight_decay=-0.1)


def test_state_layout_and_placeholders():
    """Per leaf one factor per axis, None for unrotated axes (> max_precond_dim, 1-D Adam)."""
    tx = scale_by_soap(max_precond_dim=6)
    state = tx.init({"w": jnp.zeros((8, 3)), "b": jnp.zeros(3), "c": jnp.zeros((2, 3, 4))})
    shape = lambda t: None if t is None else t.shape
    assert tuple(map(shape, state.GG["w"])) == (None, (3, 3))
    assert tuple(map(shape, state.GG["b"])) == (None,)
    assert tuple(map(shape, state.GG["c"])) == ((2, 2), (3, 3), (4, 4))
    assert state.count.shape == () and state.count.dtype == jnp.int32


# --------------------------------------------------------------------------------------
# FedPAC_SOAP_light: what is uploaded and compressed.


def _np_low_rank(x, k):
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    return (u[:, :k] * s[:k]) @ vt[:k]


def test_light_upload_compresses_factors_and_moments_never_the_bases(x64):
    """FedPAC_SOAP_light on a 20 x 30 leaf (ratio 0.1: k = 2 for m and L, 3 for R).

    The round's compression (``fed.round._compress_state``, the upload mask of SOAP) leaves Q
    bit for bit. The server's first moment in the original space is then the mean over clients
    of the rank-2 truncation of ``P_c⁻¹(m_c) = Q_L m_c Q_Rᵀ`` (NumPy float64, ~1e-15: truncation
    commutes with the clients' exact rotations), its L/R the means of the truncated factors, and
    its Q orthogonal. Compressing only L/R leaves the first moment the uncompressed average. With
    Q compressed too (the bug: Q was a matrix leaf like any other), the first moment is lost
    (relative error ~1, asserted > 0.5 to show the check sees it).
    """
    from fedorth.fed.round import _compress_state
    from fedorth.optim.compress import compress_tree

    num_clients, ratio = 3, 0.1
    # Client states as after some SOAP steps: PSD factors, their eigenbases (descending),
    # moments in each client's basis (a state, not a trajectory: no SOAP step compiled).
    rng = np.random.default_rng(11)
    a_C = rng.normal(size=(num_clients, 20, 30)) * np.linspace(0.2, 2.0, 30)
    factors = (a_C @ a_C.transpose(0, 2, 1), a_C.transpose(0, 2, 1) @ a_C)
    bases = tuple(np.linalg.eigh(f)[1][..., ::-1] for f in factors)
    axes = SoapState(count=None, exp_avg=0, exp_avg_sq=0, GG=0, Q=0, moment_count=None)
    state_C = SoapState(
        count=jnp.asarray(7, jnp.int32),
        exp_avg={"w": jnp.asarray(rng.normal(size=(num_clients, 20, 30)))},
        exp_avg_sq={"w": jnp.asarray(rng.uniform(size=(num_clients, 20, 30)))},
        GG={"w": tuple(map(jnp.asarray, factors))},
        Q={"w": tuple(map(jnp.asarray, bases))},
        moment_count=jnp.asarray(6, jnp.int32),
    )
    compress = jax.vmap(lambda st: _compress_state(st, ratio), in_axes=(axes,), out_axes=axes)
    light_C = fast_jit(compress)(state_C)
    average = fast_jit(
        lambda st: (lambda a: (a, project_back(a.exp_avg["w"], a.Q["w"])))(average_soap_states(st))
    )
    for q, q_light in zip(state_C.Q["w"], light_C.Q["w"], strict=True):
        np.testing.assert_array_equal(np.asarray(q_light), np.asarray(q))

    mu_C = np.asarray(state_C.exp_avg["w"])
    ql_C, qr_C = (np.asarray(q) for q in state_C.Q["w"])
    back_C = [ql_C[c] @ mu_C[c] @ qr_C[c].T for c in range(num_clients)]
    expected = np.mean([_np_low_rank(b, 2) for b in back_C], axis=0)
    exact = np.mean(back_C, axis=0)
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)

    def first_moment(stack):
        avg, back = average(stack)
        for q in avg.Q["w"]:
            q = np.asarray(q)
            np.testing.assert_allclose(q.T @ q, np.eye(len(q)), atol=1e-12)
        return np.asarray(back), avg

    got, avg = first_moment(light_C)
    assert rel(got, expected) < 1e-12, rel(got, expected)
    assert rel(got, exact) > 1e-3  # the momentum itself was truncated, as uploaded
    for gg_C, gg, k in zip(state_C.GG["w"], avg.GG["w"], (2, 3), strict=True):
        mean = np.mean([_np_low_rank(np.asarray(f), k) for f in gg_C], axis=0)
        np.testing.assert_allclose(np.asarray(gg), mean, rtol=1e-10, atol=1e-14)

    def only(fields):
        def mask(st):
            return jax.tree.map(
                lambda _, keep: keep,
                st,
                SoapState(
                    count=False,
                    moment_count=False,
                    **{
                        f: jax.tree.map(lambda _: f in fields, getattr(st, f))
                        for f in ("exp_avg", "exp_avg_sq", "GG", "Q")
                    },
                ),
            )

        return fast_jit(
            jax.vmap(lambda st: compress_tree(st, mask(st), ratio), in_axes=(axes,), out_axes=axes)
        )(state_C)

    got_lr, _ = first_moment(only(("GG",)))
    assert rel(got_lr, exact) < 1e-12, rel(got_lr, exact)
    got_bug = np.asarray(average(only(("GG", "Q")))[1])
    assert rel(got_bug, exact) > 0.5, rel(got_bug, exact)


# --------------------------------------------------------------------------------------
# Low precision and the optax state-walking contract.


def test_float16_first_real_update_is_finite_and_matches_float32():
    """float16 params (4 x 3 with a zero column, so the rotated gradient has exact zeros): the
    first real update is finite (it was 0 / (0 + 0) = NaN: ε = 1e-8 rounds to 0 in float16)
    and equals the float32 computation on the same (float16-valued) gradients, rounded to
    float16 (rtol 2e-3 ≈ 2 float16 ulps). Default state: float32 (a float16 second moment
    underflows); with ``dtype=float16`` the state is float16 and the update still finite."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(4, 3)) * np.array([1.0, 0.5, 0.0])
    grads16 = [{"w": jnp.asarray(w * s, jnp.float16)} for s in (1.0, -0.6)]
    grads32 = [jax.tree.map(lambda x: x.astype(jnp.float32), g) for g in grads16]

    def run(tx, grads, params):
        state, out = tx.init(params), []
        for g in grads:
            u, state = fast_jit(tx.update)(g, state)
            out.append(np.asarray(u["w"]))
        return out, state

    tx = scale_by_soap()
    u16, state16 = run(tx, grads16, {"w": jnp.zeros((4, 3), jnp.float16)})
    u32, _ = run(tx, grads32, {"w": jnp.zeros((4, 3), jnp.float32)})
    assert state16.exp_avg_sq["w"].dtype == jnp.float32
    assert u16[1].dtype == np.float16 and np.all(np.isfinite(u16[1]))
    assert np.abs(u16[1]).max() > 0.5  # a real (sign-like) first Adam step
    np.testing.assert_allclose(u16[1].astype(np.float32), u32[1], rtol=2e-3, atol=1e-3)
    low, state_low = run(
        scale_by_soap(dtype=jnp.float16), grads16, {"w": jnp.zeros((4, 3), jnp.float16)}
    )
    assert state_low.exp_avg["w"].dtype == jnp.float16
    assert all(np.all(np.isfinite(u)) for u in low)


def test_optax_map_params_walks_soap_state():
    """``optax.tree.map_params`` (e.g. to build sharding specs of a state from the params'):
    the moments are params-shaped trees and get ``f``; the per-leaf factor/basis tuples are
    not, and go to ``transform_non_params`` (kept as they are without it)."""
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    tx = soap(0.1)
    state = tx.init(params)
    specs = {"w": "W", "b": "B"}
    out = optax.tree.map_params(
        tx, lambda _, spec: spec, state, specs, transform_non_params=lambda _: None
    )
    assert out[0] == SoapState(
        count=None, exp_avg=specs, exp_avg_sq=specs, GG=None, Q=None, moment_count=None
    ), out[0]
    plus = optax.tree.map_params(tx, lambda x: x + 2.0, state)[0]
    for k in params:
        np.testing.assert_array_equal(np.asarray(plus.exp_avg[k]), 2.0)
        np.testing.assert_array_equal(np.asarray(plus.exp_avg_sq[k]), 2.0)
    for a, b in zip(jax.tree.leaves(plus.GG), jax.tree.leaves(state[0].GG), strict=True):
        assert a is b


def test_theta_mask_average_skips_the_bases_and_moments_no_client_reads(x64):
    """Under FedPAC's Θ alignment the server's average holds only what a client reads
    (``soap_align_mask``: the factors and ``count``): the factors are the same means as the whole
    average's, and the bases and moments are ``init``'s zeros, without the ``eigh`` of each
    averaged factor (counted in the traced program: the whole average makes one per rotated
    factor, the masked one none)."""
    from fedorth.optim import linalg
    from fedorth.optim.soap import soap_align_mask

    _, shapes, state_C = client_states()
    mask = soap_align_mask(jax.tree.map(lambda x: x[0] if x.ndim else x, state_C))
    assert not any(jax.tree.leaves(mask.Q)), "a client's update-free call rebuilds Q"
    whole = fast_jit(federated.average_states)(state_C)
    masked = fast_jit(lambda s: federated.average_states(s, mask))(state_C)
    for a, b in zip(jax.tree.leaves(whole.GG), jax.tree.leaves(masked.GG), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(masked.count) == int(whole.count)
    for field in ("Q", "exp_avg", "exp_avg_sq"):
        shapes_whole = [x.shape for x in jax.tree.leaves(getattr(whole, field))]
        leaves = jax.tree.leaves(getattr(masked, field))
        assert [x.shape for x in leaves] == shapes_whole, field
        assert all(not np.any(np.asarray(x)) for x in leaves), field

    def eighs(fn, *args) -> int:
        return sum(
            eqn.primitive.name == "eigh"
            or (eqn.primitive.name == "fedorth_host_lapack" and eqn.params["fn"] is linalg._np_eigh)
            for eqn in equations(jax.make_jaxpr(fn)(*args))
        )

    rotated = sum(q is not None for q in jax.tree.leaves(state_C.GG, is_leaf=lambda x: x is None))
    assert rotated > 0
    assert eighs(federated.average_states, state_C) == rotated
    assert eighs(lambda s: federated.average_states(s, mask), state_C) == 0


@pytest.mark.parametrize("q_axis", [0, 1])
def test_wide_bases_rotate_by_row_major_products(q_axis):
    """A basis of at least ``ROW_MAJOR_BASIS`` rows rotates a gradient on CPU through
    ``optimization_barrier``-kept transposes (row-major GEMMs, 2-3x faster than ``tensordot``'s
    on XLA:CPU), to the float64 NumPy product at float32 rounding; a narrower one keeps
    ``tensordot`` (its rounding, and the golden fingerprints of small problems, unchanged)."""
    from fedorth.optim.soap import ROW_MAJOR_BASIS

    rng = np.random.default_rng(0)
    for d, wide in ((ROW_MAJOR_BASIS, True), (ROW_MAJOR_BASIS - 1, False)):
        x = rng.standard_normal((d, 3, 5)).astype(np.float32)
        q = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
        fn = project if q_axis == 0 else project_back
        text = jax.jit(lambda x, q, fn=fn: fn(x, (q, None, None))).lower(x, q).as_text()
        assert ("optimization_barrier" in text) == wide, (d, q_axis)
        got = np.asarray(jax.jit(lambda x, q, fn=fn: fn(x, (q,)))(x, q))
        want = np.tensordot(x.astype(np.float64), q.astype(np.float64), axes=((0,), (q_axis,)))
        assert got.shape == want.shape == (3, 5, d)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
