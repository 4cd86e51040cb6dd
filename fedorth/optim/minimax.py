r"""Optax transforms of Fed minimax (Zhang & Gao): labels, momentum, the local step's direction.

Fed minimax (Zhang & Gao) (docs/PAPERS.md: Zhang & Gao, "Federated Stochastic Minimax
Optimization under Heavy-Tailed Noises") keeps the minimization variable ``x`` and the
maximization variable ``y`` in **one parameter tree**; a leaf is *dual* when a key on its path is
one of ``dual_keys`` (see :func:`minimax_labels`), else *primal*. The transforms here are the
pieces of its local optimizer (Alg. 1 lines 5, 6 and 8; Alg. 2/3; Eq. 21) and of its server
optimizer (line 11); :mod:`fedorth.fed.algorithms.minimax` assembles them into Fed-NSGDA-M,
FedMuon-DA and FedSGDA-Clip and states the choices where the paper is silent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedorth.optim import federated as fed_optim

PyTree = Any
LabelFn = Callable[[PyTree], PyTree]

PRIMAL, DUAL = "primal", "dual"
STEPS = ("normalize", "clip", "muon", "identity")
NORM_SCOPES = ("variable", "leaf")


# ------------------------------------------------------------------------------------ labels


def minimax_labels(tree: PyTree, dual_keys: Sequence[str] = ("dual",)) -> PyTree:
    """``"dual"`` for leaves with a key in ``dual_keys`` on their path, else ``"primal"``.

    Args:
      tree: a parameter-like pytree (params, gradients, updates: only the paths matter).
      dual_keys: dict keys (or attribute names) that mark the maximization variable ``y``.

    Returns:
      A pytree of strings with the structure of ``tree``.
    """
    keys = tuple(dual_keys)

    def label(path, _):
        for entry in path:
            name = getattr(entry, "key", getattr(entry, "name", None))
            if name in keys:
                return DUAL
        return PRIMAL

    return jax.tree_util.tree_map_with_path(label, tree)


def make_label_fn(dual_keys: Sequence[str] = ("dual",)) -> LabelFn:
    """``label_fn(tree)``: :func:`minimax_labels` with fixed ``dual_keys`` (must be non-empty)."""
    keys = tuple(dual_keys)
    if not keys or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"dual_keys={dual_keys!r} must be a non-empty sequence of strings.")
    return lambda tree: minimax_labels(tree, keys)


def _by_label(label_fn: LabelFn, tree: PyTree, primal: Any, dual: Any) -> PyTree:
    """A pytree like ``tree`` holding ``primal`` on primal leaves and ``dual`` on dual leaves."""
    return jax.tree.map(lambda lab: dual if lab == DUAL else primal, label_fn(tree))


def _check_unit(name: str, value: float, *, closed_low: bool = False) -> float:
    value = float(value)
    ok = (0.0 <= value <= 1.0) if closed_low else (0.0 < value <= 1.0)
    if not ok:
        interval = "[0, 1]" if closed_low else "(0, 1]"
        raise ValueError(f"fed.options.{name}={value} must lie in {interval}.")
    return value


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not value > 0:
        raise ValueError(f"fed.options.{name}={value} must be > 0.")
    return value


# -------------------------------------------------------------------------------- transforms


class GradientMeanState(NamedTuple):
    """State of :func:`track_gradient_mean`."""

    count: jax.Array  # shape=(), int32: shared schedule counter (local steps this round)
    total: PyTree  # sum of the raw gradients of the round


def track_gradient_mean() -> optax.GradientTransformationExtraArgs:
    r"""Accumulates the raw stochastic gradients; passes them on unchanged.

    .. math:: g^{(n)}_t = \frac{1}{p} \sum_{i=0}^{p-1} \nabla f^{(n)}(x_{t,i}, y_{t,i}; \xi_{t,i})

    Fed minimax (Zhang & Gao) Alg. 1 line 8 / Alg. 3 line 11 (the local control variates); read the
    mean with
    :func:`gradient_mean`. Place it first in the chain so it sees the uncorrected gradients.
    """

    def init_fn(params):
        return GradientMeanState(
            count=jnp.zeros([], jnp.int32), total=jax.tree.map(jnp.zeros_like, params)
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        total = jax.tree.map(lambda s, g: (s + g).astype(s.dtype), state.total, updates)
        return updates, GradientMeanState(count=optax.safe_increment(state.count), total=total)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def gradient_mean(state: GradientMeanState) -> PyTree:
    """The mean gradient ``total / count`` of a :class:`GradientMeanState` (0 before any step)."""
    count = jnp.maximum(state.count, 1)
    return jax.tree.map(lambda s: s / count.astype(s.dtype), state.total)


def minimax_momentum(
    label_fn: LabelFn, beta_primal: float, beta_dual: float
) -> optax.GradientTransformationExtraArgs:
    r"""Local momentum of Fed minimax (Zhang & Gao) Alg. 1 line 5: corrected gradient mixed with
    the global momentum.

    .. math::
      u = \beta_x (\nabla_x f^{(n)} + g_{x,t-1} - g^{(n)}_{x,t-1}) + (1 - \beta_x) u_{t-1}

    and likewise ``v`` with ``beta_y``. ``u_{t-1}`` is the server's global momentum (extra arg
    ``global_momentum``, fixed during the round) and ``g - g^(n)`` the engine's
    ``control_correction`` (treated as 0 when absent).

    Args:
      label_fn: ``label_fn(tree)`` -> ``"primal"``/``"dual"`` per leaf.
      beta_primal: ``beta_x`` in (0, 1].
      beta_dual: ``beta_y`` in (0, 1].
    """
    beta_primal = _check_unit("beta_x", beta_primal)
    beta_dual = _check_unit("beta_y", beta_dual)

    def update_fn(updates, state, params=None, *, global_momentum=None, **extra_args):
        del params
        if global_momentum is None:
            raise ValueError("minimax_momentum needs the extra argument `global_momentum`.")
        correction = extra_args.get("control_correction")
        if correction is None:
            correction = jax.tree.map(jnp.zeros_like, updates)
        betas = _by_label(label_fn, updates, beta_primal, beta_dual)
        out = jax.tree.map(
            lambda g, c, m, b: (b * (g + c.astype(g.dtype)) + (1.0 - b) * m.astype(g.dtype)).astype(
                g.dtype
            ),
            updates,
            correction,
            global_momentum,
            betas,
        )
        return out, state

    return optax.GradientTransformationExtraArgs(lambda params: fed_optim.EmptyState(), update_fn)


def _muon_leaves(tree: PyTree) -> list:
    """Per leaf of ``tree``: whether Muon orthogonalizes it (``default_muon_mask``)."""
    from fedorth.optim.muon import default_muon_mask

    return jax.tree.leaves(default_muon_mask(tree))


def _group_keys(label_fn: LabelFn, tree: PyTree, scope: str, *, split_matrices: bool) -> list:
    """One group key per leaf: the variable (and matrix/other when split), or the leaf index."""
    labels = jax.tree.leaves(label_fn(tree))
    matrices = _muon_leaves(tree) if split_matrices else [False] * len(labels)
    keys = []
    for index, (lab, matrix) in enumerate(zip(labels, matrices, strict=True)):
        if scope == "leaf":
            keys.append(index)
        else:
            keys.append((lab, "matrix" if matrix else "other"))
    return keys


def _group_norms(leaves: list, keys: list) -> list:
    """Euclidean norm of each leaf's group (sum of squares over the group's leaves)."""
    sq = {}
    for leaf, key in zip(leaves, keys, strict=True):
        s = jnp.sum(jnp.square(leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))))
        sq[key] = sq[key] + s if key in sq else s
    return [jnp.sqrt(sq[key]) for key in keys]


def _safe_scale(norm: jax.Array, numerator: jax.Array | float) -> jax.Array:
    """``numerator / norm`` with 0 for a zero norm (a zero direction gives a zero step)."""
    positive = norm > 0
    return jnp.where(positive, numerator / jnp.where(positive, norm, 1.0), 0.0)


def _orthogonalize(u: jax.Array, ns_steps: int, ns_coeffs: Any, ns_dtype: Any = None) -> jax.Array:
    from fedorth.optim.newton_schulz import newton_schulz

    rows = 1
    for d in u.shape[:-1]:
        rows *= d
    matrix = u.reshape(rows, u.shape[-1])
    out = newton_schulz(matrix, ns_steps, ns_coeffs, dtype=ns_dtype)
    return out.reshape(u.shape).astype(u.dtype)


def scale_by_minimax_step(
    label_fn: LabelFn,
    step: str = "normalize",
    *,
    norm_scope: str = "variable",
    tau: float = 0.1,
    ns_steps: int = 5,
    ns_coeffs: Any = "jordan",
    ns_dtype: Any = None,
) -> optax.GradientTransformation:
    r"""The local step's direction: normalized, clipped, orthogonalized or plain momentum.

    .. math::
      d(u) = \begin{cases}
        u / \|u\| & \text{normalize (Fed minimax (Zhang & Gao) Alg. 1 line 6)} \\
        \min(1, \tau/\|u\|)\, u & \text{clip (Fed minimax (Zhang & Gao) Eq. 21, FedSGDA-Clip)} \\
        P Q^\top,\ U = P \Sigma Q^\top & \text{muon on Muon's matrices (Alg. 2/3)} \\
        u & \text{identity (SGDA)}
      \end{cases}

    Norms are taken per variable (all primal leaves together, all dual leaves together) with
    ``norm_scope="variable"``, per leaf with ``"leaf"``. Under ``"muon"`` the leaves of
    ``default_muon_mask`` are orthogonalized and the others (vectors, lookup tables) normalized,
    grouped the same way among themselves. A zero ``u`` gives 0.

    Args:
      label_fn: ``label_fn(tree)`` -> ``"primal"``/``"dual"`` per leaf.
      step: one of :data:`STEPS`.
      norm_scope: ``"variable"`` or ``"leaf"``.
      tau: clipping threshold of ``"clip"`` (Fed minimax (Zhang & Gao) Sec. 5 uses 0.1).
      ns_steps: Newton-Schulz steps of ``"muon"``.
      ns_coeffs: Newton-Schulz coefficients of ``"muon"`` (see ``fedorth.optim.newton_schulz``).
      ns_dtype: Newton-Schulz matmul operands, "bfloat16" | "float32" | None/"auto" (bfloat16
        on GPU/TPU, float32 on CPU: ``fedorth.optim.newton_schulz.default_ns_dtype``).
    """
    if step not in STEPS:
        raise ValueError(f"step={step!r} is unknown; valid: {STEPS}.")
    if norm_scope not in NORM_SCOPES:
        raise ValueError(f"fed.options.norm_scope={norm_scope!r}; valid: {NORM_SCOPES}.")
    if step == "clip":
        _check_positive("tau", tau)
    if step == "muon":
        from fedorth.optim.newton_schulz import ns_coefficients, resolve_ns_dtype

        if int(ns_steps) != ns_steps or ns_steps < 0:
            raise ValueError(f"optim.ns_steps={ns_steps} must be an integer >= 0.")
        ns_coefficients(ns_coeffs, int(ns_steps))
        resolve_ns_dtype(ns_dtype)

    def update_fn(updates, state, params=None):
        del params
        if step == "identity":
            return updates, state
        leaves, treedef = jax.tree.flatten(updates)
        keys = _group_keys(label_fn, updates, norm_scope, split_matrices=step == "muon")
        norms = _group_norms(leaves, keys)
        matrices = _muon_leaves(updates) if step == "muon" else [False] * len(leaves)
        out = []
        for leaf, norm, matrix in zip(leaves, norms, matrices, strict=True):
            if matrix:
                out.append(_orthogonalize(leaf, int(ns_steps), ns_coeffs, ns_dtype))
            elif step == "clip":
                factor = jnp.minimum(1.0, _safe_scale(norm, tau))
                factor = jnp.where(norm > 0, factor, 1.0)
                out.append((leaf * factor.astype(leaf.dtype)).astype(leaf.dtype))
            else:
                out.append((leaf * _safe_scale(norm, 1.0).astype(leaf.dtype)).astype(leaf.dtype))
        return jax.tree.unflatten(treedef, out), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def ascend_dual(label_fn: LabelFn, dual_lr_ratio: float = 1.0) -> optax.GradientTransformation:
    r"""Turns a descent direction on dual leaves into an ascent one with its own learning rate.

    .. math:: d_x \leftarrow d_x, \quad d_y \leftarrow -(\eta_y / \eta_x)\, d_y

    Followed by ``scale_by_round_learning_rate`` (``-eta_x``), this gives ``x <- x - eta_x d_x``
    and ``y <- y + eta_y d_y`` (Fed minimax (Zhang & Gao) Alg. 1 line 6).

    Args:
      label_fn: ``label_fn(tree)`` -> ``"primal"``/``"dual"`` per leaf.
      dual_lr_ratio: ``eta_y / eta_x`` (> 0).
    """
    ratio = _check_positive("dual_lr_ratio", dual_lr_ratio)

    def update_fn(updates, state, params=None):
        del params
        factors = _by_label(label_fn, updates, 1.0, -ratio)
        return jax.tree.map(lambda u, f: (f * u).astype(u.dtype), updates, factors), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def minimax_server_tx(
    label_fn: LabelFn, server_lr: float, dual_server_lr: float, dual_lr_ratio: float = 1.0
) -> optax.GradientTransformation:
    r"""Server optimizer with per-variable global steps on the pseudo-gradient ``-scale mean(dx)``.

    .. math:: x \leftarrow x + \gamma_x\, s\, \overline{\Delta x}, \quad
              y \leftarrow y + \frac{\gamma_y}{\eta_y/\eta_x}\, s\, \overline{\Delta y}

    With the server rule ``fedorth.fed.update.GlobalStep(1.0)`` (``s = 1/(p eta_x)``) this is
    Fed minimax (Zhang & Gao) Alg. 1 line 11: ``gamma_x / (eta_x p)`` on ``x`` and
    ``gamma_y / (eta_y p)`` on ``y``. With ``fedorth.fed.update.Mean()`` (``s = 1``) it is the
    usual server learning rate of the baselines.
    """
    gx = _check_positive("server_lr", server_lr)
    gy = _check_positive("dual_server_lr", dual_server_lr)
    ratio = _check_positive("dual_lr_ratio", dual_lr_ratio)
    return optax.partition({PRIMAL: optax.sgd(gx), DUAL: optax.sgd(gy / ratio)}, label_fn)
