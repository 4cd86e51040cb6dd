"""Design axis: the server update: how the clients' updates combine, and the step it takes.

The aggregated update ``Delta`` is ``mean_i(x_i^K - x^r)`` over the sampled clients, or a
custom ``combine`` of the client-stacked updates and reports (FedPM's preconditioned mixing).
The pseudo-gradient ``-scale * Delta`` then goes through the server optimizer ``tx``
(``optax.sgd(1.0)``: plain averaging), where the rule gives ``scale``:

* :class:`Mean`: 1;
* :class:`Partial`: ``S/N`` (FedMuon-LMO Alg. 1 line 18, ``X <- (n-S)/n X + 1/n sum_i X_i``);
* :class:`GlobalStep`: ``gamma / (K eta_r)`` (FedPAC (Liu et al.) Alg. 3 line 15,
  ``x <- x - gamma g_G``).

The contract the round calls (``ctx``: the round's ``fedorth.fed.context.RoundContext``):
``init_server(params)``, ``combine_updates(ctx, mean_delta, stacked)``, ``step(ctx, delta) ->
(params, server_opt_state)``, and each rule's ``scale(ctx)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from fedorth.fed.context import RoundContext

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Mean:
    """``x <- x + mean_i(dx_i)`` through the server optimizer."""

    name = "mean"

    def scale(self, ctx) -> float:
        del ctx
        return 1.0


@dataclasses.dataclass(frozen=True)
class Partial:
    """``S/N`` of the way to the mean: ``X <- (n-S)/n X + 1/n sum_{i in S} X_i`` (FedMuon-LMO
    Alg. 1 line 18; Alg. 3 line 10, Alg. 4 line 15)."""

    name = "partial"

    def scale(self, ctx) -> float:
        return ctx.clients_per_round / ctx.num_clients


@dataclasses.dataclass(frozen=True)
class GlobalStep:
    """``x <- x - gamma g_G`` with ``g_G = -Delta / (K eta_r)`` (FedPAC (Liu et al.) Alg. 3
    line 15; Cheng et al. 2024's ``x^{r+1} = x^r - gamma g^{r+1}``)."""

    gamma: float
    name = "global_step"

    def __post_init__(self):
        if not self.gamma > 0:
            raise ValueError(f"server_lr={self.gamma} must be > 0.")

    def scale(self, ctx):
        return self.gamma / (ctx.local_steps * ctx.learning_rate)


Rule = Mean | Partial | GlobalStep


@dataclasses.dataclass(frozen=True)
class ServerUpdate:
    """The server update (module docstring).

    Attributes:
      tx: the server optimizer applied to the pseudo-gradient.
      rule: :class:`Mean`, :class:`Partial` or :class:`GlobalStep`.
      combine: ``combine(ctx, deltas_C, reports_C) -> Delta`` from the round's context
        (``fedorth.fed.context.RoundContext``: ``N``, ``S``, ``K``, the learning rate, the
        server state), the client-stacked updates and client-stacked (not averaged) reports,
        replacing the mean in the server step and in ``g_G`` (FedPM's ``sum_i P_i dx_i /
        sum_i P_i``). None: the mean, streamed as clients finish (no ``[S, ...]`` stack of
        updates).
    """

    tx: optax.GradientTransformation = dataclasses.field(default_factory=lambda: optax.sgd(1.0))
    rule: Rule = Mean()
    combine: Callable[[RoundContext, PyTree, dict], PyTree] | None = None

    def init_server(self, params) -> PyTree:
        return self.tx.init(params)

    def combine_updates(self, ctx, mean_delta, stacked) -> PyTree:
        if self.combine is None:
            return mean_delta
        return self.combine(ctx, stacked["delta"], stacked["report"])

    def step(self, ctx, delta):
        """The new parameters and server optimizer state from the aggregated update."""
        scale = self.rule.scale(ctx)
        pseudo_grad = jax.tree.map(lambda d: -scale * d, delta)
        server = ctx.server
        updates, server_opt_state = self.tx.update(
            pseudo_grad, server.server_opt_state, server.params
        )
        return optax.apply_updates(server.params, updates), server_opt_state


def rule_named(name: str) -> Rule:
    """The rule an algorithm's ``fed.options.server_rule`` names: ``"mean"`` or ``"partial"``."""
    rules = {"mean": Mean(), "partial": Partial()}
    if name not in rules:
        raise ValueError(f"fed.options.server_rule={name!r}; valid: {tuple(rules)}.")
    return rules[name]


def global_step_or_mean(server_lr: float | None) -> Rule:
    """``GlobalStep(server_lr)``, or ``Mean()`` (plain averaging) when ``server_lr`` is None."""
    return Mean() if server_lr is None else GlobalStep(server_lr)
