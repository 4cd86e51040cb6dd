"""The round's context (``fedorth.fed.RoundContext``): what every spec method receives, and two
algorithms written outside the package on it, against float64 NumPy transcriptions of their
papers' boxes under every execution strategy.

* FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks", Alg. 2): client
  ``i`` runs SGD on ``f_i(w) + mu/2 ||w - w^t||^2``; the anchor ``w^t`` is kept in a
  ``ServerQuantities`` and must be the model the round's clients start from.
* FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization", Alg. 1):
  client ``i`` runs SGD on ``f_i(w) - <grad_i, w> + alpha/2 ||w - w^t||^2``, then
  ``grad_i <- grad_i - alpha (w_i - w^t)``; the server ``h <- h - alpha/N sum_{i in S}(w_i -
  w^t)``, ``w^{t+1} = mean_{i in S} w_i - h / alpha``. Its hooks read ``N``, ``S`` and the
  anchor from the context.
"""

from __future__ import annotations

import dataclasses

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedorth import fed
from fedorth.fed import corrections, local, quantities, update

N, S, K, R = 5, 3, 3, 3
LR = 0.05
STRATEGIES = [
    ("vmap", None),
    ("sequential", None),
    ("chunked", 2),
    pytest.param("sharded", None, marks=pytest.mark.cpu_devices),
]

pytestmark = pytest.mark.usefixtures("x64")


def _gradient_term(name: str, term):
    """A transform adding ``term(params, **extra_args)`` to the gradient (before the optimizer's
    direction), reading the round's extra arguments."""

    def update_fn(updates, state, params=None, **extra_args):
        added = term(params, **extra_args)
        return jax.tree.map(lambda g, a: g + a.astype(g.dtype), updates, added), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def _run(algorithm, data, strategy, chunk_size):
    """The server state after ``R`` rounds of ``algorithm`` (``N``, ``S``, ``K``, ``LR``)."""
    settings = dict(num_clients=N, clients_per_round=S, local_steps=K, learning_rate=LR)
    return fp.run_rounds(
        algorithm, data, rounds=R, strategy=strategy, chunk_size=chunk_size, **settings
    )[0]


# ---------------------------------------------------------------------------------- FedProx


def fedprox_with_quantities(mu: float) -> fed.FedAlgorithm:
    """FedProx whose anchor ``w^t`` is a server quantity (``ServerState.extra["anchor"]``)."""

    def proximal(params, *, anchor, **_):
        return jax.tree.map(lambda w, w_t: mu * (w - w_t), params, anchor)

    return fed.FedAlgorithm(
        name="user_fedprox",
        local_tx=local.local_tx(local.direction("sgd"), pre=(_gradient_term("prox", proximal),)),
        quantities=quantities.ServerQuantities(
            init=lambda params: {"anchor": jax.tree.map(jnp.copy, params)},
            # The model the next round's clients start from: the parameters after the step.
            update=lambda ctx, new, reports: {"anchor": new.params},
        ),
    )


def np_client(data, i, w, b, extra_grads):
    """Client ``i``'s ``K`` float64 SGD steps from ``(w, b)`` on ``f_i`` plus a term whose
    gradient is ``extra_grads(yw, yb)``."""
    yw, yb = w.copy(), b.copy()
    for _ in range(K):
        gw, gb = fp.np_grads(data, i, yw, yb)
        ew, eb = extra_grads(yw, yb)
        yw, yb = yw - LR * (gw + ew), yb - LR * (gb + eb)
    return yw, yb


def np_fedprox(data, mu, rounds):
    w, b = np.zeros((4, 3)), np.zeros(3)
    for r in range(rounds):
        ends = [
            np_client(data, i, w, b, lambda yw, yb: (mu * (yw - w), mu * (yb - b)))
            for i in fp.sampled_ids(jax.random.key(0), r, N, S)
        ]
        w, b = np.mean([e[0] for e in ends], 0), np.mean([e[1] for e in ends], 0)
    return w, b


@pytest.mark.parametrize("strategy,chunk_size", STRATEGIES)
def test_fedprox_anchor_in_server_quantities_is_the_rounds_model(strategy, chunk_size):
    """A user's FedProx keeping ``w^t`` in a ``ServerQuantities`` gets this round's ``w^t``, not
    the previous round's: 3 rounds equal the float64 box."""
    data = fp.quadratic_clients(N, seed=3)
    mu = 0.5
    server = _run(fedprox_with_quantities(mu), data, strategy, chunk_size)
    w, b = np_fedprox(data, mu, R)
    np.testing.assert_allclose(server.params["w"], w, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(server.params["b"], b, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(server.extra["anchor"]["w"], server.params["w"])


# ----------------------------------------------------------------------------------- FedDyn


@dataclasses.dataclass(frozen=True)
class FedDynGradient(corrections.ControlVariate):
    """FedDyn's ``grad_i <- grad_i - alpha (w_i - w^t)`` (Acar et al. 2021, Alg. 1), kept as
    the client's control variate ``c_i``; the server's ``c`` is then FedDyn's ``h``."""

    alpha: float

    def update(self, ctx, control_i, delta, opt_state):
        del ctx, opt_state
        return jax.tree.map(lambda g, d: g - self.alpha * d, control_i, delta)


def feddyn(alpha: float) -> fed.FedAlgorithm:
    """FedDyn from the axes' contracts, outside the package."""

    def dynamic_regularizer(params, *, round_context, client_control, **_):
        # -<grad_i, w> + alpha/2 ||w - w^t||^2: its gradient, anchored at the round's w^t.
        return jax.tree.map(
            lambda w, w_t, g: alpha * (w - w_t) - g, params, round_context.params, client_control
        )

    def combine(ctx, deltas_C, reports_C):
        del reports_C
        mean = jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas_C)
        part = ctx.clients_per_round / ctx.num_clients
        # h+ = h - alpha/N sum_{i in S}(w_i - w^t); w^{t+1} = w^t + mean(dw) - h+ / alpha.
        return jax.tree.map(
            lambda h, d: d - (h - alpha * part * d) / alpha, ctx.server.control, mean
        )

    return fed.FedAlgorithm(
        name="user_feddyn",
        local_tx=local.local_tx(
            local.direction("sgd"), pre=(_gradient_term("dyn", dynamic_regularizer),)
        ),
        corrections=corrections.Corrections(control=FedDynGradient(alpha)),
        server=update.ServerUpdate(combine=combine),
    )


def np_feddyn(data, alpha, rounds):
    w, b = np.zeros((4, 3)), np.zeros(3)
    h = [np.zeros((4, 3)), np.zeros(3)]
    grads = [[np.zeros((4, 3)), np.zeros(3)] for _ in range(N)]
    for r in range(rounds):
        ends = []
        for i in fp.sampled_ids(jax.random.key(0), r, N, S):
            gi = grads[i]
            yw, yb = np_client(
                data, i, w, b, lambda yw, yb: (alpha * (yw - w) - gi[0], alpha * (yb - b) - gi[1])
            )
            grads[i] = [grads[i][0] - alpha * (yw - w), grads[i][1] - alpha * (yb - b)]
            ends.append((yw, yb))
        h = [
            h[0] - alpha / N * sum(e[0] - w for e in ends),
            h[1] - alpha / N * sum(e[1] - b for e in ends),
        ]
        w = np.mean([e[0] for e in ends], 0) - h[0] / alpha
        b = np.mean([e[1] for e in ends], 0) - h[1] / alpha
    return w, b, h, grads


@pytest.mark.parametrize("strategy,chunk_size", STRATEGIES)
def test_feddyn_outside_the_package_matches_its_box(strategy, chunk_size):
    """FedDyn's hooks read ``N``, ``S``, the anchor and the client's own ``grad_i`` from the
    round's context: 3 rounds equal the float64 box (parameters, ``h``, every ``grad_i``)."""
    data = fp.quadratic_clients(N, seed=4)
    alpha = 0.3
    server = _run(feddyn(alpha), data, strategy, chunk_size)
    w, b, h, grads = np_feddyn(data, alpha, R)
    tol = dict(rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(server.params["w"], w, **tol)
    np.testing.assert_allclose(server.params["b"], b, **tol)
    np.testing.assert_allclose(server.control["w"], h[0], **tol)
    for i in range(N):
        np.testing.assert_allclose(server.clients.control["w"][i], grads[i][0], **tol)


@pytest.mark.parametrize("strategy", ["sequential", "vmap"])
def test_shipped_feddyn_matches_its_box(strategy):
    """fedorth's own ``feddyn`` (``fed.get_algorithm("feddyn")``) against the same float64
    box: parameters, ``h`` and every client's ``grad L_k`` (absent clients keep theirs)."""
    data = fp.quadratic_clients(N, seed=4)
    alpha = 0.3
    server = _run(fed.get_algorithm("feddyn", {"name": "sgd"}, alpha=alpha), data, strategy, None)
    w, b, h, grads = np_feddyn(data, alpha, R)
    tol = dict(rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(server.params["w"], w, **tol)
    np.testing.assert_allclose(server.params["b"], b, **tol)
    np.testing.assert_allclose(server.control["w"], h[0], **tol)
    np.testing.assert_allclose(server.control["b"], h[1], **tol)
    for i in range(N):
        np.testing.assert_allclose(server.clients.control["w"][i], grads[i][0], **tol)
        np.testing.assert_allclose(server.clients.control["b"][i], grads[i][1], **tol)


# --------------------------------------------------------------------------- the context


def test_every_spec_method_receives_the_same_round_context():
    """The local optimizer, the client start, the control variate, the report, the server
    quantities, the combination and the rule all see one context: the sampled ids, ``N``, ``S``,
    ``K``, ``eta_r``, the round index and key, and the server state the round started from."""
    seen: dict[str, list] = {}

    def record(where, ctx):
        # The ids, round and learning rate of the context each call received, as numbers.
        numbers = (ctx.client_ids, ctx.round, ctx.learning_rate, jax.random.key_data(ctx.key))
        jax.debug.callback(
            lambda *xs: seen.setdefault(where, []).append([np.asarray(x) for x in xs]), *numbers
        )
        assert (ctx.num_clients, ctx.clients_per_round, ctx.local_steps) == (N, S, K), where

    def spy_update(updates, state, params=None, *, round_context, **_):
        record("local_tx", round_context)
        return updates, state

    @dataclasses.dataclass(frozen=True)
    class SpyRule(update.Mean):
        def scale(self, ctx):
            record("rule", ctx)
            return 1.0

    @dataclasses.dataclass(frozen=True)
    class SpyControl(corrections.ControlVariate):
        def update(self, ctx, control_i, delta, opt_state):
            record("control", ctx)
            return control_i

    def spy_report(ctx, client):
        record("report", ctx)
        return {"delta": client.delta}

    def spy_quantities(ctx, new, reports):
        record("quantities", ctx)
        return {}

    def spy_combine(ctx, deltas_C, reports_C):
        record("combine", ctx)
        return jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas_C)

    base = fed.get_algorithm("fedavg", {"name": "sgd"})
    algorithm = dataclasses.replace(
        base,
        local_tx=optax.chain(
            optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), spy_update),
            base.local_tx,
        ),
        corrections=corrections.Corrections(control=SpyControl()),
        quantities=quantities.ServerQuantities(init=lambda p: {}, update=spy_quantities),
        report=quantities.ClientReport(spy_report),
        server=update.ServerUpdate(rule=SpyRule(), combine=spy_combine),
    )
    key = jax.random.key(7)
    server, round_fn, _ = fp.start_rounds(
        algorithm,
        num_clients=N,
        clients_per_round=S,
        local_steps=K,
        learning_rate=LR,
        key=7,
        strategy="vmap",
    )
    data = jax.tree.map(jnp.asarray, fp.quadratic_clients(N))
    for _ in range(2):
        server, _ = round_fn(server, data)
    jax.effects_barrier()
    assert set(seen) == {"local_tx", "rule", "control", "report", "quantities", "combine"}
    for where, calls in seen.items():
        rounds = sorted({int(c[1]) for c in calls})
        assert rounds == [0, 1], where
        for ids, round_index, lr, key_data in calls:
            want_ids = fp.sampled_ids(key, int(round_index), N, S)
            np.testing.assert_array_equal(ids, want_ids, err_msg=where)
            np.testing.assert_allclose(lr, LR, rtol=1e-7, err_msg=where)
            want_key = jax.random.key_data(jax.random.fold_in(key, int(round_index)))
            np.testing.assert_array_equal(key_data, want_key, err_msg=where)


def test_round_context_is_frozen():
    server, _, config = fp.start_rounds(
        fed.get_algorithm("fedavg", {"name": "sgd"}),
        num_clients=N,
        clients_per_round=S,
        local_steps=K,
        learning_rate=LR,
    )
    ctx = fed.context.begin_round(server, config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.learning_rate = 1.0
    assert ctx.params is server.params and int(ctx.round) == 0
    leaves = jax.tree.leaves(ctx)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves), "N, S, K are static"
