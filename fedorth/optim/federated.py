"""Optax transforms that take server quantities as extra arguments, and state averaging.

The federated engine (``fedorth.fed``) composes a client's local optimizer from a *direction*
transform (Muon, SOAP, Sophia, an LMO, SGD, Adam, ...) and the pieces below:

* :func:`mix_with_global` -- local-global alignment / correction,
  ``u <- (1 - beta) * u + beta * g_G`` (FedMuon (Liu et al.) Alg. 2 line 9 with ``beta = alpha``;
  FedPAC (Liu et al.) Alg. 2/3 line 9; FedCM of Xu et al. 2021 with ``beta = 1 - alpha_FedCM``).
* :func:`add_control_variate` -- SCAFFOLD-style correction ``u <- u - c_i + c`` applied where it is
  placed in the chain: on the gradient (SCAFFOLD, Karimireddy et al. 2020) or on the momentum
  before the LMO (FedMuon-LMO Alg. 1 line 9).
* :func:`scale_by_round_learning_rate` -- ``u <- -eta_r * u`` with ``eta_r`` passed per round by the
  engine, so that learning-rate schedules run over *rounds* even when the client state is reset.
* :func:`ema` -- ``m <- decay * m + (1 - decay) * g`` with an optional first-step initialization
  ``m_0 = g_0`` (FedMuon (Zhang & Gao) Alg. 1 line 1).

Server quantities arrive as keyword extra arguments (``GradientTransformationExtraArgs``), never as
globals, so the same transform runs under ``jax.vmap`` over a leading client axis.

:func:`average_states` averages optimizer states over a leading client axis (the alignment step of
FedPAC (Liu et al.) Alg. 2 line 16, and FedMuon (Liu et al.)'s momentum aggregation, Alg. 2 line
15). An optimizer state type registers with :func:`register_average` its own averaging rule
where leaves must not be averaged one by one (SOAP's eigenbases), the leaves a client uploads
(:func:`upload_mask`; SOAP's Q is not sent), its preconditioner state Θ (:func:`theta_mask`:
SOAP {L, R}, Sophia {h}, Muon {m}, FedPAC (Liu et al.) §3.2), over which the preconditioner
drift is measured, and what FedPAC's Θ alignment warm-starts from the server
(:func:`align_mask`: Θ, plus what the server derives from it and shared schedule counters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any

_AVERAGE_RULES: dict[type, Callable[[Any], Any]] = {}
_UPLOAD_MASKS: dict[type, Callable[[Any], Any]] = {}
_THETA_MASKS: dict[type, Callable[[Any], Any]] = {}
_ALIGN_MASKS: dict[type, Callable[[Any], Any]] = {}
_PARTIAL_RULES: set[type] = set()  # rules that take mask= (register_average(partial=True))


def register_average(
    state_type: type,
    rule: Callable[[Any], Any] | None,
    *,
    upload_mask: Callable[[Any], Any] | None = None,
    theta_mask: Callable[[Any], Any] | None = None,
    align_mask: Callable[[Any], Any] | None = None,
    partial: bool = False,
) -> None:
    """Registers how states of ``state_type`` are averaged, uploaded, and what their Θ is.

    Args:
      state_type: the NamedTuple class of an optimizer state.
      rule: ``rule(state_C) -> state`` mapping a client-stacked state to the server's state;
        ``None`` keeps the default (float leaves averaged, integer counters from client 0).
      upload_mask: ``upload_mask(state) -> pytree of bools`` (same structure as ``state``) marking
        the leaves a client actually transmits (SOAP sends its L/R factors and moments but not
        its eigenbases, which the server rebuilds). Default: every floating-point leaf.
      theta_mask: ``theta_mask(state) -> pytree of bools``: the preconditioner state ``Θ`` of
        FedPAC (Liu et al.) §3.2 (SOAP ``{L, R}``, Sophia ``{h}``, Muon ``{m}``), the leaves the
        preconditioner drift of its Def. 1 / Eq. 7 is measured over (:func:`theta_mask`).
      align_mask: ``align_mask(state) -> pytree of bools``: the leaves FedPAC's Θ alignment
        warm-starts from the server's averaged state (:func:`align_mask`); default: ``Θ``.
      partial: ``rule`` also takes ``mask=``, a pytree of bools like the state: the leaves the
        server's state must hold (:func:`average_states`). The others are read by no client (a
        FedPAC client starts them from ``init``), so the rule may leave them at ``init``'s zeros
        instead of computing them (SOAP: no ``eigh`` of the averaged factors).
    """
    if rule is not None:
        _AVERAGE_RULES[state_type] = rule
        if partial:
            _PARTIAL_RULES.add(state_type)
    if upload_mask is not None:
        _UPLOAD_MASKS[state_type] = upload_mask
    if theta_mask is not None:
        _THETA_MASKS[state_type] = theta_mask
    if align_mask is not None:
        _ALIGN_MASKS[state_type] = align_mask


def upload_mask(state: PyTree) -> PyTree:
    """Pytree of bools like ``state``: the leaves a client uploads when its state is aggregated."""

    def go(node):
        if type(node) in _UPLOAD_MASKS:
            return _UPLOAD_MASKS[type(node)](node)
        if _has_mask(node):
            return float_leaves_mask(node)
        return is_float(node)

    return jax.tree.map(go, state, is_leaf=_has_mask)


def _has_mask(node: Any) -> bool:
    return type(node) in _AVERAGE_RULES or type(node) in _UPLOAD_MASKS or _has_theta(node)


def _has_theta(node: Any) -> bool:
    return type(node) in _THETA_MASKS


def _muon_theta_mask(state: Any) -> Any:
    """Muon's ``Θ = {m}`` (FedPAC (Liu et al.) §3.2): the momentum of its matrix leaves."""
    return type(state)(count=False, mu=jax.tree.map(lambda _: True, state.mu))


def _register_builtin_thetas() -> None:
    # MuonState is declared here, lazily (fedorth.optim.muon does not import this module);
    # SOAP and Sophia declare theirs in their own modules.
    from fedorth.optim.muon import MuonState

    if MuonState not in _THETA_MASKS:
        register_average(MuonState, None, theta_mask=_muon_theta_mask)


def declares_theta(state: PyTree) -> bool:
    """True when some node of ``state`` is an optimizer state that declared its ``Θ``."""
    _register_builtin_thetas()
    flags = jax.tree.map(_has_theta, state, is_leaf=_has_theta)
    return any(flag is True for flag in jax.tree.leaves(flags))


def theta_mask(state: PyTree) -> PyTree:
    """Pytree of bools like ``state``: its preconditioner state ``Θ`` (FedPAC (Liu et al.) §3.2).

    When some node of ``state`` declared its ``Θ`` (:func:`register_average`, ``theta_mask=``:
    SOAP ``{L, R}``, Sophia ``{h}``, Muon ``{m}``), ``Θ`` is the union of the declared parts and
    nothing else: e.g. the Adam fallback of a Muon partition (non-matrix leaves) and SOAP's
    eigenbases ``Q`` and moments (kept in each client's own basis) are not in it. A state in
    which nothing declared a ``Θ`` (AdamW, momentum SGD) takes its uploaded leaves
    (:func:`upload_mask`): FedPAC over such an optimizer aligns its whole state.
    """
    if not declares_theta(state):
        return upload_mask(state)

    def go(node):
        if _has_theta(node):
            return _THETA_MASKS[type(node)](node)
        return jax.tree.map(lambda _: False, node)

    return jax.tree.map(go, state, is_leaf=_has_theta)


def align_mask(state: PyTree) -> PyTree:
    """Pytree of bools like ``state``: what FedPAC's Θ alignment takes from the server.

    FedPAC (Liu et al.) Alg. 2: a client starts round ``r`` from the server's ``Θ^r`` (line 3),
    uploads ``Θ_i^{r,K}`` (line 12) and the server averages it (line 16); the rest of the
    optimizer state does what it does in Local-X: it starts from ``init`` every round. Per
    optimizer state that declared its ``Θ``: the leaves registered with ``align_mask=`` (SOAP:
    ``L, R`` and ``count``; Sophia: ``h`` and ``count``), else its ``Θ`` (Muon: ``m``). Other
    nodes (the Adam fallback of a Muon partition, chained stateless transforms) start from
    ``init``. A state in which nothing declared a ``Θ`` (AdamW, momentum SGD) is aligned whole:
    every leaf is True.

    The engine uploads and averages the leaves that are both here and in :func:`upload_mask`
    (``fedorth.fed.start.Global.mask``): ``Θ`` itself, not ``Q`` nor the integer counters.
    """
    if not declares_theta(state):
        return jax.tree.map(lambda _: True, state)

    def go(node):
        if type(node) in _ALIGN_MASKS:
            return _ALIGN_MASKS[type(node)](node)
        if _has_theta(node):
            return _THETA_MASKS[type(node)](node)
        return jax.tree.map(lambda _: False, node)

    return jax.tree.map(go, state, is_leaf=_has_theta)


def is_float(x: Any) -> bool:
    """True for floating-point arrays (also ``jax.ShapeDtypeStruct``)."""
    dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _is_registered(node: Any) -> bool:
    return type(node) in _AVERAGE_RULES


def has_average_rule(state: PyTree) -> bool:
    """True when some node of ``state`` has a registered rule (:func:`register_average`).

    Such states are averaged from the whole client stack (e.g. SOAP rebuilds eigenbases); the
    others are plain leaf means, which the round engine accumulates as clients finish.
    """
    flags = jax.tree.map(_is_registered, state, is_leaf=_is_registered)
    return any(flag is True for flag in jax.tree.leaves(flags))


def mean_over_clients(x: jax.Array) -> jax.Array:
    """``mean_i x[i]`` over the leading (client) axis, by a pairwise tree of slice additions.

    Same value as ``jnp.mean(x, axis=0)`` up to summation order (pairwise summation, whose
    rounding error grows like log S rather than S). Why not ``jnp.mean``: XLA:CPU reduces a short
    leading axis into a large output (``[S, P] -> [P]``, the shape of every client average)
    element by element, measured 25-120x slower than ``log2 S`` vectorized adds of slices
    (docs/PERFORMANCE.md); GPU/TPU reductions are fast either way.

    Args:
      x: ``[S, ...]`` with ``S >= 1``.

    Returns:
      ``x``'s mean over axis 0 (``[...]``): in ``x``'s dtype when floating, else as ``jnp.mean``.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.mean(x, axis=0)
    count = x.shape[0]
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        pairs = x[:half] + x[half : 2 * half]
        x = pairs.at[0].add(x[-1]) if x.shape[0] % 2 else pairs
    return (x[0] / count).astype(x.dtype)


def mean_leaf(x: jax.Array) -> jax.Array:
    """Client mean of one `[S, ...]` leaf: floats averaged, integer counters taken from client 0."""
    if is_float(x):
        return mean_over_clients(x)
    # Integer leaves are schedule counters shared by all clients (docs/CONTRACTS.md).
    return x[0]


def average_states(states_C: PyTree, mask: PyTree | None = None) -> PyTree:
    """Averages a client-stacked optimizer state ``[S, ...]`` into one state.

    Float leaves are averaged over the leading axis, integer leaves (shared schedule counters) are
    taken from the first client, and nodes whose type was registered with
    :func:`register_average` use their own rule.

    Args:
      states_C: a pytree whose leaves carry a leading client axis.
      mask: ``None`` (every leaf is averaged), or a pytree of bools like the state (without the
        client axis's meaning: :func:`align_mask` of it): the leaves the result must hold. Rules
        registered with ``partial=True`` receive their node's part and may leave the other
        leaves at ``init``'s zeros (SOAP: the bases and moments, which FedPAC's Θ alignment
        restarts, are then neither rebuilt nor rotated); every other leaf is averaged as without
        a mask. The engine passes the mask of a warm start that reads only part of the state
        (``fedorth.fed.start.Global.mask``).

    Returns:
      The averaged state, with the client axis removed.
    """

    def go(node, node_mask=None):
        if not _is_registered(node):
            return mean_leaf(node)
        if mask is not None and type(node) in _PARTIAL_RULES:
            return _AVERAGE_RULES[type(node)](node, mask=node_mask)
        return _AVERAGE_RULES[type(node)](node)

    masks = () if mask is None else (mask,)
    return jax.tree.map(go, states_C, *masks, is_leaf=_is_registered)


def float_leaves_mask(tree: PyTree) -> PyTree:
    """A pytree of bools: True on floating-point leaves (the averageable part of a state)."""
    return jax.tree.map(is_float, tree)


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def is_concrete(value: Any) -> bool:
    """Whether a hyperparameter is a concrete number (Python or NumPy), not a JAX array.

    A sweep (``fedorth.sweep``) passes its traced hyperparameters as JAX arrays (tracers in the
    compiled round): code that branches on a hyperparameter's value branches only when it is
    concrete, and takes the general path, valid for every value, otherwise.
    """
    return not isinstance(value, jax.Array | jax.core.Tracer)


def mix_with_global(beta: float) -> optax.GradientTransformationExtraArgs:
    r"""Mixes the local direction with the server's global direction.

    .. math:: u \leftarrow (1 - \beta) u + \beta g_G

    FedMuon (Liu et al.) (FedMuon) Alg. 2 line 9 with ``beta = alpha`` and ``g_G = Delta_G``;
    FedPAC (Liu et al.) (FedPAC)
    Alg. 2/3 line 9 and Alg. 5/7/9; FedCM (Xu et al. 2021) with ``beta = 1 - alpha``.

    Args:
      beta: weight of the global direction, in [0, 1]; a traced array (a sweep's value) is
        taken as given (no range check) and always mixes.

    Returns:
      A transform whose ``update`` takes the extra argument ``global_direction`` (a pytree like the
      updates). A concrete ``beta = 0`` returns the updates unchanged.
    """
    concrete = is_concrete(beta)
    if concrete and not 0.0 <= beta <= 1.0:
        raise ValueError(f"mix_with_global: beta={beta} must lie in [0, 1].")

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, global_direction=None, **extra_args):
        del params, extra_args
        if concrete and beta == 0.0:
            return updates, state
        if global_direction is None:
            raise ValueError("mix_with_global needs the extra argument `global_direction`.")
        mixed = jax.tree.map(
            lambda u, g: ((1.0 - beta) * u + beta * g.astype(u.dtype)).astype(u.dtype),
            updates,
            global_direction,
        )
        return mixed, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def add_control_variate() -> optax.GradientTransformationExtraArgs:
    r"""Adds a control-variate correction ``c - c_i`` to the updates.

    .. math:: u \leftarrow u + (c - c_i)

    On the gradient this is SCAFFOLD's local step (Karimireddy et al. 2020, Alg. 1 line 10); on the
    momentum before the LMO it is FedMuon-LMO Alg. 1 line 9, ``lmo(M_i - C_i + C)``.

    Returns:
      A transform whose ``update`` takes the extra argument ``control_correction = c - c_i``.
    """

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, control_correction=None, **extra_args):
        del params, extra_args
        if control_correction is None:
            raise ValueError("add_control_variate needs the extra argument `control_correction`.")
        out = jax.tree.map(
            lambda u, c: (u + c.astype(u.dtype)).astype(u.dtype), updates, control_correction
        )
        return out, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def add_proximal_term(mu: float) -> optax.GradientTransformationExtraArgs:
    r"""Adds FedProx's proximal gradient ``mu (w - x^r)`` to the updates (Li et al. 2020, Alg. 2).

    .. math:: g \leftarrow g + \mu (w - x^r)

    the gradient of ``h_i(w) = f_i(w) + mu/2 ||w - x^r||^2`` at the client's current ``w``, with
    ``x^r`` the model the round's clients started from (``round_context.params``).

    Returns:
      A transform whose ``update`` takes the parameters ``w`` and the extra argument
      ``round_context`` (:class:`fedorth.fed.RoundContext`).
    """

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, round_context=None, **extra_args):
        del extra_args
        if params is None or round_context is None:
            raise ValueError("add_proximal_term needs the parameters and `round_context`.")
        out = jax.tree.map(
            lambda g, w, x: (g + mu * (w - x.astype(w.dtype))).astype(g.dtype),
            updates,
            params,
            round_context.params,
        )
        return out, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def add_global_direction(weight: float) -> optax.GradientTransformationExtraArgs:
    r"""Adds the server's global direction with a weight, keeping the local direction whole.

    .. math:: u \leftarrow u + w \, g_G

    FedAdamW's local correction (the FedMuon (Liu et al.) authors' released code,
    junkangLiu0/FedAdamW ``update_FedAdamW``: ``p += gamma lr / K * mean_i(dx_i) / lr`` after
    each AdamW step, i.e. ``-lr gamma g_G``); :func:`mix_with_global` instead takes a convex
    combination.

    Returns:
      A transform whose ``update`` takes the extra argument ``global_direction``.
    """

    def update_fn(updates, state, params=None, *, global_direction=None, **extra_args):
        del params, extra_args
        if global_direction is None:
            raise ValueError("add_global_direction needs the extra argument `global_direction`.")
        out = jax.tree.map(
            lambda u, d: (u + weight * d.astype(u.dtype)).astype(u.dtype), updates, global_direction
        )
        return out, state

    return optax.GradientTransformationExtraArgs(lambda params: EmptyState(), update_fn)


def add_dynamic_regularizer(alpha: float) -> optax.GradientTransformationExtraArgs:
    r"""Adds the gradient of FedDyn's dynamic regularizer to the updates (Acar et al. 2021,
    "Federated Learning Based on Dynamic Regularization", Alg. 1: client ``k`` minimizes
    ``L_k(w) - <grad L_k(w_k^{t-1}), w> + alpha/2 ||w - w^{t-1}||^2``).

    .. math:: u \leftarrow u - g_k + \alpha (w - w^{t-1})

    Returns:
      A transform whose ``update`` takes the extra arguments ``round_context`` (its ``params``:
      the round's ``w^{t-1}``) and ``client_control`` (the client's ``g_k = grad L_k(w_k^{t-1})``,
      kept as its control variate).
    """

    def update_fn(updates, state, params=None, *, round_context=None, client_control=None, **_):
        if round_context is None or client_control is None or params is None:
            raise ValueError(
                "add_dynamic_regularizer needs the parameters and the extra arguments "
                "`round_context` and `client_control`."
            )
        out = jax.tree.map(
            lambda u, w, w_t, g: (u + (alpha * (w - w_t) - g).astype(u.dtype)).astype(u.dtype),
            updates,
            params,
            round_context.params,
            client_control,
        )
        return out, state

    return optax.GradientTransformationExtraArgs(lambda params: EmptyState(), update_fn)


def scale_by_round_learning_rate(flip_sign: bool = True) -> optax.GradientTransformationExtraArgs:
    r"""Scales by the round's learning rate, given by the engine as the extra arg ``learning_rate``.

    .. math:: u \leftarrow -\eta_r u

    Keeping the schedule outside the optimizer state means a client whose state is reset every
    round (Local-X) still follows the schedule over rounds, and the server's global direction
    ``g_G = -mean(Delta x) / (K eta_r)`` uses the same ``eta_r``.

    Args:
      flip_sign: negate (descent), as ``optax.scale_by_learning_rate``.
    """
    sign = -1.0 if flip_sign else 1.0

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, learning_rate=None, **extra_args):
        del params, extra_args
        if learning_rate is None:
            raise ValueError(
                "scale_by_round_learning_rate needs the extra argument `learning_rate`."
            )
        out = jax.tree.map(lambda u: (sign * learning_rate * u).astype(u.dtype), updates)
        return out, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class EmaState(NamedTuple):
    """State of :func:`ema`."""

    count: jax.Array  # shape=(), int32: shared schedule counter
    mu: PyTree


def ema(decay: float, *, first_step_init: bool = False) -> optax.GradientTransformationExtraArgs:
    r"""Exponential moving average of the updates, returned as the new direction.

    .. math:: m \leftarrow \text{decay} \cdot m + (1 - \text{decay}) \cdot g

    With ``first_step_init`` the first step sets ``m_0 = g_0`` (FedMuon (Zhang & Gao) Alg. 1 line
    1, where the
    recursion is written ``M <- (1 - beta) M + beta * grad``, i.e. ``decay = 1 - beta``). Without
    it, ``m_0 = 0`` and no bias correction is applied (FedMuon-LMO Alg. 1 line 8 with
    ``decay = 1 - alpha``).

    Args:
      decay: weight of the old average, in [0, 1).
      first_step_init: initialize the average with the first gradient.

    Returns:
      A transform whose state holds the average ``mu`` (like the params) and a shared counter.
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ema: decay={decay} must lie in [0, 1).")

    def init_fn(params):
        return EmaState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        mu = jax.tree.map(lambda m, g: decay * m + (1.0 - decay) * g, state.mu, updates)
        if first_step_init:
            first = state.count == 0
            mu = jax.tree.map(lambda m, g: jnp.where(first, g, m), mu, updates)
        mu = jax.tree.map(lambda m, g: m.astype(g.dtype), mu, updates)
        return mu, EmaState(count=optax.safe_increment(state.count), mu=mu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
