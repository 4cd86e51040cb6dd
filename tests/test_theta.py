"""Θ of each optimizer and the preconditioner drift of FedPAC (Liu et al.) Def. 1 / Eq. 7.

§3.2 names the preconditioner state of each instantiation: SOAP ``Θ = {L, R}``, Sophia
``Θ = {h}``, Muon ``Θ = {m}``. Eq. 7 is ``Δ_D = (1/N) Σ_i ||Θ_i − Θ̄||²`` with ``Θ̄`` the
clients' mean (Def. 1; the S sampled clients of a round, as in Theorem 1's ``Δ_D^r``).
"""

from __future__ import annotations

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedorth import fed
from fedorth.fed import local
from fedorth.fed import metrics as fed_metrics
from fedorth.optim import federated
from fedorth.optim.muon import MuonState
from fedorth.optim.soap import SoapState
from fedorth.optim.sophia import SophiaState

S = 3
PARAMS = {"w": jnp.zeros((6, 4)), "b": jnp.zeros(4)}


def _random_states(name: str, seed: int):
    """Client-stacked states of optimizer ``name`` with every float leaf random (shape-exact)."""
    tx = local.direction(name)
    state = jax.eval_shape(jax.vmap(tx.init), jax.tree.map(lambda p: jnp.stack([p] * S), PARAMS))
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: (
            jnp.asarray(rng.normal(size=x.shape), x.dtype)
            if federated.is_float(x)
            else jnp.zeros(x.shape, x.dtype)
        ),
        state,
    )


def _nodes(state, kind):
    return [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
        if isinstance(x, kind)
    ]


def _theta_leaves(name: str, state):
    """Θ by hand, read off the state types (the paper's §3.2 list)."""
    if name == "soap":
        (node,) = _nodes(state, SoapState)
        return jax.tree.leaves(node.GG)
    if name == "sophia":
        (node,) = _nodes(state, SophiaState)
        return jax.tree.leaves(node.nu)
    (node,) = _nodes(state, MuonState)
    return jax.tree.leaves(node.mu)


def _np_eq7(leaves):
    """Eq. 7 in float64: (1/S) Σ_i Σ_leaves ||Θ_i − Θ̄||_F²."""
    total = 0.0
    for x in leaves:
        x = np.asarray(x, np.float64)
        total += np.sum((x - x.mean(axis=0)) ** 2) / x.shape[0]
    return total


def _np_spectral(leaves):
    """Fig. 3's variant: (1/S) Σ_i Σ_{matrix leaves} ||Θ_i − Θ̄||_2²."""
    total = 0.0
    for x in leaves:
        x = np.asarray(x, np.float64)
        if x.ndim >= 3:
            dev = x - x.mean(axis=0)
            total += np.mean([np.linalg.norm(d, 2) ** 2 for d in dev])
    return total


@pytest.mark.parametrize("name", ["soap", "sophia", "muon"])
def test_drift_is_eq7_over_theta_only(name):
    """``preconditioner_drift`` equals Eq. 7 over Θ (NumPy float64) and ignores everything else:
    re-drawing every non-Θ float leaf (SOAP's Q and moments, Sophia's m, the Adam fallback of
    Muon's non-matrix leaves) leaves it unchanged to the bit, re-drawing Θ changes it."""
    states = _random_states(name, seed=0)
    mask = federated.theta_mask(states)
    drift = jax.jit(lambda st: fed_metrics.preconditioner_drift(st, spectral=True))
    got = drift(states)
    theta = _theta_leaves(name, states)
    np.testing.assert_allclose(float(got["precond_drift"]), _np_eq7(theta), rtol=1e-5)
    # Power iteration (16 steps) on 4x4 / 6x6 / 6x4 matrices: close to the exact spectral norm.
    np.testing.assert_allclose(float(got["precond_drift_spectral"]), _np_spectral(theta), rtol=2e-2)
    other = _random_states(name, seed=1)
    mixed = jax.tree.map(lambda m, a, b: a if m else b, mask, states, other)
    again = drift(mixed)
    assert float(again["precond_drift"]) == float(got["precond_drift"])
    assert float(again["precond_drift_spectral"]) == float(got["precond_drift_spectral"])
    swapped = jax.tree.map(lambda m, a, b: b if m else a, mask, states, other)
    assert float(drift(swapped)["precond_drift"]) != float(got["precond_drift"])


def test_theta_masks_name_the_papers_theta():
    """SOAP {L, R} (not Q, not the moments), Sophia {h} (not m), Muon {m} (not the fallback's
    Adam moments); AdamW declares none and keeps its uploaded leaves (m and v)."""
    for name in ("soap", "sophia", "muon"):
        states = _random_states(name, seed=0)
        flagged = federated.theta_mask(states)
        leaves, flags = jax.tree.leaves(states), jax.tree.leaves(flagged)
        picked = [x for x, m in zip(leaves, flags, strict=True) if m]
        expected = _theta_leaves(name, states)
        assert len(picked) == len(expected) and all(
            a is b for a, b in zip(picked, expected, strict=True)
        ), name
    adamw = _random_states("adamw", seed=0)
    assert not federated.declares_theta(adamw)
    assert jax.tree.leaves(federated.theta_mask(adamw)) == jax.tree.leaves(
        federated.upload_mask(adamw)
    )


def test_align_masks_are_theta_and_what_the_server_derives_from_it():
    """What FedPAC's Θ alignment warm-starts (``federated.align_mask``, FedPAC (Liu et al.) Alg. 2
    line 3): SOAP L, R and the shared count (not m, v, nor their moment_count, nor the bases Q,
    which each client's update-free call rebuilds); Sophia h and the count (Alg. 9 line 9's global
    schedule), not m; Muon its momentum, not the Adam fallback of the non-matrix leaf; AdamW (no Θ)
    everything. Uploaded and averaged: the aligned leaves that are uploaded, i.e. Θ itself."""
    states = {name: _random_states(name, seed=0) for name in ("soap", "sophia", "muon", "adamw")}
    picked = {}
    for name, st in states.items():
        flags = jax.tree.leaves(federated.align_mask(st))
        picked[name] = [x for x, m in zip(jax.tree.leaves(st), flags, strict=True) if m]
        sent = jax.tree.leaves(
            jax.tree.map(
                lambda a, b: bool(a and b), federated.upload_mask(st), federated.align_mask(st)
            )
        )
        uploaded = [x for x, m in zip(jax.tree.leaves(st), sent, strict=True) if m]
        expected = jax.tree.leaves(st) if name == "adamw" else _theta_leaves(name, st)
        if name == "adamw":
            expected = [x for x in expected if federated.is_float(x)]
        assert [id(x) for x in uploaded] == [id(x) for x in expected], name
    (soap,) = _nodes(states["soap"], SoapState)
    want = [soap.count, *jax.tree.leaves(soap.GG)]
    assert {id(x) for x in picked["soap"]} == {id(x) for x in want}
    (sophia,) = _nodes(states["sophia"], SophiaState)
    assert {id(x) for x in picked["sophia"]} == {
        id(sophia.count),
        *map(id, jax.tree.leaves(sophia.nu)),
    }
    (muon,) = _nodes(states["muon"], MuonState)
    assert {id(x) for x in picked["muon"]} == {id(x) for x in jax.tree.leaves(muon.mu)}
    assert len(picked["adamw"]) == len(jax.tree.leaves(states["adamw"]))


def test_local_soap_round_logs_eq7_drift_of_its_clients():
    """A Local-SOAP round (states reset, never averaged) logs the drift of its clients' final
    L/R: equal to Eq. 7 (NumPy float64) over the factors of the same clients run by hand (K = 3
    steps of the round's local optimizer on each client's quadratic, deterministic gradients),
    on the streamed path and on the stacked (spectral) path alike."""
    n, k, lr = 3, 3, 0.05
    data = jax.tree.map(jnp.asarray, fp.quadratic_clients(n, seed=5))
    alg = fed.get_algorithm("local_soap", {"name": "soap", "precondition_frequency": 2})
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    factors = []
    tx = alg.local_tx

    @jax.jit
    def client(i):
        p, state = params, tx.init(params)
        for _ in range(k):
            g = jax.grad(lambda q: fp.loss_fn(q, {}, fp.batch_fn(data, i, None), None)[0])(p)
            u, state = tx.update(g, state, p, learning_rate=lr, key=jax.random.key(0))
            p = optax.apply_updates(p, u)
        return state

    for i in range(n):
        (node,) = _nodes(client(i), SoapState)
        factors.append(jax.tree.leaves(node.GG))
    expected = _np_eq7([np.stack(f) for f in zip(*factors, strict=True)])
    assert expected > 0
    for spectral in (False, True):
        server, round_fn, _ = fp.start_rounds(
            alg,
            num_clients=n,
            clients_per_round=n,
            local_steps=k,
            learning_rate=lr,
            params=params,
            strategy="sequential",
            key=1,
            spectral_drift=spectral,
        )
        _, metrics = round_fn(server, data)
        np.testing.assert_allclose(float(metrics["precond_drift"]), expected, rtol=1e-4)
        assert ("precond_drift_spectral" in metrics) == spectral
