"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging", Alg. 1).

Local step ``y_i <- y_i - eta_l (g_i(y_i) - c_i + c)``; option II control variates
``c_i+ = c_i - c + (x - y_i) / (K eta_l)``; server ``x <- x + eta_g mean_i(y_i - x)`` and
``c <- c + (1/N) sum_{i in S} (c_i+ - c_i)``. Both ``c`` and ``c_i`` start at zero.

The released PyTorch code of FedMuon (Liu et al.) and FedPAC adds a detached scalar for the
correction, so it does nothing; here the correction is the full pytree ``c - c_i``.

**With a stateful local optimizer** (momentum SGD or Adam: the "SCAFFOLD" and "SCAFFOLD (Adam)"
baselines of FedMuon-LMO (bias-corrected LMO) §7.1), Alg. 1 does not say where the correction
goes. SCAFFOLD's derivation makes ``c_i`` an estimate of client ``i``'s gradient and
``g - c_i + c`` an estimate of the *global* gradient; so here the correction is applied to the
stochastic gradient *before* the optimizer (momentum or Adam then acts on the corrected
gradient), and the new control variate is what option II computes under plain SGD, the mean of
the round's raw gradients: with ``y_i^K = x - eta sum_k (g_k - c_i + c)``,
``c_i - c + (x - y_i^K)/(K eta) = (1/K) sum_k g_k``. Option II's formula itself would, under
momentum 0.9, return the mean momentum buffer, 4-8x the gradient (measured), and the next
round's correction ``c - c_i`` would then overshoot. ``control="option_ii"`` keeps the literal
formula (``Corrections(control=OptionII())``); ``"gradient_mean"`` reads the mean of the round's
raw gradients from the final state (``Corrections(control=FromState(running_mean_of))``, with a
round counter in ``ServerState.extra``); ``"auto"`` (default) uses option II with plain SGD
only (``optim.name="sgd"``, no momentum), where the two agree up to rounding when there is no
weight decay (option II's mean then includes the decoupled ``lambda y``, the gradient of the
regularized objective).

FedMuon-LMO's presets also take its Alg. 3/4 server step ``X <- (n-S)/n X + 1/n sum_i X_i``
(``fed.options.server_rule="partial"``: ``update.Partial()``) and keep each client's optimizer
state between the rounds it joins (``fed.options.client_state="persistent"``:
``start.Persistent()``, its Alg. 4 line 5), like the other methods of its table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedorth.fed import local, start, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.algorithms.baselines_momentum_vr import running_mean_of
from fedorth.fed.corrections import ControlVariate, Corrections, FromState
from fedorth.fed.quantities import ServerQuantities
from fedorth.optim import federated as fed_optim
from fedorth.optim import momentum_vr

ROUND_KEY = "scaffold_round"
CONTROLS = ("auto", "option_ii", "gradient_mean")


@dataclasses.dataclass(frozen=True)
class OptionII(ControlVariate):
    """``c_i+ = c_i - c + (x - y_i) / (K eta)``: option II of Karimireddy et al. (2020),
    Eq. (4), with ``x - y_i = -delta``."""

    def update(self, ctx, control_i, delta, opt_state):
        del opt_state
        k, lr = ctx.local_steps, ctx.learning_rate
        return jax.tree.map(
            lambda ci, c, d: ci - c - d / (k * lr), control_i, ctx.server.control, delta
        )


def _round_counter() -> ServerQuantities:
    """A round counter in ``ServerState.extra`` (sent to clients)."""
    return ServerQuantities(
        init=lambda params: {ROUND_KEY: jnp.zeros([], jnp.int32)},
        update=lambda ctx, new, reports: {
            **ctx.server.extra,
            ROUND_KEY: ctx.server.extra[ROUND_KEY] + 1,
        },
    )


def scaffold(
    optim: Mapping[str, Any],
    *,
    server_lr: float = 1.0,
    control: str = "auto",
    client_state: str = "reset",
    server_rule: str = "mean",
) -> FedAlgorithm:
    """SCAFFOLD (module docstring).

    Args:
      optim: the local optimizer (SGD, momentum SGD, AdamW, ...).
      server_lr: ``eta_g``.
      control: ``"option_ii"`` (``c_i+ = c_i - c + (x - y_i)/(K eta)``), ``"gradient_mean"``
        (``c_i+ = (1/K) sum_k g_k``, the raw gradients) or ``"auto"``: option II for plain
        SGD, the gradient mean for a stateful optimizer.
      client_state: ``"reset"`` (fresh optimizer state each round) or ``"persistent"``.
      server_rule: ``"mean"`` or ``"partial"`` (``x <- x + eta_g (S/N) mean_i(y_i - x)``).
    """
    if control not in CONTROLS:
        raise ValueError(f"fed.options.control={control!r}; valid: {CONTROLS}.")
    if client_state not in ("reset", "persistent"):
        raise ValueError(
            f"fed.options.client_state={client_state!r}; valid: ('reset', 'persistent')."
        )
    opt, weight_decay, hp = local.split_optim(optim)
    if control == "auto":
        stateless = opt == "sgd" and not hp.get("momentum", 0.0)
        control = "option_ii" if stateless else "gradient_mean"
    if control == "option_ii":
        pre = (fed_optim.add_control_variate(),)
        control, quantities = OptionII(), None
    else:
        pre = (momentum_vr.round_mean(ROUND_KEY), fed_optim.add_control_variate())
        control, quantities = FromState(running_mean_of), _round_counter()
    tx = local.local_tx(
        local.direction(opt, **hp), weight_decay=local.decay_rates(opt, weight_decay, hp), pre=pre
    )
    return FedAlgorithm(
        name="scaffold",
        local_tx=tx,
        start=start.Persistent() if client_state == "persistent" else start.Reset(),
        corrections=Corrections(control=control),
        quantities=quantities,
        server=update.ServerUpdate(tx=optax.sgd(server_lr), rule=update.rule_named(server_rule)),
        paper="Karimireddy et al. 2020, Alg. 1 (option II)",
    )
