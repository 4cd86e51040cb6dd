"""Design axis: the local corrections the server provides, and their server-side bookkeeping.

The correction itself is a transform inside the local optimizer
(:func:`fedorth.optim.federated.mix_with_global`,
:func:`~fedorth.optim.federated.add_control_variate`, ...); this axis says which server
quantities it reads, passed as keyword extra arguments:

* ``global_direction``: ``g_G = -mean_i(x_i^K - x^r) / (K eta_r)`` of the previous round
  (FedMuon (Liu et al.) Alg. 2 line 13, FedPAC (Liu et al.) Alg. 2 line 14; ``g_G^0 = 0``);
* ``control``: a :class:`ControlVariate`: the local optimizer reads
  ``control_correction = c - c_i``; client ``i``'s new ``c_i+`` is the kind's rule
  (:meth:`ControlVariate.update`), and the server sets ``c <- c + (1/N) sum_{i in S}
  (c_i+ - c_i)`` (SCAFFOLD Alg. 1 line 17; FedMuon-LMO Alg. 1 line 17); ``c``, ``c_i`` start
  at zero;
* ``prepass``: a :class:`Prepass` over the sampled clients at the server point before their
  local steps (SAGDA's ``q_i``): the local optimizer reads each entry's mean under
  ``name + "_mean"`` and, with ``per_client``, the client's own value under ``name``.

The contract the round calls (``ctx``: the round's ``fedorth.fed.context.RoundContext``):
``init_server(params)``, ``client_args(ctx, control_i, prepass_mean, prepass)``,
``client_control(ctx, control_i, delta, opt_state)``, ``server_update(ctx, new, mean,
mean_delta)``, ``comm_bytes(server)``; a control variate's ``update(ctx, control_i, delta,
opt_state)``, a pre-pass's ``fn(ctx, client)``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fedorth.fed import metrics as fed_metrics
from fedorth.fed.context import PrepassInput, RoundContext
from fedorth.fed.state import zeros_like_tree

PyTree = Any


class ControlVariate(abc.ABC):
    """A kind of control variate: how client ``i`` forms its new ``c_i+`` after its steps."""

    @abc.abstractmethod
    def update(self, ctx: RoundContext, control_i, delta, opt_state) -> PyTree:
        """``c_i+`` from the round's context (the server's ``c`` is ``ctx.server.control``;
        ``K``, ``eta_r``, ``N``, ``S``), the old ``c_i``, the client's update ``delta``
        (``x_i^K - x^r``) and its final optimizer state."""


@dataclasses.dataclass(frozen=True)
class FromState(ControlVariate):
    """``c_i+ = read(opt_state)``: a quantity of the final local state (FedMuon-LMO Alg. 1
    line 11: ``C_i <- M_i^(r,K)``; the round's mean gradient of SCAFFOLD-M)."""

    read: Callable[[PyTree], PyTree]

    def update(self, ctx, control_i, delta, opt_state):
        del ctx, control_i, delta
        return self.read(opt_state)


@dataclasses.dataclass(frozen=True)
class Prepass:
    """A pass over the round's sampled clients at the server point, before their local steps.

    Attributes:
      fn: ``fn(ctx, client) -> dict`` of pytrees from the round's context (``ctx.params``: the
        server point) and the client's :class:`~fedorth.fed.context.PrepassInput`
        (``batch``: a fresh mini-batch, drawn with local step index ``K``, the local steps
        using ``0..K-1``; ``grad_fn(params) -> grads`` of the client's loss on that batch).
        The server averages each entry over the sampled clients.
      per_client: each client also receives its own result (SAGDA's ``q_i``); False: the means
        only, and no ``[S, ...]`` stack of the results is kept (FAFED's start: ``m_0``, ``v_0``).
      floats: numbers per client uploaded per parameter count; the mean is downloaded
        (communication accounting: 1.0 for one pytree like the params).
    """

    fn: Callable[[RoundContext, PrepassInput], dict]
    per_client: bool = True
    floats: float = 0.0


@dataclasses.dataclass(frozen=True)
class Corrections:
    """The server quantities the local corrections read (module docstring).

    Attributes:
      global_direction: the server keeps ``g_G`` and passes it as ``global_direction``.
      control: the control variates' kind, or None.
      prepass: the pre-pass, or None.
    """

    global_direction: bool = False
    control: ControlVariate | None = None
    prepass: Prepass | None = None

    def init_server(self, params) -> dict[str, Any]:
        """``ServerState`` fields: ``global_direction`` and ``control`` (zeros, or None)."""
        return {
            "global_direction": zeros_like_tree(params) if self.global_direction else None,
            "control": zeros_like_tree(params) if self.control else None,
        }

    def client_args(self, ctx, control_i, prepass_mean, prepass) -> dict[str, Any]:
        """The local optimizer's extra arguments of this axis: ``global_direction``,
        ``control_correction = c - c_i`` and the client's own ``client_control = c_i``, the
        pre-pass entries."""
        server = ctx.server
        args: dict[str, Any] = {}
        if self.global_direction:
            args["global_direction"] = server.global_direction
        if self.control:
            args["control_correction"] = jax.tree.map(
                lambda c, ci: c - ci, server.control, control_i
            )
            args["client_control"] = control_i
        for name, mean in prepass_mean.items():
            args[f"{name}_mean"] = mean
            if name in prepass:
                args[name] = prepass[name]
        return args

    def client_control(self, ctx, control_i, delta, opt_state) -> PyTree:
        """The client's new control variate ``c_i+`` (None without control variates)."""
        if not self.control:
            return None
        return self.control.update(ctx, control_i, delta, opt_state)

    def server_update(self, ctx, new, mean, mean_delta):
        """``g_G`` and ``c`` of the next round in ``new``."""
        k, lr = ctx.local_steps, ctx.learning_rate
        n, s = ctx.num_clients, ctx.clients_per_round
        if self.global_direction:
            new = new.replace(global_direction=jax.tree.map(lambda d: -d / (k * lr), mean_delta))
        if self.control:
            control = jax.tree.map(
                lambda c, diff: c + (s / n) * diff, ctx.server.control, mean["control_diff"]
            )
            new = new.replace(control=control)
        return new

    def comm_bytes(self, server) -> tuple[int, int]:
        """Up and down bytes per client: ``c_i+`` up and ``c`` down, ``g_G`` down, the pre-pass."""
        params = fed_metrics.tree_bytes(server.params)
        up = down = 0
        if self.global_direction:
            down += fed_metrics.tree_bytes(server.global_direction)
        if self.control:
            up += params
            down += params
        if self.prepass and self.prepass.floats:
            up += int(self.prepass.floats * params)
            down += int(self.prepass.floats * params)
        return up, down


def control_diff(new_control, control_i) -> PyTree:
    """``c_i+ - c_i``, averaged over the clients for the server's ``c``."""
    return jax.tree.map(jnp.subtract, new_control, control_i)
