"""Design axis: the server's own quantities and the clients' reports.

* :class:`ServerQuantities`: quantities the server keeps in ``ServerState.extra`` (a round
  counter, the previous global model, a global momentum ...); each is passed to the local
  optimizer as an extra argument of the same name, and updated after every round from the
  averaged reports;
* :class:`ClientReport`: pytrees each client computes after its local steps and uploads; the
  server averages them for :meth:`ServerQuantities.update` and hands them, client-stacked, to a
  custom combination of the updates (``fedorth.fed.update.ServerUpdate.combine``).

The contract the round calls: ``ServerQuantities.init(params)``, ``.update(server, reports,
learning_rate)``, ``ClientReport.fn(ctx)``, and ``comm_bytes`` of each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fedorth.fed import metrics as fed_metrics

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ServerQuantities:
    """Server quantities in ``ServerState.extra``, sent down each round.

    Attributes:
      init: ``init(params) -> dict`` of the quantities before round 0 (no two leaves may share a
        buffer: the round donates the server state).
      update: ``update(server, reports, learning_rate) -> dict``: the new quantities from the
        pre-round ``server`` and the clients' averaged reports (``{}`` without a report).
    """

    init: Callable[[PyTree], dict]
    update: Callable[[Any, dict, Any], dict]

    def comm_bytes(self, server) -> tuple[int, int]:
        return 0, fed_metrics.tree_bytes(server.extra)


@dataclasses.dataclass(frozen=True)
class ClientReport:
    """What each client reports after its local steps.

    Attributes:
      fn: ``fn(ctx) -> dict`` of pytrees; ``ctx`` has ``params0``, ``params``, ``opt_state``
        (the uploaded final state), ``persistent`` (the client's kept ``ClientState``),
        ``server``, ``learning_rate``.
      floats: numbers uploaded per parameter count (communication accounting: 1.0 for one
        pytree like the params; 0 when the report is something already counted).
    """

    fn: Callable[[dict], dict]
    floats: float = 0.0

    def comm_bytes(self, server) -> tuple[int, int]:
        return int(self.floats * fed_metrics.tree_bytes(server.params)), 0
