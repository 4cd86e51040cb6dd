"""Muon (momentum orthogonalized by Newton–Schulz) and the LMO family of seed 001.

Layout convention (Flax): a Dense kernel is `(in, out)` and a Conv kernel `(kh, kw, in, out)`;
any leaf of rank ≥ 2 is viewed as the matrix `(prod(shape[:-1]), shape[-1])`, so
fan_in = rows and fan_out = cols. Seed 001 writes conv kernels as out × (in·h·w), the transpose
of this view; the polar factor commutes with transposition, so the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedorth.optim.newton_schulz import newton_schulz, ns_coefficients

ShapeScalingFn = Callable[[int, int], float]
MaskOrFn = Any | Callable[[optax.Params], Any]

_SHAPE_SCALINGS = ("jordan", "moonlight", "none")
_LMO_NORMS = ("spectral", "frobenius", "sign")


class MuonState(NamedTuple):
    """State of `scale_by_muon`."""

    count: jax.Array  # shape=(), int32; a schedule counter (shared across clients).
    mu: optax.Updates  # momentum M, one array per (matrix) leaf, in `mu_dtype`.


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) of a Flax kernel: all leading axes are inputs, the last is the output."""
    return math.prod(shape[:-1]), shape[-1]


def shape_scale(shape: tuple[int, ...], shape_scaling: str | ShapeScalingFn) -> float:
    """The width factor Muon multiplies the orthogonalized update of a `shape` leaf by.

    `"jordan"`: sqrt(max(1, fan_out/fan_in)) (Jordan's Muon; seed 004 Alg. 6 line 11's
    γ = sqrt(fan-out/fan-in), floored at 1 as in Jordan's code). `"moonlight"`:
    0.2·sqrt(max(fan_in, fan_out)) (Liu et al. 2025, "Muon is scalable for LLM training": matches
    AdamW's update RMS). `"none"`: 1. A callable gets `(fan_in, fan_out)` and returns the factor.

    Args:
      shape: the leaf's shape (rank ≥ 2).
      shape_scaling: one of the names above or a callable.

    Returns:
      The factor as a Python float.
    """
    fan_in, fan_out = _matrix_shape(shape)
    if callable(shape_scaling):
        return shape_scaling(fan_in, fan_out)
    if shape_scaling == "jordan":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if shape_scaling == "moonlight":
        return 0.2 * math.sqrt(max(fan_in, fan_out))
    if shape_scaling == "none":
        return 1.0
    raise ValueError(
        f"Unknown shape_scaling={shape_scaling!r}; valid choices are {list(_SHAPE_SCALINGS)} "
        "or a callable (fan_in, fan_out) -> float."
    )


def _check_shape_scaling(shape_scaling: Any) -> None:
    if not callable(shape_scaling) and shape_scaling not in _SHAPE_SCALINGS:
        raise ValueError(
            f"Unknown shape_scaling={shape_scaling!r}; valid choices are {list(_SHAPE_SCALINGS)} "
            "or a callable (fan_in, fan_out) -> float."
        )


def _orthogonalize(x: jax.Array, ns_steps: int, ns_coeffs: Any, eps: float, precision) -> jax.Array:
    """Newton–Schulz on the `(prod(shape[:-1]), shape[-1])` view of `x`, reshaped back."""
    matrix = x.reshape(_matrix_shape(x.shape))
    return newton_schulz(matrix, ns_steps, ns_coeffs, eps, precision=precision).reshape(x.shape)


def orthogonalize_tree(
    tree: Any,
    ns_steps: int = 5,
    ns_coeffs: Any = "jordan",
    eps: float = 1e-7,
    *,
    precision: jax.lax.Precision | str | None = jax.lax.Precision.HIGHEST,
    group_shapes: bool = False,
) -> Any:
    """Newton–Schulz of every leaf's `(prod(shape[:-1]), shape[-1])` view, reshaped back.

    With `group_shapes=True` the leaves whose matrix views have the same shape and dtype are
    stacked and orthogonalized by one batched iteration (each matrix still normalized by its own
    norm, so the results are those of the per-leaf iteration up to the summation order of the
    batched products): fewer, larger matmuls. ViT-Tiny's 24 matrices fall into 4 shapes. On the
    2-core CPU this was slower (the stacking copies cost more than the merged products gained,
    docs/PERFORMANCE.md), so it is opt-in; on accelerators it saves kernel launches. Under
    `vmap` over clients each group is one `[S, n, m, k]` iteration.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not group_shapes:
        return treedef.unflatten(
            [_orthogonalize(x, ns_steps, ns_coeffs, eps, precision) for x in leaves]
        )
    groups: dict[tuple, list[int]] = {}
    for index, x in enumerate(leaves):
        groups.setdefault((_matrix_shape(x.shape), jnp.dtype(x.dtype)), []).append(index)
    out = [None] * len(leaves)
    for (shape, _), members in groups.items():
        stacked = jnp.stack([leaves[i].reshape(shape) for i in members])
        ortho = newton_schulz(stacked, ns_steps, ns_coeffs, eps, precision=precision)
        for j, i in enumerate(members):
            out[i] = ortho[j].reshape(leaves[i].shape)
    return treedef.unflatten(out)


def _require_matrices(tree: Any, who: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jnp.ndim(leaf) < 2:
            raise ValueError(
                f"{who} got the leaf {jax.tree_util.keystr(path)} of shape {jnp.shape(leaf)}: "
                "Muon orthogonalizes matrices (rank >= 2) only. Use fedorth.optim.muon(...), which "
                "sends the other leaves to a fallback optimizer (AdamW by default) through "
                "`muon_mask`, or wrap scale_by_muon in optax.masked / optax.partition."
            )


def scale_by_muon(
    beta: float = 0.95,
    *,
    nesterov: bool = True,
    ema: bool = False,
    ns_steps: int = 5,
    ns_coeffs: Any = "jordan",
    eps: float = 1e-7,
    shape_scaling: str | ShapeScalingFn = "jordan",
    mu_dtype: Any = None,
    precision: jax.lax.Precision | str | None = jax.lax.Precision.HIGHEST,
    group_shapes: bool = False,
) -> optax.GradientTransformation:
    r"""Muon's direction: the orthogonalized (Nesterov) momentum of each matrix leaf.

    .. math::
      M_t = β M_{t-1} + g_t, \quad D_t = g_t + β M_t \text{ (nesterov) or } M_t, \quad
      u_t = γ(\text{fan\_in}, \text{fan\_out}) \cdot NS_T(D_t).

    This is the convention of Jordan's modded-nanogpt Muon (`buf.mul_(β).add_(g)`, Nesterov
    `g.add(buf, alpha=β)`). With `ema=True` the momentum is the EMA of seed 004 Alg. 6 line 7,
    M_t = βM_{t−1} + (1−β)g_t, and the Nesterov direction (1−β)g_t + βM_t (the `lerp` form of
    KellerJordan/Muon's current muon.py). The two differ by the factor (1−β) on M and D, which
    the Frobenius normalization inside NS removes (up to ε); it matters when M is averaged or
    mixed with other quantities by the federated engine. No bias correction is applied (NS is
    scale-invariant). Conv kernels `(kh, kw, in, out)` are orthogonalized as
    `(kh·kw·in, out)` matrices. Returns a direction: chain with `optax.scale_by_learning_rate`.

    Args:
      beta: momentum coefficient β.
      nesterov: use the Nesterov direction g + βM instead of M.
      ema: use the EMA momentum M ← βM + (1−β)g (seed 004 Alg. 6/7) instead of M ← βM + g.
      ns_steps: Newton–Schulz steps T (Python int).
      ns_coeffs: NS coefficients (preset name or tuples, see `newton_schulz`).
      eps: ε in X₀ = D/(‖D‖_F + ε).
      shape_scaling: `"jordan"`, `"moonlight"`, `"none"` or a callable, see `shape_scale`.
      mu_dtype: dtype the momentum is stored in (default: the parameters' dtype).
      precision: matmul precision of NS.
      group_shapes: run one batched NS per group of leaves with equal matrix shapes
        (`orthogonalize_tree`); same directions up to summation order.

    Returns:
      An `optax.GradientTransformation` whose state is `MuonState`. Every leaf must have rank
      ≥ 2 (ValueError otherwise: use `muon(...)` or a mask for vectors and scalars).
    """
    ns_coefficients(ns_coeffs, ns_steps)  # Validates eagerly, with a clear error.
    _check_shape_scaling(shape_scaling)

    def init_fn(params):
        _require_matrices(params, "scale_by_muon")
        return MuonState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params, dtype=mu_dtype),
        )

    def update_fn(updates, state, params=None):
        del params
        _require_matrices(updates, "scale_by_muon")
        g_weight = (1.0 - beta) if ema else 1.0
        mu = jax.tree.map(lambda m, g: beta * m + g_weight * g, state.mu, updates)
        if nesterov:
            direction = jax.tree.map(lambda m, g: g_weight * g + beta * m, mu, updates)
        else:
            direction = mu

        orthos = orthogonalize_tree(
            direction, ns_steps, ns_coeffs, eps, precision=precision, group_shapes=group_shapes
        )
        new_updates = jax.tree.map(
            lambda o, g: (shape_scale(g.shape, shape_scaling) * o).astype(g.dtype), orthos, updates
        )
        return new_updates, MuonState(
            count=optax.safe_increment(state.count),
            mu=jax.tree.map(lambda m, old: m.astype(old.dtype), mu, state.mu),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def _default_muon_mask(params):
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    weight_decay: float = 0.0,
    nesterov: bool = True,
    ema: bool = False,
    ns_steps: int = 5,
    ns_coeffs: Any = "jordan",
    eps: float = 1e-7,
    shape_scaling: str | ShapeScalingFn = "jordan",
    mu_dtype: Any = None,
    fallback: optax.GradientTransformation | None = None,
    fallback_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_mask: MaskOrFn = None,
    precision: jax.lax.Precision | str | None = jax.lax.Precision.HIGHEST,
    group_shapes: bool = False,
) -> optax.GradientTransformation:
    r"""Muon for the matrix leaves, a fallback optimizer (AdamW) for the others.

    .. math::
      W ← W − η (u_t + λ W) \text{ for matrix leaves (} u_t \text{ from scale\_by\_muon),}
      \quad θ ← \text{fallback}(θ) \text{ otherwise.}

    Seed 004 Algorithm 6 (decoupled weight decay λ inside the learning-rate step, line 13),
    Jordan's Muon. Built from optax combinators: `optax.partition` on the labels from
    `muon_mask`, `optax.chain(scale_by_muon, optax.add_decayed_weights,
    optax.scale_by_learning_rate)` for the Muon part.

    Args:
      learning_rate: η for the Muon leaves (float or schedule).
      beta, nesterov, ema, ns_steps, ns_coeffs, eps, shape_scaling, mu_dtype, precision,
        group_shapes: see `scale_by_muon`.
      weight_decay: λ, applied to the Muon leaves only (decoupled, multiplied by η).
      fallback: transform for the leaves not selected by `muon_mask`. Default:
        `optax.adamw(fallback_learning_rate, weight_decay=0.0)` (no decay on biases and norm
        scales, as in `optax.contrib.muon`'s default).
      fallback_learning_rate: learning rate of the default fallback (default: `learning_rate`);
        only valid when `fallback` is None.
      muon_mask: pytree of bools (same structure as, or a prefix of, the params) or a callable
        params -> such a pytree; True selects Muon. Default: `ndim >= 2`.

    Returns:
      An `optax.GradientTransformation` (an `optax.partition` with labels "muon"/"fallback").
    """
    if fallback is not None and fallback_learning_rate is not None:
        raise ValueError(
            "fallback_learning_rate only sets the learning rate of the default AdamW fallback; "
            "got both fallback and fallback_learning_rate. Build your fallback with its own "
            "learning rate instead."
        )
    if fallback is None:
        fallback_lr = learning_rate if fallback_learning_rate is None else fallback_learning_rate
        fallback = optax.adamw(fallback_lr, weight_decay=0.0)
    muon_tx = optax.chain(
        scale_by_muon(
            beta,
            nesterov=nesterov,
            ema=ema,
            ns_steps=ns_steps,
            ns_coeffs=ns_coeffs,
            eps=eps,
            shape_scaling=shape_scaling,
            mu_dtype=mu_dtype,
            precision=precision,
            group_shapes=group_shapes,
        ),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )

    def param_labels(params):
        if muon_mask is None:
            mask = _default_muon_mask(params)
        elif callable(muon_mask):
            mask = muon_mask(params)
        else:
            mask = muon_mask
        return jax.tree.map(lambda use_muon: "muon" if use_muon else "fallback", mask)

    return optax.partition({"muon": muon_tx, "fallback": fallback}, param_labels)


def _lmo_leaf(u: jax.Array, norm: str, ns_steps: int, ns_coeffs: Any, eps: float, precision):
    if norm == "sign":
        return jnp.sign(u)
    if norm == "spectral" and u.ndim >= 2:
        return _orthogonalize(u, ns_steps, ns_coeffs, eps, precision)
    u32 = u.astype(jnp.promote_types(u.dtype, jnp.float32))
    return (u32 / (jnp.sqrt(jnp.sum(jnp.square(u32))) + eps)).astype(u.dtype)


def scale_by_lmo(
    norm: str = "spectral",
    *,
    ns_steps: int = 5,
    ns_coeffs: Any = "classic",
    eps: float = 1e-7,
    precision: jax.lax.Precision | str | None = jax.lax.Precision.HIGHEST,
) -> optax.GradientTransformation:
    r"""The linear-minimization-oracle direction of seed 001, per leaf: d(u) = −lmo(u).

    .. math::
      \text{lmo}(u) = \arg\min_{\|y\| \le 1} \langle u, y \rangle, \quad
      d(u) = -\text{lmo}(u) = \begin{cases}
        NS_T(u) ≈ UV^\top & \text{spectral (Muon)} \\
        u / \|u\|_F & \text{frobenius (normalized SGD)} \\
        \text{sign}(u) & \text{sign (ℓ∞, sign SGD)}
      \end{cases}

    Seed 001 §3 (LMO definition, update X ← X + η·lmo(M)), Algorithm 1 line 9 and Algorithm 2
    (T Newton–Schulz steps with (15/8, −5/4, 3/8), returning −G^{(T)}; T = 0 is u/‖u‖_F).
    Sign convention: this returns the steepest-*ascent* unit direction −lmo(u), like a
    gradient, so `optax.chain(scale_by_lmo(...), optax.scale_by_learning_rate(η))` performs
    X ← X + η·lmo(u). ⟨d(u), u⟩ is the dual norm of u: ‖u‖_* (nuclear, for the exact polar
    factor), ‖u‖_F, ‖u‖_1. No momentum or control variate is applied here: the engine composes
    them before this transform (seed 001: lmo(M_i − C_i + C)).

    Choices where the seed is silent: norms are per leaf (layer-wise, as the seed's Muon
    paragraph prescribes for layers), with ε added to the Frobenius norm. Under `"spectral"`,
    leaves of rank ≥ 2 use the `(prod(shape[:-1]), shape[-1])` matrix view; vectors and scalars
    get u/(‖u‖₂ + ε), which *is* the exact spectral LMO of u seen as a 1 × n matrix (its polar
    factor is u/‖u‖₂). No width scaling is applied (the seed's LMO is the plain unit ball).

    Args:
      norm: `"spectral"`, `"frobenius"` or `"sign"`.
      ns_steps: T, Newton–Schulz steps for `"spectral"` (Python int, T ≥ 0).
      ns_coeffs: NS coefficients (default seed 001's `"classic"`).
      eps: ε added to the Frobenius norms.
      precision: matmul precision of NS.

    Returns:
      A stateless `optax.GradientTransformation`.
    """
    if norm not in _LMO_NORMS:
        raise ValueError(f"Unknown norm={norm!r} for scale_by_lmo; valid choices are {_LMO_NORMS}.")
    ns_coefficients(ns_coeffs, ns_steps)

    def update_fn(updates, state, params=None):
        del params
        return (
            jax.tree.map(
                lambda u: _lmo_leaf(u, norm, ns_steps, ns_coeffs, eps, precision), updates
            ),
            state,
        )

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def lmo(
    learning_rate: optax.ScalarOrSchedule,
    *,
    norm: str = "spectral",
    momentum: float | None = None,
    ns_steps: int = 5,
    ns_coeffs: Any = "classic",
    eps: float = 1e-7,
    weight_decay: float = 0.0,
    precision: jax.lax.Precision | str | None = jax.lax.Precision.HIGHEST,
) -> optax.GradientTransformation:
    r"""Local LMO optimizer: X ← X + η·lmo(M) with an optional EMA momentum M.

    .. math::
      M ← (1 − α) M + α g, \quad X ← X − η (d(M) + λX), \quad d = −\text{lmo}

    Seed 001 §3 update rule (the LocalMuon of Eq. (2) when run on each client), built as
    `optax.chain(optax.ema(1 − α, debias=False), scale_by_lmo, optax.add_decayed_weights,
    optax.scale_by_learning_rate)`. The bias-corrected FedMuon (control variates) is composed by
    the federated engine, not here.

    Args:
      learning_rate: η.
      norm: `"spectral"`, `"frobenius"` or `"sign"` (see `scale_by_lmo`).
      momentum: the EMA decay 1 − α (seed 001's α is `1 - momentum`); None for no momentum.
      ns_steps, ns_coeffs, eps, precision: see `scale_by_lmo`.
      weight_decay: λ (decoupled, multiplied by η); seed 001 uses none.

    Returns:
      An `optax.GradientTransformation`.
    """
    parts = [] if momentum is None else [optax.ema(momentum, debias=False)]
    parts += [
        scale_by_lmo(norm, ns_steps=ns_steps, ns_coeffs=ns_coeffs, eps=eps, precision=precision),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    ]
    return optax.chain(*parts)
