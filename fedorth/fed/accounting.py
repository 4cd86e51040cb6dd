"""Communication accounting: the bytes a participating client sends and receives per round."""

from __future__ import annotations

import jax

from fedorth.fed import metrics as fed_metrics
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.state import ServerState
from fedorth.optim import federated as fed_optim


def communication_bytes(algorithm: FedAlgorithm, server: ServerState) -> dict[str, int]:
    """Bytes one participating client sends up and receives down per round.

    Up: the update ``dx`` (|x|), the model state, the optimizer state when aggregated (its
    uploaded leaves, low-rank when compressed), and ``c_i+`` with control variates. Down: ``x``,
    the model state, the averaged optimizer state, ``g_G`` and ``c`` when used.
    """
    params = fed_metrics.tree_bytes(server.params)
    model_state = fed_metrics.tree_bytes(server.model_state)
    up = down = params + model_state
    if algorithm.aggregate_opt_state:
        mask = fed_optim.upload_mask(server.opt_state)
        if algorithm.aggregate_mask is not None:
            mask = jax.tree.map(
                lambda a, b: bool(a and b), mask, algorithm.aggregate_mask(server.opt_state)
            )
        down += fed_metrics.tree_bytes(server.opt_state, mask)
        if algorithm.state_compression is not None:
            up += fed_metrics.low_rank_bytes(server.opt_state, mask, algorithm.state_compression)
        else:
            up += fed_metrics.tree_bytes(server.opt_state, mask)
    if algorithm.uses_global_direction:
        down += fed_metrics.tree_bytes(server.global_direction)
    if algorithm.control_variates:
        up += params
        down += params
    if algorithm.report_floats:
        up += int(algorithm.report_floats * params)
    if algorithm.prepass_floats:
        # The pre-pass: each sampled client's result up, their mean down.
        up += int(algorithm.prepass_floats * params)
        down += int(algorithm.prepass_floats * params)
    down += fed_metrics.tree_bytes(server.extra)
    return {"bytes_up": up, "bytes_down": down}
