"""The federated engine: algorithms as compositions, one compiled round, metrics."""

from fedorth.fed.accounting import communication_bytes  # noqa: F401
from fedorth.fed.algorithm import FedAlgorithm  # noqa: F401
from fedorth.fed.algorithms import ALGORITHMS, get_algorithm  # noqa: F401
from fedorth.fed.autotune import MeasuredRoundFn, describe_selection, measure_strategies  # noqa: F401
from fedorth.fed.compiled import RoundFn  # noqa: F401
from fedorth.fed.config import STRATEGIES, RoundConfig  # noqa: F401
from fedorth.fed.execution import client_mesh, resolve_strategy  # noqa: F401
from fedorth.fed.memory import RoundOutOfMemoryError  # noqa: F401
from fedorth.fed.round import make_round_fn, round_body  # noqa: F401
from fedorth.fed.server import init_server  # noqa: F401
from fedorth.fed.state import ClientState, ServerState  # noqa: F401

# The public API at ``fedorth.fed`` (also what the API reference documents on this page).
__all__ = [
    "ALGORITHMS",
    "STRATEGIES",
    "ClientState",
    "FedAlgorithm",
    "MeasuredRoundFn",
    "RoundConfig",
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
