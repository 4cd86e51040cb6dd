"""How the server weighs its sampled clients: uniformly, or by their example counts.

``RoundConfig.aggregation`` is one of :data:`AGGREGATIONS`:

* ``"uniform"`` (the default; the rule of the algorithms this package reproduces): every
  sampled client counts ``1/S``, ``Delta = (1/S) sum_i Delta_i``.
* ``"examples"``: FedAvg's original rule (McMahan et al. 2017, "Communication-Efficient
  Learning of Deep Networks from Decentralized Data", Alg. 1), ``Delta = sum_i n_i Delta_i /
  sum_i n_i`` over the sampled clients, ``n_i`` client ``i``'s number of training examples.

Client ``i`` then uploads ``w_i u_i`` with ``w_i = S n_i / sum_{j in S} n_j`` in place of its
upload ``u_i``, and the engine's uniform mean of the uploads (``fedorth.fed.reduce``, the same on
every execution strategy) is the example-weighted mean ``sum_i n_i u_i / sum_j n_j``. Weighted:
what the server averages into its model, its state and its server quantities, namely the update
``Delta_i`` (which every server rule, FedAvgM's or FedAdam's, then steps with: Reddi et al.
2021, "Adaptive Federated Optimization", Alg. 2 takes ``Delta_t`` as that average), the model
state, the uploaded optimizer state (FedMuon's momentum, FedPAC's ``Theta``), the reports and the
round's ``train_loss`` (then a mean over examples). Not weighted: control-variate changes, whose
server variable is an average over all ``N`` clients, sampled or not (SCAFFOLD, Karimireddy et
al. 2020, Alg. 1 line 17: ``c <- c + (1/N) sum_{i in S} (c_i^+ - c_i)``; FedMuon-LMO's
partial-participation rule likewise), and the pre-pass at the server point. The spreads
``client_drift`` and ``precond_drift`` are then those of the weighted uploads ``w_i u_i``.

Refused (:func:`check`): client-level differential privacy (DP-FedAvg's fixed denominator
bounds each client's share by the clip norm over ``D``, which weights ``w_i > 1`` exceed), an
algorithm that combines the stacked updates by its own rule, and an optimizer state averaged by
its own rule (SOAP's eigenbases), which a scaled state does not enter linearly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedorth.data.federated import FederatedData, client_num_examples
from fedorth.fed import privacy as privacy_lib
from fedorth.optim import federated as fed_optim

PyTree = Any

AGGREGATIONS = ("uniform", "examples")
# Uploads averaged over all N clients (or only diagnostic): never weighted by examples.
UNWEIGHTED = ("control_diff", "theta")


def check(aggregation: str, algorithm, *, privacy, spectral_drift: bool) -> None:
    """Raises a one-line ``ValueError`` when ``aggregation`` is unknown or cannot be applied."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"fed.aggregation={aggregation!r}; valid: {AGGREGATIONS}.")
    if aggregation == "uniform":
        return
    if privacy is not None:
        raise ValueError(
            "fed.aggregation='examples' with dp: DP-FedAvg's fixed denominator needs every "
            "client to count alike; set fed.aggregation='uniform' or leave config.dp off."
        )
    if algorithm.server.combine is not None:
        raise ValueError(
            f"fed.aggregation='examples': {algorithm.name} combines the clients' updates with "
            "its own rule (ServerUpdate.combine); set fed.aggregation='uniform'."
        )
    if algorithm.start.averaged and privacy_lib.averages_by_own_rule(algorithm, spectral_drift):
        raise ValueError(
            f"fed.aggregation='examples': {algorithm.name} averages its optimizer state with its "
            "own rule (SOAP's bases) or spectral_drift is on; set fed.aggregation='uniform' "
            "(or spectral_drift=False)."
        )


def example_counts(data: PyTree) -> jax.Array:
    """The clients' training example counts ``[N]``: ``data.client_size``
    (``fedorth.data.FederatedData``) or ``data["client_size"]``."""
    counts = getattr(data, "client_size", None)
    if counts is None and isinstance(data, dict):
        counts = data.get("client_size")
    if counts is None:
        raise ValueError(
            "fed.aggregation='examples' weighs clients by their example counts, but the round's "
            "data has no client_size; pass fedorth.data.FederatedData (or a dict with a "
            "'client_size' [N] array), or set fed.aggregation='uniform'."
        )
    return counts


def _count(data: PyTree, client: jax.Array) -> jax.Array:
    """Client ``client``'s example count (a global id): through
    :func:`fedorth.data.client_num_examples` for a dataset, whose streamed rounds hold the
    sampled clients' rows only."""
    if isinstance(data, FederatedData):
        return client_num_examples(data, client)
    return example_counts(data)[client]


def client_weight(ctx, data: PyTree, client_id: jax.Array) -> jax.Array:
    """``w_i = S n_i / sum_{j in S} n_j`` of sampled client ``client_id`` (a float scalar of the
    default float dtype)."""
    dtype = jnp.result_type(float)
    example_counts(data)  # one line when the data has no counts
    sampled = jax.vmap(lambda client: _count(data, client))(ctx.client_ids)
    total = jnp.sum(sampled.astype(dtype))
    return ctx.clients_per_round * _count(data, client_id).astype(dtype) / total


def weigh(averaged: dict, weight: jax.Array) -> dict:
    """``averaged`` (one client's uploads) with every float leaf, except :data:`UNWEIGHTED`'s,
    multiplied by ``weight`` (integer leaves are shared schedule counters, kept)."""

    def scale(x):
        return x * weight.astype(x.dtype) if fed_optim.is_float(x) else x

    return {
        name: tree if name in UNWEIGHTED else jax.tree.map(scale, tree)
        for name, tree in averaged.items()
    }
