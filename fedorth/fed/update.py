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

:func:`server_optimizer` builds the server optimizers an algorithm's ``fed.options.server_opt``
names (``fedorth.fed.algorithms.get_algorithm`` puts it in place of the algorithm's own ``tx``):
SGD with heavy-ball momentum (FedAvgM), Nesterov momentum (the outer optimizer of DiLoCo,
Douillard et al. 2023, Alg. 1, and of MuLoCo), and Alg. 2's Adam, Yogi and Adagrad of Reddi et
al. 2021 (FedAdam, FedYogi, FedAdagrad), each on the rule's pseudo-gradient ``-scale * Delta``
(DiLoCo's outer gradient ``x - mean_i x_i``, Reddi et al.'s ``-Delta_t``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from fedorth.fed.context import RoundContext
from fedorth.optim import federated as fed_optim
from fedorth.optim.momentum_vr import scale_by_adam_uncorrected, scale_by_reddi_adaptive

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


# Each server optimizer's keys and defaults: SGD's are FedAvg's (plain averaging); Nesterov's
# DiLoCo's outer optimizer (Douillard et al. 2023, Sec. 3: lr 0.7, momentum 0.9); the adaptive
# ones fedorth's FedAdam's (Reddi et al. 2021, Sec. 5: betas (0.9, 0.99), tau 1e-3, and the
# server lr 0.01 of Flower's strategies; the papers tune it per task).
_ADAPTIVE = {"server_lr": 0.01, "server_b1": 0.9, "server_b2": 0.99, "server_tau": 1e-3}
SERVER_OPTIMIZERS: dict[str, dict[str, float]] = {
    "sgd": {"server_lr": 1.0, "server_momentum": 0.0},
    "nesterov": {"server_lr": 0.7, "server_momentum": 0.9},
    "adam": _ADAPTIVE,
    "yogi": _ADAPTIVE,
    "adagrad": {k: v for k, v in _ADAPTIVE.items() if k != "server_b2"},
}
SERVER_OPTIMIZER_KEYS = (
    "server_opt",
    *dict.fromkeys(k for d in SERVER_OPTIMIZERS.values() for k in d),
)
"""The ``fed.options`` keys of :func:`server_optimizer`, which every algorithm takes."""


# The paper of each server optimizer, added to the algorithm's ``paper`` by ``get_algorithm``.
SERVER_OPTIMIZER_PAPERS = {
    "sgd": "Hsu et al. 2019 (server momentum)",
    "nesterov": "Douillard et al. 2023 (DiLoCo), Alg. 1 (outer Nesterov)",
    "adam": "Reddi et al. 2021, Alg. 2 (FedAdam)",
    "yogi": "Reddi et al. 2021, Alg. 2 (FedYogi)",
    "adagrad": "Reddi et al. 2021, Alg. 2 (FedAdagrad)",
}


def server_optimizer(server_opt: str, **options) -> optax.GradientTransformation:
    """The server optimizer ``fed.options.server_opt`` names, on the pseudo-gradient.

    Args:
      server_opt: ``"sgd"`` (``v <- mu v + g``, ``x <- x - lr v``: FedAvgM), ``"nesterov"``
        (``v <- mu v + g``, ``x <- x - lr (g + mu v)``, PyTorch's and ``optax.sgd``'s Nesterov:
        DiLoCo Alg. 1's ``OuterOpt``), ``"adam"``, ``"yogi"`` or ``"adagrad"`` (Reddi et al.
        2021, Alg. 2, no bias correction: ``x <- x - lr m / (sqrt(v) + tau)``).
      **options: that optimizer's keys of :data:`SERVER_OPTIMIZERS` (the rest default there):
        ``server_lr``, ``server_momentum``; ``server_b1``, ``server_b2`` (not Adagrad's),
        ``server_tau``.
    """
    if server_opt not in SERVER_OPTIMIZERS:
        raise ValueError(
            f"fed.options.server_opt={server_opt!r}; valid: {tuple(SERVER_OPTIMIZERS)}."
        )
    defaults = SERVER_OPTIMIZERS[server_opt]
    foreign = sorted(set(options) - set(defaults))
    if foreign:
        raise ValueError(
            f"fed.options.{foreign[0]} does not apply to fed.options.server_opt={server_opt!r}; "
            f"its keys: {', '.join(defaults)}."
        )
    hp = {**defaults, **options}
    lr = hp["server_lr"]
    if server_opt in ("sgd", "nesterov"):
        momentum = hp["server_momentum"]
        # A traced momentum (a sweep's value) always keeps the server's trace.
        if fed_optim.is_concrete(momentum) and not momentum:
            return optax.sgd(lr)
        return optax.sgd(lr, momentum=momentum, nesterov=server_opt == "nesterov")
    b1, tau = hp["server_b1"], hp["server_tau"]
    if server_opt == "adam":
        direction = scale_by_adam_uncorrected(b1, hp["server_b2"], tau)
    else:
        direction = scale_by_reddi_adaptive(server_opt, b1, hp.get("server_b2", 0.0), tau)
    return optax.chain(direction, optax.scale(-lr))
