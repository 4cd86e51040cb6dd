"""FAFED's local direction: STORM momentum preconditioned by a per-round frozen second moment.

Wu, Huang, Hu, Huang, "Faster Adaptive Federated Learning", AAAI 2023, Alg. 1 (a baseline of
FedMuon (Zhang & Gao) Sec. 7). Clients keep a STORM momentum ``u`` and an Adam-type second moment
``v``; the
server averages ``x``, ``u`` and ``v`` at every communication, and the adaptive matrix
``A = diag(sqrt(v) + rho)`` is built once per round from the averaged ``v`` and kept fixed
during the local steps (the paper's counter-example shows that letting each client adapt ``A``
locally can diverge). Per local step ``k`` of a round::

    u_k = g_k + (1 - a)(u_{k-1} - g(x_{k-1}; xi_k))      (both gradients on batch xi_k)
    v_k = b2 v_{k-1} + (1 - b2) g_k^2
    A   = sqrt(v-bar) + rho                                (v at the round's start, frozen)
    x_{k+1} = x_k - eta u_k / A

The run starts with one communication: ``u_0 = m_0`` and ``v_0`` are the means over the clients
of their first gradients at ``x_0`` and of those gradients' squares, ``A = sqrt(v_0) + rho`` for
round 0, every client steps ``x_1 = x_0 - eta m_0`` (without ``A``) and its previous iterate is
``x_0``. The engine does this with the algorithm's round-0 pre-pass
(:func:`fafed_start_prepass`; its means reach the optimizer as the extra arguments
``fafed_g0_mean`` and ``fafed_g0_sq_mean``), and round 0's first local step takes both the start's
step and the first STORM step, ``x_2 - x_0 = -eta (m_0 + u_1 / A)``, so that round 0 has the
start plus ``K`` steps as in the reference code. Without those extra arguments (the transform on
its own) the first step is per client ``u_0 = g_0``, ``v_0 = g_0^2``, ``A = sqrt(g_0^2) + rho``.

At a round boundary: a round starts at the averaged ``x-bar`` with the averaged ``u-bar``,
``v-bar``; its first step takes a fresh gradient at ``x-bar`` and corrects it with the gradient,
on the same batch, at the client's own previous iterate ``x_i^prev`` (the point of its last step,
kept per client across rounds: :func:`fafed_persistent_mask`), ``u = g(x-bar) + (1 - a)(u-bar -
g(x_i^prev))``; ``A`` uses the averaged ``v-bar`` the round starts with.

Sources. The paper's Alg. 1 box could not be read (only its abstract could be reached; what is
said of the box here is from earlier notes). The one
implementation found is a PyTorch ``FAFED(train_set, test_set, model, args, device)``:
naya0000/FaFed, ``code/Image/FAFED.py`` and ``code/NLP/FAFED.py`` at commit fd3e4c1 (2023-10-24;
Xiao-Chenguang/FaFed is a fork of it). Its structure (``Iteration % args.inLoop`` communication,
``model_`` as the STORM point, ``x_para``) is that of the first author's released FedSGDA code
(xidongwu/Federated-Minimax-and-Conditional-Stochastic-Optimization, ``Fair
Classification/FSGDA.py``, commit ad55f9a), so it is probably the authors' code; it is not labelled
as such. Line by line, inside a round it is the recursion above: ``m = g + (1 - alpha)(m - ext
g(x_prev))``, ``v = beta v + (1 - beta) g^2``, ``x -= lr m / H`` with ``H = sqrt(v-bar) + rho``
rebuilt from the averaged ``v`` at each communication (``x``, ``m``, ``v`` averaged), where ``ext``
is 1 in the NLP script and 0.95 by default in the image script (a factor on the old gradient that
fedorth does not have: ``ext = 1``). It differs at round boundaries:

* its STORM correction of the first step after an averaging uses the client's own previous
  iterate (``model_`` is not reset), ``g(x-bar) + (1 - alpha)(u-bar - g(x_i^{K-1}))``. fedorth
  does the same (``start.Global.keep``): with ``x-bar`` there, that step would be
  ``a g(x-bar) + (1 - a) u-bar``, without the correction (with one local step per round, no
  variance reduction at all). tests/test_baselines.py (test_fafed_matches_the_reference_loop)
  transcribes the loop and checks the engine against it;
* its run starts with one communication (``m_0``, ``v_0`` the means of the clients' first
  gradients and of their squares, one plain SGD step ``x_1 = x_0 - lr m_0`` before round 1's own
  steps). fedorth does the same (rather than per-client ``u_0 = g_0``, ``v_0 =
  g_0^2``). Its start batch is the pre-pass's (local step index ``K``), not the
  data loader's first batch, and the per-round communication count leaves this one-time exchange
  out. The NLP script also clips both gradients by norm (``args.clip``); fedorth does not.

A second, third-party port (DadrasAli/fedbrew, ``fedbrew/clients/torch_fafed_client.py`` and
``fedbrew/servers/fafed.py``, commit 06e91b6) says it follows "Algorithm 2" of the paper as another
port (AdaFed's ``adafed/fl.py``, not found here) reads it, and quotes its line 3 as printed, ``x_1
= x_0 - eta m_0`` without ``A_0^-1``. It agrees with the code above on the start and on each client
keeping its own previous iterate, and differs from it at communication: there the server averages
``x``, ``m``, ``v`` and takes the round's last step itself, ``x-bar - eta m-bar / (sqrt(v-bar) +
rho)``, with no fresh gradient. So the two sources disagree with each other at the boundary;
fedorth follows the first code (docs/FIDELITY.md). The box's number is unconfirmed here (fedbrew
says Alg. 2; this module said Alg. 1).
The paper's decaying weights ``alpha_t = c eta_t^2`` and the interpolation
``x_{t+1} = x_t + eta_t (x~_{t+1} - x_t)`` are replaced by a constant ``a`` and the round's
learning rate (a schedule over rounds); no AMSGrad maximum is taken over rounds.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedorth.optim.storm import check_storm_weight, storm_estimate

PyTree = Any

# The extra arguments that carry the averaged start: the mean of the clients' first gradients
# ``m_0`` and of their squares ``v_0`` (the engine's pre-pass means of fafed_start_prepass).
START_MEAN = "fafed_g0_mean"
START_SQUARE_MEAN = "fafed_g0_sq_mean"


class FafedState(NamedTuple):
    """State of :func:`scale_by_fafed`.

    ``count`` counts all steps (shared across rounds when warm-started); ``round_step`` counts
    the steps of the current round and ``precond`` is per-round; ``prev_params``, the point of
    the client's last step, is its own across rounds: an algorithm aligns ``mu``, ``nu`` and
    ``count`` only and keeps ``prev_params`` per client,
    ``fedorth.fed.start.Global(mask=fafed_aggregate_mask, keep=fafed_persistent_mask)``.
    """

    count: jax.Array  # shape=(), int32: shared schedule counter
    round_step: jax.Array  # shape=(), int32: steps since init (reset every round)
    mu: PyTree  # STORM momentum u
    nu: PyTree  # second moment v
    precond: PyTree  # v frozen at the round's first step
    prev_params: PyTree  # previous iterate of the STORM recursion


def scale_by_fafed(
    a: float = 0.1, b2: float = 0.99, *, rho: float = 1e-3
) -> optax.GradientTransformationExtraArgs:
    r"""FAFED direction ``u_k / (sqrt(v_round) + rho)`` (Wu et al. 2023, Alg. 1; module docstring).

    Args:
      a: STORM weight of the fresh gradient, in (0, 1].
      b2: decay of the second moment, in [0, 1).
      rho: the constant added to ``sqrt(v)`` in the adaptive matrix, > 0.

    Returns:
      A transform with state :class:`FafedState`; ``update`` needs ``params`` and ``obj_fn``,
      and takes the averaged start from the extra arguments ``fafed_g0_mean``,
      ``fafed_g0_sq_mean`` and ``learning_rate`` when given (:func:`fafed_start_prepass`).
    """
    check_storm_weight(a, "scale_by_fafed")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"scale_by_fafed: b2={b2} must lie in [0, 1).")
    if not rho > 0:
        raise ValueError(f"scale_by_fafed: rho={rho} must be > 0.")

    def init_fn(params):
        # Distinct buffers per leaf: the federated round donates its state.
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return FafedState(
            count=jnp.zeros([], jnp.int32),
            round_step=jnp.zeros([], jnp.int32),
            mu=zeros(),
            nu=zeros(),
            precond=zeros(),
            prev_params=jax.tree.map(jnp.copy, params),
        )

    def update_fn(updates, state, params=None, *, obj_fn=None, **extra):
        if params is None or obj_fn is None:
            raise ValueError("scale_by_fafed: update() needs params and the extra arg `obj_fn`.")
        first = state.count == 0
        where = lambda c, x, y: jax.tree.map(lambda xx, yy: jnp.where(c, xx, yy), x, y)  # noqa: E731
        if START_MEAN in extra:
            # The reference code's start (module docstring): on the run's first step the
            # averaged m_0, v_0 of the clients' first gradients at x_0 (the algorithm's
            # pre-pass), x_1 = x_0 - eta m_0, then the first STORM step from x_1 with x_0 as its
            # previous iterate, on this step's batch. One gradient besides the engine's either
            # way: at x_1 on the first step (the engine's is at x_0), else at the previous iterate.
            m0, v0 = extra[START_MEAN], extra[START_SQUARE_MEAN]
            x1 = jax.tree.map(
                lambda p, m: (p - extra["learning_rate"] * m).astype(p.dtype), params, m0
            )
            g_other = jax.grad(obj_fn)(where(first, x1, state.prev_params))
            g_cur = where(first, g_other, updates)
            g_prev = where(first, updates, g_other)
            mu = where(first, m0, state.mu)
            nu = where(first, v0, state.nu)
            u = jax.tree.map(
                lambda g, m, gp: g + (1.0 - a) * (m.astype(g.dtype) - gp), g_cur, mu, g_prev
            )
            v = jax.tree.map(lambda n, g: b2 * n + (1.0 - b2) * g * g, nu, g_cur)
            round_v = nu  # H = sqrt(v_0) + rho on round 0, as the reference code builds it
            extra_step = where(first, m0, jax.tree.map(jnp.zeros_like, m0))
            prev = where(first, x1, params)
        else:
            # Without the averaged start: per client u_0 = g_0, v_0 = g_0^2.
            u = storm_estimate(updates, state.mu, state.prev_params, first, a, obj_fn)
            v = jax.tree.map(
                lambda g, n: jnp.where(first, g * g, b2 * n + (1.0 - b2) * g * g),
                updates,
                state.nu,
            )
            round_v = where(first, v, state.nu)  # on the very first step, g_0^2
            extra_step = None
            prev = params
        # A = sqrt(v) + rho from the v the round starts with (the averaged v-bar), as the
        # reference code builds it at communication, frozen for the round.
        precond = where(state.round_step == 0, round_v, state.precond)
        direction = jax.tree.map(lambda uu, p: uu / (jnp.sqrt(p) + rho), u, precond)
        if extra_step is not None:
            # x_2 - x_0 = -eta (m_0 + u_1 / A): the start's step and the first STORM step.
            direction = jax.tree.map(lambda d, m: d + m.astype(d.dtype), direction, extra_step)
        new = FafedState(
            count=optax.safe_increment(state.count),
            round_step=optax.safe_increment(state.round_step),
            mu=u,
            nu=v,
            precond=precond,
            prev_params=jax.tree.map(jnp.copy, prev),
        )
        return direction, new

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _fafed_mask(opt_state: PyTree, **marks: bool) -> PyTree:
    """Bools like ``opt_state``: on a :class:`FafedState`, ``marks[field]`` (default False)."""

    def mark(node):
        if isinstance(node, FafedState):
            every = lambda tree, keep: jax.tree.map(lambda _: keep, tree)  # noqa: E731
            return FafedState(
                **{f: every(getattr(node, f), marks.get(f, False)) for f in FafedState._fields}
            )
        return jax.tree.map(lambda _: False, node)

    return jax.tree.map(mark, opt_state, is_leaf=lambda n: isinstance(n, FafedState))


def fafed_aggregate_mask(opt_state: PyTree) -> PyTree:
    """Bools like ``opt_state``: True on the leaves FAFED aligns (``count``, ``mu``, ``nu``)."""
    return _fafed_mask(opt_state, count=True, mu=True, nu=True)


def fafed_persistent_mask(opt_state: PyTree) -> PyTree:
    """Bools like ``opt_state``: True on the leaf each client keeps across rounds
    (``prev_params``, its own previous iterate, as the reference code never resets ``model_``)."""
    return _fafed_mask(opt_state, prev_params=True)


def fafed_start_prepass(ctx, client) -> dict:
    """``corrections.Prepass`` of FAFED's start: on round 0 each sampled client's gradient
    at ``x_0`` and its square (the server averages them into ``m_0``, ``v_0``); zeros, with no
    gradient computed (``lax.cond`` on the unbatched round counter), on later rounds."""
    params = ctx.params

    def first():
        g = client.grad_fn(params)
        return {"fafed_g0": g, "fafed_g0_sq": jax.tree.map(jnp.square, g)}

    def later():
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return {"fafed_g0": zeros(), "fafed_g0_sq": zeros()}

    return jax.lax.cond(ctx.round == 0, first, later)
