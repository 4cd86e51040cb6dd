"""The federated engine: algorithms as compositions, one compiled round, metrics.

An algorithm (:class:`FedAlgorithm`) holds one spec per design axis: ``start`` (how a client's
optimizer state starts a round), ``corrections`` (the server quantities its local corrections
read), ``quantities`` and ``report`` (server quantities, client reports) and ``server`` (the
server update). :func:`make_round_fn` compiles any of them into one round; :func:`round_body`
is that round as a plain function of ``(server, data)``. docs/ARCHITECTURE.md describes the
modules, the axes' contract and where to add what.
"""

from fedorth.fed import corrections, quantities, start, update  # noqa: F401  (the axes' specs)
from fedorth.fed.accounting import communication_bytes  # noqa: F401
from fedorth.fed.aggregation import AGGREGATIONS  # noqa: F401
from fedorth.fed.algorithm import FedAlgorithm  # noqa: F401
from fedorth.fed.algorithms import ALGORITHMS, get_algorithm  # noqa: F401
from fedorth.fed.autotune import MeasuredRoundFn, describe_selection, measure_strategies  # noqa: F401
from fedorth.fed.compiled import RoundFn  # noqa: F401
from fedorth.fed.config import STRATEGIES, RoundConfig  # noqa: F401
from fedorth.fed.context import ClientResult, PrepassInput, RoundContext  # noqa: F401
from fedorth.fed.execution import client_mesh, resolve_strategy  # noqa: F401
from fedorth.fed.memory import RoundOutOfMemoryError  # noqa: F401
from fedorth.fed.round import make_round_fn, round_body  # noqa: F401
from fedorth.fed.server import init_server  # noqa: F401
from fedorth.fed.state import ClientState, ServerState  # noqa: F401

# The public API at ``fedorth.fed`` (also what the API reference documents on this page).
__all__ = [
    "ALGORITHMS",
    "STRATEGIES",
    "AGGREGATIONS",
    "ClientResult",
    "ClientState",
    "FedAlgorithm",
    "MeasuredRoundFn",
    "PrepassInput",
    "RoundConfig",
    "RoundContext",
    "RoundFn",
    "RoundOutOfMemoryError",
    "ServerState",
    "client_mesh",
    "communication_bytes",
    "describe_selection",
    "get_algorithm",
    "init_server",
    "make_round_fn",
    "measure_strategies",
    "resolve_strategy",
    "round_body",
]
