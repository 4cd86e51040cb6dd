r"""Federated minimax: Fed-NSGDA-M, FedMuon-DA and FedSGDA-Clip (Fed minimax (Zhang & Gao)), and
their pieces.

Fed minimax (Zhang & Gao) (docs/PAPERS.md: Zhang & Gao, "Federated Stochastic Minimax
Optimization under Heavy-Tailed Noises") solves ``min_x max_y (1/N) sum_n f_n(x, y)`` with ``f``
nonconvex in ``x`` and PL in ``y``. Both variables live in **one parameter tree**; a leaf is a
*dual* (ascent) variable when a key on its path is one of ``dual_keys`` (default ``("dual",)``,
e.g. ``{"net": ..., "a": ..., "b": ..., "dual": {"alpha": ...}}`` for the AUC loss of Eq. 20),
else *primal* (descent); see :func:`minimax_labels`.

Algorithm 1 (Fed-NSGDA-M), per client ``n`` and local step ``i`` of round ``t``:

* line 5: ``u = beta_x (grad_x f_n + g_x - g_x^(n)) + (1 - beta_x) u_{t-1}`` (and ``v`` for ``y``)
  where ``u_{t-1}`` is the server's global momentum, fixed during the round;
* line 6: ``x <- x - eta_x u / ||u||``, ``y <- y + eta_y v / ||v||``;
* line 8: ``g^(n) = (1/p) sum_i grad f_n(x_i, y_i; xi_i)`` (the raw stochastic gradients);
* line 10: ``g = (1/N) sum_n g^(n)``;
* line 11: ``x <- x + gamma_x / (eta_x N p) sum_n (x^(n)_p - x)`` (``y``: ``gamma_y/eta_y``);
* line 12: ``u_t = beta_x g_x + (1 - beta_x) u_{t-1}``.

FedMuon-DA (Alg. 2/3) replaces line 6 by ``X <- X - eta_x P Q^T`` (``U = P Sigma Q^T``, computed
by Newton-Schulz); FedSGDA-Clip (Sec. 5, Eq. 21) by ``x <- x - eta_x min(1, tau/||u||) u``.

Mapping onto the engine (:class:`fedorth.fed.FedAlgorithm`):

* the local optimizer is ``chain(track_gradient_mean, minimax_momentum, scale_by_minimax_step,
  ascend_dual, scale_by_round_learning_rate)``; the round's learning rate is ``eta_x`` and the
  dual's ``eta_y = dual_lr_ratio * eta_x`` (so schedules act on both);
* ``g^(n)`` are the engine's persistent control variates (``control_variates="momentum"`` with
  ``momentum_fn`` = the mean of the round's raw gradients); the engine passes
  ``control_correction = g - g^(n)`` and keeps ``g <- g + (1/N) sum_{n in S}(g^(n)+ - g^(n))``,
  which is line 10 under full participation;
* the global momentum ``(u, v)`` is ``ServerState.extra["global_momentum"]``, updated from the
  clients' reported ``g^(n)`` (line 12) and passed to every local step as an extra argument;
* line 11 is ``server_rule="global_step"`` (``-mean(dx) / (p eta_x)``) through a server optimizer
  ``sgd(gamma_x)`` on primal and ``sgd(gamma_y / dual_lr_ratio)`` on dual leaves, i.e.
  ``gamma_y / (p eta_y)`` on the dual.

Choices where the seed is silent or ambiguous (stated once here, repeated where they act):

* ``||u||`` is the Euclidean norm of the **whole** primal vector (all primal leaves together; the
  seed's ``x`` is one vector) and ``||v||`` of the whole dual vector (``norm_scope="variable"``);
  ``norm_scope="leaf"`` normalizes each leaf on its own (layer-wise). ``u = 0`` gives a zero step.
* FedMuon-DA orthogonalizes the leaves of Muon's default mask
  (``fedorth.optim.muon.default_muon_mask``, the mask of every Muon-based method: dense and conv
  kernels as ``(prod(shape[:-1]), shape[-1])`` matrices; not lookup tables such as embeddings,
  nor degenerate ``(1, n)`` views; the paper is silent on them), with ``ns_steps`` Newton-Schulz
  steps (default 5, Jordan's coefficients; ``"classic"`` coefficients converge to the exact
  ``P Q^T``); the other leaves, tables included, take the normalized step of Alg. 1 (grouped by
  variable as above).
* ``u_{-1} = v_{-1} = 0`` and ``g_{-1} = g_{-1}^(n) = 0`` (the boxes give no initialization).
* Under partial participation (``S < N``, outside the seed's analysis) ``g`` is the engine's
  SCAFFOLD-style running average over all clients' last ``g^(n)`` and the global momentum uses
  the mean ``g^(n)`` of the clients sampled this round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedorth.fed import update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import Corrections, FromState
from fedorth.fed.quantities import ClientReport, ServerQuantities
from fedorth.optim import federated as fed_optim

PyTree = Any
LabelFn = Callable[[PyTree], PyTree]

PRIMAL, DUAL = "primal", "dual"
STEPS = ("normalize", "clip", "muon", "identity")
NORM_SCOPES = ("variable", "leaf")
FED_MINIMAX = "Fed minimax (Zhang & Gao, heavy-tailed federated minimax)"


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

    With the engine's ``server_rule="global_step"`` (``s = 1/(p eta_x)``) this is Fed minimax
    (Zhang & Gao) Alg. 1
    line 11: ``gamma_x / (eta_x p)`` on ``x`` and ``gamma_y / (eta_y p)`` on ``y``. With
    ``"mean"`` (``s = 1``) it is the usual server learning rate of the baselines.
    """
    gx = _check_positive("server_lr", server_lr)
    gy = _check_positive("dual_server_lr", dual_server_lr)
    ratio = _check_positive("dual_lr_ratio", dual_lr_ratio)
    return optax.partition({PRIMAL: optax.sgd(gx), DUAL: optax.sgd(gy / ratio)}, label_fn)


# ------------------------------------------------------------------------ server quantities


def _global_momentum_pieces(label_fn: LabelFn, beta_primal: float, beta_dual: float):
    """``server_extra_init``/``client_report``/``server_extra_update`` of Alg. 1 line 12."""

    def init(params):
        return {"global_momentum": jax.tree.map(jnp.zeros_like, params)}

    def report(ctx):
        return {"gradient_mean": gradient_mean(ctx["opt_state"][0])}

    def update(server, reports, learning_rate):
        del learning_rate
        old = server.extra["global_momentum"]
        betas = _by_label(label_fn, old, beta_primal, beta_dual)
        new = jax.tree.map(
            lambda m, g, b: (b * g + (1.0 - b) * m).astype(m.dtype),
            old,
            reports["gradient_mean"],
            betas,
        )
        return {"global_momentum": new}

    return init, report, update


def split_minimax_optim(optim: Mapping[str, Any], name: str, allowed: Mapping[str, tuple]):
    """Checks ``optim`` for a minimax algorithm: its name and the keys it may carry.

    The local step of these algorithms is fixed by their boxes; ``optim`` only provides the
    learning rate (``eta_x``) and, for Muon steps, the Newton-Schulz settings.

    Args:
      optim: the ``optim`` config section.
      name: the algorithm (for messages).
      allowed: optimizer names -> the hyperparameter keys each may carry.

    Returns:
      ``(optimizer name, hyperparameters)`` without ``learning_rate``/``schedule`` keys.
    """
    hp = dict(optim)
    opt = hp.pop("name", None)
    if opt not in allowed:
        raise ValueError(
            f"{name}: optim.name={opt!r}; the local step is fixed by the algorithm's box, "
            f"valid: {sorted(allowed)}."
        )
    for key in ("learning_rate", "schedule", "warmup_rounds", "final_lr_ratio", "step_rounds"):
        hp.pop(key, None)
    if float(hp.pop("weight_decay", 0.0) or 0.0) != 0.0:
        raise ValueError(
            f"{name}: optim.weight_decay must be 0 (Fed minimax (Zhang & Gao)'s boxes have no "
            "weight decay)."
        )
    if hp.get("ns_dtype") in (None, "auto"):  # configs/base.py's default: every step takes it
        hp.pop("ns_dtype", None)
    unknown = sorted(set(hp) - set(allowed[opt]))
    if unknown:
        raise ValueError(
            f"{name}: unknown optim keys {unknown} for optim.name={opt!r}; valid: "
            f"{sorted(allowed[opt])}."
        )
    return opt, hp


# --------------------------------------------------------------------------- the algorithms


def fed_nsgda_family(
    optim: Mapping[str, Any],
    *,
    name: str,
    step: str,
    beta_x: float = 0.1,
    beta_y: float | None = None,
    dual_lr_ratio: float = 1.0,
    server_lr: float | None = None,
    dual_server_lr: float | None = None,
    norm_scope: str = "variable",
    tau: float = 0.1,
    dual_keys: Sequence[str] = ("dual",),
    ns_steps: int = 5,
    ns_coeffs: Any = "jordan",
) -> FedAlgorithm:
    r"""Fed minimax (Zhang & Gao) Alg. 1 with local step ``step`` (normalize / muon / clip); see
    the module docs.

    Args:
      optim: ``{"name": "sgd"}`` (``"muon"`` for FedMuon-DA, with ``ns_steps``/``ns_coeffs``),
        ``learning_rate`` = ``eta_x``.
      name: registry name.
      step: ``"normalize"`` (Fed-NSGDA-M), ``"muon"`` (FedMuon-DA), ``"clip"`` (FedSGDA-Clip).
      beta_x: momentum weight of the new corrected gradient for ``x`` (line 5), in (0, 1].
        Default 0.1: §5's "beta is fixed at 0.9" read as the usual momentum 0.9 on the old
        average, as for FedMuon (Zhang & Gao) (:mod:`fedorth.fed.algorithms.fedmuon_zg`).
      beta_y: the same for ``y`` (default ``beta_x``).
      dual_lr_ratio: ``eta_y / eta_x``.
      server_lr: ``gamma_x`` of line 11 (``x <- x + gamma_x/(eta_x p) mean(dx)``). ``None``
        (default): ``gamma_x = eta_x p`` and ``gamma_y = eta_y p``, i.e. the server averages
        the clients' models (``x <- x + mean(dx)``), which also follows lr schedules.
      dual_server_lr: ``gamma_y`` (default ``server_lr * dual_lr_ratio``, i.e. the same
        ``gamma/eta`` on both variables); only together with ``server_lr``.
      norm_scope: ``"variable"`` (one norm per variable, the box) or ``"leaf"``.
      tau: clipping threshold of FedSGDA-Clip (Sec. 5: 0.1).
      dual_keys: keys marking dual leaves (see :func:`minimax_labels`).
      ns_steps: Newton-Schulz steps of FedMuon-DA.
      ns_coeffs: Newton-Schulz coefficients of FedMuon-DA.
    """
    allowed = {"sgd": ()} if step != "muon" else {"muon": ("ns_steps", "ns_coeffs", "ns_dtype")}
    _, hp = split_minimax_optim(optim, name, allowed)
    ns_steps = int(hp.get("ns_steps", ns_steps))
    ns_coeffs = hp.get("ns_coeffs", ns_coeffs)
    if isinstance(ns_coeffs, list):
        ns_coeffs = tuple(tuple(c) if isinstance(c, list) else c for c in ns_coeffs)
    beta_y = beta_x if beta_y is None else beta_y
    label_fn = make_label_fn(dual_keys)
    tx = optax.chain(
        track_gradient_mean(),
        minimax_momentum(label_fn, beta_x, beta_y),
        scale_by_minimax_step(
            label_fn,
            step,
            norm_scope=norm_scope,
            tau=tau,
            ns_steps=ns_steps,
            ns_coeffs=ns_coeffs,
            ns_dtype=hp.get("ns_dtype"),
        ),
        ascend_dual(label_fn, dual_lr_ratio),
        fed_optim.scale_by_round_learning_rate(),
    )
    init, report, update_momentum = _global_momentum_pieces(
        label_fn, _check_unit("beta_x", beta_x), _check_unit("beta_y", beta_y)
    )
    if server_lr is None:
        if dual_server_lr is not None:
            raise ValueError(f"{name}: fed.options.dual_server_lr needs fed.options.server_lr.")
        # gamma/(eta p) = 1 on both variables: plain averaging, whatever the round's eta.
        server_rule, gx, gy, ratio_for_server = "mean", 1.0, 1.0, 1.0
    else:
        server_rule, gx = "global_step", server_lr
        gy = server_lr * dual_lr_ratio if dual_server_lr is None else dual_server_lr
        ratio_for_server = dual_lr_ratio
    return FedAlgorithm(
        name=name,
        local_tx=tx,
        corrections=Corrections(control=FromState(lambda opt_state: gradient_mean(opt_state[0]))),
        # gamma_x, gamma_y are the server optimizer's; GlobalStep(1.0) divides by K eta_r.
        server=update.ServerUpdate(
            tx=minimax_server_tx(label_fn, gx, gy, ratio_for_server),
            rule=update.GlobalStep(1.0) if server_rule == "global_step" else update.Mean(),
        ),
        paper=f"{FED_MINIMAX} "
        + {"normalize": "Alg. 1", "muon": "Alg. 2/3", "clip": "Eq. 21"}[step],
        quantities=ServerQuantities(init, update_momentum),
        # g^(n) is reported once: it is the uploaded control variate (counted by the engine).
        report=ClientReport(report),
    )


def fed_nsgda_m(optim: Mapping[str, Any], **options) -> FedAlgorithm:
    """Fed-NSGDA-M (Fed minimax (Zhang & Gao) Alg. 1): normalized momentum steps with control
    variates."""
    return fed_nsgda_family(optim, name="fed_nsgda_m", step="normalize", **options)


def fedmuon_da(optim: Mapping[str, Any], **options) -> FedAlgorithm:
    """FedMuon-DA (Fed minimax (Zhang & Gao) Alg. 2/3): Muon's orthogonalized steps on matrix
    leaves of x and y."""
    return fed_nsgda_family(optim, name="fedmuon_da", step="muon", **options)


def fedsgda_clip(optim: Mapping[str, Any], **options) -> FedAlgorithm:
    """FedSGDA-Clip (Fed minimax (Zhang & Gao) Sec. 5, Eq. 21): Alg. 1 with the clipped step, tau =
    0.1."""
    return fed_nsgda_family(optim, name="fedsgda_clip", step="clip", **options)
