"""Fed-Sophia and FedPM: second-order FL baselines of FedPAC (Liu et al.) (Appendix, Table 12).

* **Fed-Sophia** (Elbakary et al., "Fed-Sophia: A Communication-Efficient Second-Order Federated
  Learning Algorithm", ICC 2024, arXiv:2406.06655, Alg. 1): each device runs Sophia locally --
  ``m <- b1 m + (1 - b1) g``, every ``f_h`` steps ``h <- b2 h + (1 - b2) h-hat``,
  ``x <- x - eta [clip(m / max(h, eps), rho) + lambda x]`` -- and the server averages the
  models. Devices keep their own ``m`` and ``h`` between the rounds they join
  (``fed.options.client_state="persistent"``: ``start.Persistent()``; ``"reset"``:
  ``start.Reset()``, which restarts them every round, i.e. Local Sophia).
* **FedPM** (Ishii et al., "FedPM: Federated Learning Using Second-order Optimization with
  Preconditioned Mixing of Local Parameters", AAAI 2026, arXiv:2511.09100): the same local
  second-order steps, but the server mixes the local models through their preconditioners,
  ``x^{r+1} = (sum_i P_i)^{-1} sum_i P_i x_i^K``, i.e.
  ``x^{r+1} = x^r + (sum_i P_i)^{-1} sum_i P_i (x_i^K - x^r)`` -- the decomposition of the
  global Newton step ``(mean_i H_i)^{-1} mean_i g_i`` into client updates and server mixing.
  Clients upload ``P_i`` with their update (``ClientReport(fn, floats=1.0)``), and the server
  mixes the client-stacked updates (``update.ServerUpdate(combine=...)``).

Cheap approximation (FedPM's paper uses full/Kronecker-factored curvature on small models):
``P_i`` is Sophia's *diagonal* preconditioner ``max(h_i, eps)`` at the end of the client's
round, so the mixing is elementwise and costs one extra model-sized upload; on 10^7+-parameter
models this is the only affordable form. FedPAC (Liu et al.) Table 12 treats both as "Sophia-style"
FL
baselines, which this pairing reproduces: FedPM = Fed-Sophia + preconditioned mixing.

Choices: the Hessian diagonal is Hutchinson's estimate (``optim.estimator="hutchinson"``: the
engine passes the batch loss ``obj_fn``; Fed-Sophia's Gauss-Newton-Bartlett estimate needs the
model's logits, which the round engine does not expose); Sophia's step counter is each device's
own with persistent state (so its Hessian refresh schedule is per device); ``clip_mode="paper"``
(FedPAC (Liu et al.) Alg. 8) by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedorth.fed import local, start, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.quantities import ClientReport
from fedorth.optim.sophia import SophiaState

CLIENT_STATES = ("persistent", "reset")


def _sophia_tx(optim: Mapping[str, Any], name: str):
    opt, weight_decay, hp = local.split_optim(optim)
    if opt != "sophia":
        raise ValueError(f"{name} runs local Sophia: set optim.name='sophia', got {opt!r}.")
    return local.local_tx(local.direction(opt, **hp), weight_decay=weight_decay), hp


def _check_client_state(client_state: str, name: str) -> None:
    if client_state not in CLIENT_STATES:
        raise ValueError(
            f"{name}: fed.options.client_state={client_state!r}; valid: {CLIENT_STATES} "
            "(devices keep their Sophia state, or restart it every round)."
        )


def _start(client_state: str):
    return start.Persistent() if client_state == "persistent" else start.Reset()


def sophia_hessian_of(opt_state: Any) -> Any:
    """The Hessian EMA ``h`` (``nu``) of the :class:`SophiaState` inside a local state."""
    is_node = lambda n: isinstance(n, SophiaState)  # noqa: E731
    nodes = [n for n in jax.tree.leaves(opt_state, is_leaf=is_node) if is_node(n)]
    if len(nodes) != 1:
        raise ValueError(f"expected one Sophia state in the optimizer state, got {len(nodes)}.")
    return nodes[0].nu


def fed_sophia(
    optim: Mapping[str, Any],
    *,
    client_state: str = "persistent",
    server_lr: float = 1.0,
) -> FedAlgorithm:
    """Fed-Sophia (Elbakary et al. 2024, Alg. 1; module docstring).

    Args:
      optim: ``name="sophia"`` with Sophia's hyperparameters (``b1``, ``b2``, ``rho``, ``eps``,
        ``update_interval``, ...), ``learning_rate`` and ``weight_decay``.
      client_state: ``"persistent"`` (devices keep ``m``, ``h``) or ``"reset"``.
      server_lr: server step on the averaged update (1: model averaging).
    """
    _check_client_state(client_state, "fed_sophia")
    tx, _ = _sophia_tx(optim, "fed_sophia")
    return FedAlgorithm(
        name="fed_sophia",
        local_tx=tx,
        start=_start(client_state),
        server=update.ServerUpdate(tx=optax.sgd(server_lr)),
        paper="Elbakary et al. 2024 (Fed-Sophia), Alg. 1; FedPAC (Liu et al.) Table 12",
    )


def fedpm(
    optim: Mapping[str, Any],
    *,
    client_state: str = "persistent",
    server_lr: float = 1.0,
) -> FedAlgorithm:
    """FedPM with Sophia's diagonal preconditioner (Ishii et al. 2025; module docstring).

    Args: as :func:`fed_sophia`.
    """
    _check_client_state(client_state, "fedpm")
    tx, hp = _sophia_tx(optim, "fedpm")
    eps = float(hp.get("eps", 1e-12))

    def report_preconditioner(ctx, client):
        del ctx
        h = sophia_hessian_of(client.opt_state)
        return {"precond": jax.tree.map(lambda x: jnp.maximum(x, eps), h)}

    def mix_by_preconditioner(ctx, deltas_C, reports_C):
        del ctx
        return jax.tree.map(
            lambda d, p: (jnp.sum(p * d, axis=0) / jnp.sum(p, axis=0)).astype(d.dtype),
            deltas_C,
            reports_C["precond"],
        )

    return FedAlgorithm(
        name="fedpm",
        local_tx=tx,
        start=_start(client_state),
        report=ClientReport(report_preconditioner, floats=1.0),  # P_i, one model-sized diagonal
        server=update.ServerUpdate(tx=optax.sgd(server_lr), combine=mix_by_preconditioner),
        paper=(
            "Ishii et al. 2025 (FedPM), diagonal preconditioned mixing; "
            "FedPAC (Liu et al.) Table 12"
        ),
    )
