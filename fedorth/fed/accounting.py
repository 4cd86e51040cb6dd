"""Communication accounting: the bytes a participating client sends and receives per round."""

from __future__ import annotations

from fedorth.fed import metrics as fed_metrics
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.state import ServerState


def communication_bytes(algorithm: FedAlgorithm, server: ServerState) -> dict[str, int]:
    """Bytes one participating client sends up and receives down per round.

    Both ways: ``x`` (down) or the update ``dx`` (up), and the model state; then what each design
    axis sends (its spec's ``comm_bytes``): the averaged optimizer state's uploaded leaves
    (low-rank when compressed), ``g_G`` and the control variates, the pre-pass, the reports and
    the server quantities.
    """
    up = down = fed_metrics.tree_bytes(server.params) + fed_metrics.tree_bytes(server.model_state)
    specs = (algorithm.start, algorithm.corrections, algorithm.report, algorithm.quantities)
    for spec in specs:
        if spec is not None:
            spec_up, spec_down = spec.comm_bytes(server)
            up, down = up + spec_up, down + spec_down
    return {"bytes_up": up, "bytes_down": down}
