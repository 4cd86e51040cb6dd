"""Small federated problems with closed-form gradients, and the engine runs the tests share.

Client ``i`` has the quadratic ``f_i(W, b) = 1/2 <W - B_i, H_i (W - B_i)> + 1/2 ||b - c_i||^2``
with ``H_i`` symmetric positive definite acting on the rows of ``W`` (heterogeneous Hessians and
minimizers). Batches are the client's whole data, so gradients are deterministic and a float64
NumPy re-implementation of an algorithm box can follow the engine step by step.

:func:`start_rounds` builds the server state and the round of an algorithm on such a problem
(or on any ``loss_fn``/``batch_fn``), :func:`run_rounds` runs a few rounds of it; under the
``x64`` fixture of tests/conftest.py both run in float64.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedorth import fed


def quadratic_clients(num_clients: int, rows: int = 4, cols: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    hess = []
    for _ in range(num_clients):
        q = rng.normal(size=(rows, rows))
        hess.append(np.eye(rows) * 0.5 + q @ q.T / rows)
    data = {
        "H": np.stack(hess),
        "B": rng.normal(size=(num_clients, rows, cols)) * 2.0,
        "c": rng.normal(size=(num_clients, cols)),
    }
    return data


def loss_fn(params, model_state, batch, key):
    del key
    dw = params["w"] - batch["B"]
    loss = 0.5 * jnp.sum(dw * (batch["H"] @ dw))
    if "b" in params:
        loss = loss + 0.5 * jnp.sum((params["b"] - batch["c"]) ** 2)
    return loss, (model_state, {})


def key_noise(key) -> jax.Array:
    """A number in [-1/2, 1/2) read off the bits of a PRNG key (of any implementation).

    A loss term ``key_noise(key) * sum(W)`` makes every result depend on each key the engine
    hands the loss (a reused, shifted or dropped key changes the numbers), without drawing
    random numbers: threefry's sampling code (``jax.random.normal``) in the differentiated loss
    was a quarter of a small round's compile time."""
    words = jax.random.key_data(key).reshape(-1)
    word = functools.reduce(jnp.bitwise_xor, [words[i] for i in range(words.shape[0])])
    return (word >> 8).astype(jnp.float32) * 2.0**-24 - 0.5  # 24 bits: exact in float32


def noisy_loss_fn(params, model_state, batch, key):
    """:func:`loss_fn` plus ``0.1 key_noise(key) sum(W)``: the per-client, per-step keys show."""
    loss, aux = loss_fn(params, model_state, batch, key)
    return loss + 0.1 * key_noise(key) * jnp.sum(params["w"]), aux


def batch_fn(data, client_id, key):
    del key
    return jax.tree.map(lambda x: x[client_id], data)


def np_grads(data, i, w, b):
    """Float64 gradients of client ``i`` at ``(w, b)``."""
    return data["H"][i] @ (w - data["B"][i]), b - data["c"][i]


def np_scaffold(data, *, rounds, num_clients, clients_per_round, local_steps, lr, sizes=None):
    """Float64 SCAFFOLD (Karimireddy et al. 2020, Alg. 1, option II) with partial participation:
    ``(w, b, c, c_i)`` after ``rounds`` rounds. ``x`` takes the mean of the sampled updates,
    weighted by ``sizes[i]`` when given (``fed.aggregation="examples"``); ``c`` the sum of the
    control-variate changes over ``N``."""
    n, k = num_clients, local_steps
    w, b = np.zeros((4, 3)), np.zeros(3)
    c = [np.zeros((4, 3)), np.zeros(3)]
    ci = [[np.zeros((4, 3)), np.zeros(3)] for _ in range(n)]
    for r in range(rounds):
        ids = sampled_ids(jax.random.key(0), r, n, clients_per_round)
        deltas, dcs = [], []
        for i in ids:
            yw, yb = w.copy(), b.copy()
            for _ in range(k):
                gw, gb = np_grads(data, i, yw, yb)
                yw = yw - lr * (gw - ci[i][0] + c[0])
                yb = yb - lr * (gb - ci[i][1] + c[1])
            new = [ci[i][0] - c[0] + (w - yw) / (k * lr), ci[i][1] - c[1] + (b - yb) / (k * lr)]
            dcs.append([new[0] - ci[i][0], new[1] - ci[i][1]])
            deltas.append([yw - w, yb - b])
            ci[i] = new
        weights = np.ones(len(ids)) if sizes is None else np.asarray(sizes, float)[ids]
        weights = weights / weights.sum()
        w = w + sum(p * d[0] for p, d in zip(weights, deltas, strict=True))
        b = b + sum(p * d[1] for p, d in zip(weights, deltas, strict=True))
        c = [c[0] + sum(d[0] for d in dcs) / n, c[1] + sum(d[1] for d in dcs) / n]
    return w, b, c, ci


def global_optimum(data):
    """Minimizer of ``(1/N) sum_i f_i``: ``W* = (sum H_i)^{-1} sum H_i B_i``, ``b* = mean c_i``."""
    h = data["H"].sum(0)
    w = np.linalg.solve(h, np.einsum("nij,njk->ik", data["H"], data["B"]))
    return w, data["c"].mean(0)


def np_newton_schulz(u, steps, coeffs=(15 / 8, -5 / 4, 3 / 8), eps=1e-7):
    """Float64 Newton-Schulz: X <- aX + (bA + cA^2)X with A = XX^T, X_0 = u / (||u||_F + eps)."""
    x = u / (np.linalg.norm(u) + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    a, b, c = coeffs
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@functools.partial(jax.jit, static_argnums=(2, 3))
def _sampled_ids(key, round_index, num_clients, clients_per_round):
    from fedorth.fed.round import sample_clients

    return sample_clients(key, round_index, num_clients, clients_per_round)[1]


def sampled_ids(key, round_index, num_clients, clients_per_round):
    """The ids ``fed.round.sample_clients`` draws for round ``round_index`` (one compiled
    program per ``(num_clients, clients_per_round)``; integer key arithmetic, the same ids as
    op-by-op)."""
    return np.asarray(_sampled_ids(key, round_index, num_clients, clients_per_round))


def zero_params() -> dict:
    """The parameters the engine tests start from: ``W = 0`` (4 x 3) and ``b = 0`` (3), in
    JAX's default float dtype (float64 under the ``x64`` fixture)."""
    return {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}


class Rounds(NamedTuple):
    """An algorithm ready to run: its server state, its round and the round's settings."""

    server: Any
    round_fn: Any
    config: fed.RoundConfig


def start_rounds(
    algorithm,
    *,
    num_clients: int,
    clients_per_round: int,
    local_steps: int,
    learning_rate: float,
    params: dict | None = None,
    model_state: dict | None = None,
    strategy: str = "auto",
    chunk_size: int | None = None,
    key: int = 0,
    loss_fn=loss_fn,
    batch_fn=batch_fn,
    timer=None,
    **round_options,
) -> Rounds:
    """``fed.init_server`` (server key ``jax.random.key(key)``) and ``fed.make_round_fn`` of
    ``algorithm`` on ``loss_fn``/``batch_fn`` (default: the quadratic clients above), from
    ``params`` (default :func:`zero_params`) and ``model_state`` (default none: ``{}``);
    ``round_options``: further fields of ``fed.RoundConfig`` (e.g. ``spectral_drift``);
    ``timer``: the clock of a measured strategy (``fed.make_round_fn``'s)."""
    config = fed.RoundConfig(
        num_clients=num_clients,
        clients_per_round=clients_per_round,
        local_steps=local_steps,
        learning_rate=learning_rate,
        strategy=strategy,
        chunk_size=chunk_size,
        **round_options,
    )
    params = zero_params() if params is None else params
    server = fed.init_server(
        algorithm,
        params,
        {} if model_state is None else model_state,
        num_clients=num_clients,
        key=jax.random.key(key),
        privacy=round_options.get("privacy"),
    )
    timing = {} if timer is None else {"timer": timer}
    return Rounds(server, fed.make_round_fn(algorithm, loss_fn, batch_fn, config, **timing), config)


def run_rounds(algorithm, data, *, rounds: int, **settings) -> tuple[Any, list[dict]]:
    """The server state after ``rounds`` rounds of ``algorithm`` on ``data`` (NumPy arrays,
    made JAX arrays once), and each round's metrics; ``settings`` as :func:`start_rounds`."""
    server, round_fn, _ = start_rounds(algorithm, **settings)
    data = jax.tree.map(jnp.asarray, data)
    history = []
    for _ in range(rounds):
        server, metrics = round_fn(server, data)
        history.append(metrics)
    return server, history
