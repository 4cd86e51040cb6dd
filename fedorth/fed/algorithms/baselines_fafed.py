"""FAFED: faster adaptive federated learning (Wu et al. 2023; baseline of FedMuon (Zhang & Gao)).

Wu, Huang, Hu, Huang, "Faster Adaptive Federated Learning", AAAI 2023, Alg. 1; FedMuon (Zhang & Gao)
(docs/PAPERS.md) Sec. 7 lists it among the adaptive baselines. Every
``q`` local steps (a round, ``q = fed.local_steps``) the server averages the clients' models,
STORM momenta ``u`` and second moments ``v``; clients warm-start from these averages and step
with ``x <- x - eta u / (sqrt(v-bar) + rho)``, the adaptive matrix being fixed during the round.
The local transform and the choices where the engine's round structure differs from the paper's
loop are in :mod:`fedorth.optim.fafed`.

Engine mapping: ``start.Global(mask=fafed_aggregate_mask, keep=fafed_persistent_mask)``: the
mask selects ``u``, ``v`` and the step count for averaging and the warm start; ``keep`` keeps each
client's previous STORM iterate across rounds (stacked over the clients in
``ServerState.clients``, as the reference code never resets ``model_``); the per-round quantities
(frozen preconditioner, the round's step counter) start each round from ``init``. The paper is
cross-silo with all clients communicating; partial participation averages the sampled clients,
and a client not sampled keeps its previous iterate until it joins again. The run's start, one
averaging of the clients' first gradients and their squares (``m_0``, ``v_0``) and the step
``x_1 = x_0 - eta m_0``, is a pre-pass,
``Corrections(prepass=Prepass(fafed_start_prepass, per_client=False))``, that computes on round 0
only and is left out of the per-round communication count (``floats=0``). The server averages
the models (``update.ServerUpdate(tx=optax.sgd(server_lr))``).

Sources: the paper's box could not be read; two implementations were compared line by
line (naya0000/FaFed ``code/Image/FAFED.py`` at fd3e4c1, probably the authors' code, and the
third-party port DadrasAli/fedbrew at 06e91b6). Both agree with the local recursion, keep a
per-client previous iterate across rounds and start with one averaging of the clients' first
gradients, as fedorth does (tests/test_baselines.py::test_fafed_matches_the_reference_loop
transcribes the first one's loop); they disagree with each other at communication, where
fedorth follows the first (:mod:`fedorth.optim.fafed`, docs/FIDELITY.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from fedorth.fed import local, start, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import Corrections, Prepass
from fedorth.optim.fafed import (
    fafed_aggregate_mask,
    fafed_persistent_mask,
    fafed_start_prepass,
    scale_by_fafed,
)


def fafed(
    optim: Mapping[str, Any],
    *,
    a: float = 0.1,
    b2: float = 0.99,
    rho: float = 1e-3,
    server_lr: float = 1.0,
) -> FedAlgorithm:
    """FAFED (Wu et al. 2023, Alg. 1).

    FAFED's local step is part of the algorithm, so its hyperparameters are algorithm options
    and ``optim`` only gives the learning rate and weight decay of a plain-gradient client.

    Args:
      optim: ``name="sgd"`` (no momentum), ``learning_rate`` (eta), ``weight_decay``.
      a: STORM weight of the fresh gradient, in (0, 1].
      b2: decay of the second moment ``v``, in [0, 1).
      rho: the constant of the adaptive matrix ``sqrt(v) + rho``, > 0.
      server_lr: the server step on the averaged update (1: the paper's model averaging).
    """
    opt, weight_decay, hp = local.split_optim(optim)
    if opt != "sgd" or hp.get("momentum", 0.0):
        raise ValueError(
            "fafed has its own local step (options a, b2, rho): set optim.name='sgd' without "
            f"optim.momentum, got optim.name={opt!r} with {sorted(hp)}."
        )
    return FedAlgorithm(
        name="fafed",
        local_tx=local.local_tx(scale_by_fafed(a, b2, rho=rho), weight_decay=weight_decay),
        start=start.Global(mask=fafed_aggregate_mask, keep=fafed_persistent_mask),
        # The start's one averaging of the clients' first gradients (round 0 only; the per-round
        # communication count leaves this one-time exchange of m_0, v_0 out). The means m_0,
        # v_0 only: no [S, ...] stack of zeros in later rounds.
        corrections=Corrections(prepass=Prepass(fafed_start_prepass, per_client=False)),
        server=update.ServerUpdate(tx=optax.sgd(server_lr)),
        paper="Wu et al. 2023 (AAAI), FAFED Alg. 1; FedMuon (Zhang & Gao) Sec. 7 baselines",
    )
