"""Design axis: the server's own quantities and the clients' reports.

* :class:`ServerQuantities`: quantities the server keeps in ``ServerState.extra`` (a round
  counter, the previous global model, a global momentum ...); each is passed to the local
  optimizer as an extra argument of the same name, and updated after every round from the
  averaged reports;
* :class:`ClientReport`: pytrees each client computes after its local steps and uploads; the
  server averages them for :meth:`ServerQuantities.update` and hands them, client-stacked, to a
  custom combination of the updates (``fedorth.fed.update.ServerUpdate.combine``).

The contract the round calls (``ctx``: the round's ``fedorth.fed.context.RoundContext``):
``ServerQuantities.init(params)``, ``.update(ctx, new, reports)``, ``ClientReport.fn(ctx,
client)``, and ``comm_bytes`` of each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fedorth.fed import metrics as fed_metrics
from fedorth.fed.context import ClientResult, RoundContext

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ServerQuantities:
    """Server quantities in ``ServerState.extra``, sent down each round.

    Attributes:
      init: ``init(params) -> dict`` of the quantities before round 0 (no two leaves may share a
        buffer: the round donates the server state).
      update: ``update(ctx, new, reports) -> dict``: the quantities the next round sends down,
        from the context of the round that ran (``ctx.params`` and ``ctx.server.extra``: its
        start, ``x^r`` and the quantities it sent), the server state the next round starts from
        (``new.params``: ``x^{r+1}``, after the server step) and the clients' averaged reports
        (``{}`` without a report). A quantity that follows the model the clients start from
        (FedProx's anchor) is read from ``new``; one that lags a round (FedAvg-VR's
        ``x^{r-1}``) from ``ctx``.
    """

    init: Callable[[PyTree], dict]
    update: Callable[[RoundContext, Any, dict], dict]

    def comm_bytes(self, server) -> tuple[int, int]:
        return 0, fed_metrics.tree_bytes(server.extra)


@dataclasses.dataclass(frozen=True)
class ClientReport:
    """What each client reports after its local steps.

    Attributes:
      fn: ``fn(ctx, client) -> dict`` of pytrees from the round's context (``ctx.params``: the
        point the client started from) and the client's
        :class:`~fedorth.fed.context.ClientResult` (its final ``params``, ``delta``,
        ``opt_state`` as uploaded, ``persistent``: its kept ``ClientState``).
      floats: numbers uploaded per parameter count (communication accounting: 1.0 for one
        pytree like the params; 0 when the report is something already counted).
    """

    fn: Callable[[RoundContext, ClientResult], dict]
    floats: float = 0.0

    def comm_bytes(self, server) -> tuple[int, int]:
        return int(self.floats * fed_metrics.tree_bytes(server.params)), 0
