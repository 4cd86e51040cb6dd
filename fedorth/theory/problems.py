r"""Federated toy problems with known optima, for the theory notebooks.

* :func:`theorem1_problem`: FedMuon-LMO Appendix D (proof of Theorem 1), ``n = 2`` clients,
  ``f_1(x) = x^2/2``, ``f_2(x) = (x + a)^2/2``, ``x_0 = -a/4``: Local Muon never moves.
* :func:`quadratic_problem`: clients with heterogeneous matrix quadratics
  ``f_i(W) = 1/2 <W - B_i, H_i (W - B_i)>`` (``H_i`` symmetric positive definite, acting on the
  rows of ``W``) and optional injected heavy-tailed gradient noise (FedMuon (Zhang & Gao), Fed
  minimax (Zhang & Gao)).

Each returns a :class:`ToyProblem`: the engine-facing ``loss_fn(params, model_state, batch, key)``
and ``batch_fn(data, client_id, key)`` of :func:`fedorth.fed.make_round_fn`, the client data, the
initial parameters, the global minimizer of ``f = (1/n) sum_i f_i`` and ``f`` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedorth.theory.minimax_toy import heavy_tailed_noise

PyTree = Any

NOISES = ("none", "gaussian", "pareto", "student_t")

__all__ = ["NOISES", "ToyProblem", "quadratic_problem", "theorem1_problem"]


@dataclasses.dataclass(frozen=True, eq=False)
class ToyProblem:
    """A federated problem for :func:`fedorth.fed.make_round_fn`.

    Attributes:
      loss_fn: ``loss_fn(params, model_state, batch, key) -> (loss, (model_state, {}))``.
      batch_fn: ``batch_fn(data, client_id, key) -> batch``.
      data: client-stacked arrays read by ``batch_fn`` (pass them to the round function).
      params: initial parameters.
      optimum: the minimizer of ``objective``.
      objective: ``objective(params)``, the noiseless global loss ``(1/n) sum_i f_i``.
      num_clients: ``n``.
    """

    loss_fn: Callable[..., Any]
    batch_fn: Callable[..., Any]
    data: PyTree
    params: PyTree
    optimum: PyTree
    objective: Callable[[PyTree], jax.Array]
    num_clients: int


def theorem1_problem(a: float = 1.0) -> ToyProblem:
    r"""FedMuon-LMO's counterexample to Local Muon (Theorem 1, proof in Appendix D).

    .. math::
      f_1(x) = \tfrac12 x^2, \quad f_2(x) = \tfrac12 (x + a)^2, \quad x_0 = -a/4, \quad
      x^\star = -a/2.

    At ``x_0`` the local gradients are ``-a/4`` and ``3a/4``: their LMOs (normalized directions,
    ``d = 1``) are ``+1`` and ``-1`` and cancel in the server average, whatever the momentum
    ``M_i = (1 - (1 - alpha)^r) grad f_i(x_0)`` -- so LocalMuon's iterate never moves.

    The parameter is the ``1 x 1`` matrix ``{"w": [[x]]}`` so that every LMO of
    :func:`fedorth.optim.scale_by_lmo` treats it as a matrix; the spectral LMO of a ``1 x 1``
    matrix is its sign, the Euclidean LMO of the paper. The engine's Muon direction (``muon``,
    ``fedorth.fed.local``) sends degenerate matrices such as this one to its non-matrix fallback
    (``fedorth.optim.muon.is_muon_matrix``): to run it on this problem, embed ``x`` in the
    diagonal of a ``2 x 2`` matrix, as ``notebooks/localmuon_bias.ipynb`` does.

    Args:
      a: the shift of ``f_2`` (``a != 0``).

    Returns:
      A :class:`ToyProblem` with two clients (deterministic gradients: ``key`` is unused).
    """
    if a == 0:
        raise ValueError("a must be nonzero (a = 0 makes the clients identical).")

    def loss_fn(params, model_state, batch, key):
        del key
        x = params["w"]
        return 0.5 * jnp.sum((x + batch) ** 2), (model_state, {})

    def batch_fn(data, client_id, key):
        del key
        return data["shift"][client_id]

    def objective(params):
        x = params["w"]
        return 0.25 * (jnp.sum(x**2) + jnp.sum((x + a) ** 2))

    return ToyProblem(
        loss_fn=loss_fn,
        batch_fn=batch_fn,
        data={"shift": jnp.asarray([0.0, a])},
        params={"w": jnp.full((1, 1), -a / 4)},
        optimum={"w": jnp.full((1, 1), -a / 2)},
        objective=objective,
        num_clients=2,
    )


def quadratic_problem(
    num_clients: int,
    shape: tuple[int, int] = (8, 4),
    *,
    seed: int,
    heterogeneity: float = 1.0,
    condition: float = 10.0,
    noise: str = "none",
    tail_index: float = 2.0,
    noise_scale: float = 0.0,
) -> ToyProblem:
    r"""Clients with heterogeneous matrix quadratics and optional heavy-tailed gradient noise.

    .. math::
      f_i(W) = \tfrac12 \langle W - B_i, H_i (W - B_i) \rangle, \quad
      W^\star = \Big(\sum_i H_i\Big)^{-1} \sum_i H_i B_i,

    with ``H_i = Q_i diag(lambda_i) Q_i^T`` (random rotations, eigenvalues log-spaced in
    ``[1, condition]``) and ``B_i = heterogeneity * N(0, 1)``. The stochastic loss is
    ``f_i(W) + noise_scale * <xi, W>`` with ``xi`` i.i.d. zero-mean coordinates of tail index
    ``s`` (:func:`fedorth.theory.minimax_toy.heavy_tailed_noise`: ``"pareto"`` has
    ``P(|xi| > t) = (1 + t)^{-s}``, ``"student_t"`` has ``s`` degrees of freedom), so
    ``E ||grad - grad f_i||^p < infinity`` exactly for ``p < s`` (FedMuon (Zhang & Gao) Assumption
    3.3 with
    any ``p < s``). ``tail_index`` and ``noise_scale`` are stored in ``data`` (entries
    ``"tail_index"``, ``"noise_scale"``): replace them to sweep the noise without recompiling.

    Args:
      num_clients: ``n``.
      shape: ``(rows, cols)`` of ``W``.
      seed: NumPy seed of ``H_i`` and ``B_i``.
      heterogeneity: scale of the client minimizers ``B_i`` (0: all equal to 0).
      condition: largest eigenvalue of each ``H_i`` (the smallest is 1).
      noise: one of :data:`NOISES` (static: it fixes the program).
      tail_index: ``s`` in (1, 2] for ``"pareto"``/``"student_t"``.
      noise_scale: multiplies the noise.

    Returns:
      A :class:`ToyProblem`; ``params`` is ``{"w": zeros(shape)}``.
    """
    if noise not in NOISES:
        raise ValueError(f"noise={noise!r} is unknown; valid: {NOISES}.")
    if noise in ("pareto", "student_t") and not 1.0 < tail_index <= 2.0:
        raise ValueError(
            f"tail_index={tail_index} must lie in (1, 2] (FedMuon (Zhang & Gao) Assumption 3.3)."
        )
    if num_clients < 1:
        raise ValueError(f"num_clients={num_clients} must be >= 1.")
    if not condition >= 1.0:
        raise ValueError(f"condition={condition} must be >= 1.")
    if noise_scale < 0:
        raise ValueError(f"noise_scale={noise_scale} must be >= 0.")
    rows, cols = shape
    rng = np.random.default_rng(seed)
    hess = []
    for _ in range(num_clients):
        q, _ = np.linalg.qr(rng.normal(size=(rows, rows)))
        lam = np.geomspace(1.0, condition, rows)
        hess.append((q * lam) @ q.T)
    hess = np.stack(hess)
    shifts = heterogeneity * rng.normal(size=(num_clients, rows, cols))
    optimum = np.linalg.solve(hess.sum(0), np.einsum("nij,njk->ik", hess, shifts))
    h_j, b_j = jnp.asarray(hess), jnp.asarray(shifts)

    def loss_fn(params, model_state, batch, key):
        w = params["w"]
        dw = w - batch["B"]
        loss = 0.5 * jnp.sum(dw * (batch["H"] @ dw))
        if noise != "none":
            xi = heavy_tailed_noise(
                key, w.shape, tail_index=batch["tail_index"], noise=noise, dtype=w.dtype
            )
            loss = loss + jnp.sum(jax.lax.stop_gradient(batch["noise_scale"] * xi) * w)
        return loss, (model_state, {})

    def batch_fn(data, client_id, key):
        del key  # the noise is drawn in loss_fn from the engine's per-step model key
        return {
            "H": data["H"][client_id],
            "B": data["B"][client_id],
            "tail_index": data["tail_index"],
            "noise_scale": data["noise_scale"],
        }

    def objective(params):
        w = params["w"]
        dw = w[None] - b_j.astype(w.dtype)
        return 0.5 * jnp.mean(jnp.sum(dw * (h_j.astype(w.dtype) @ dw), axis=(1, 2)))

    data = {
        "H": h_j,
        "B": b_j,
        "tail_index": jnp.asarray(tail_index, h_j.dtype),
        "noise_scale": jnp.asarray(noise_scale, h_j.dtype),
    }
    return ToyProblem(
        loss_fn=loss_fn,
        batch_fn=batch_fn,
        data=data,
        params={"w": jnp.zeros(shape, h_j.dtype)},
        optimum={"w": jnp.asarray(optimum, h_j.dtype)},
        objective=objective,
        num_clients=num_clients,
    )
