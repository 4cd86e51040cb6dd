"""A federated algorithm as a point in the design space: one spec per design axis.

Every algorithm of fedorth (FedAvg and Local-X, FedMuon, FedPAC, SCAFFOLD, the baselines, the
minimax methods) is a choice of

1. the **local optimizer** ``local_tx``: an Optax chain ending in
   :func:`fedorth.optim.federated.scale_by_round_learning_rate`, which holds the corrections
   (:func:`~fedorth.optim.federated.mix_with_global`,
   :func:`~fedorth.optim.federated.add_control_variate`, ...);
2. the **client start** ``start`` (``fedorth.fed.start``): ``Reset()``, ``Global(mask, keep,
   compression)`` or ``Persistent()``;
3. the **corrections** ``corrections`` (``fedorth.fed.corrections``): which server quantities
   the local corrections read: the global direction ``g_G``, a kind of control variate, a
   pre-pass over the sampled clients;
4. the **server quantities and reports** ``quantities`` and ``report``
   (``fedorth.fed.quantities``);
5. the **server update** ``server`` (``fedorth.fed.update``): the server optimizer, its rule
   (``Mean()``, ``Partial()``, ``GlobalStep(gamma)``) and how the client updates combine.

Each axis's spec owns its engine code; the round (``fedorth.fed.round``) only orders the steps,
and hands every spec method the round's ``fedorth.fed.context.RoundContext``.
docs/ARCHITECTURE.md says where to add what.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from fedorth.fed.corrections import Corrections
from fedorth.fed.quantities import ClientReport, ServerQuantities
from fedorth.fed.start import ClientStart, Reset
from fedorth.fed.update import ServerUpdate


@dataclasses.dataclass(frozen=True)
class FedAlgorithm:
    """An immutable description of a federated algorithm (see the module docstring).

    Attributes:
      name: registry name.
      local_tx: the client's local optimizer; receives the extra arguments ``learning_rate``,
        ``round_context`` (the round's ``fedorth.fed.context.RoundContext``), ``obj_fn``,
        ``key``, the corrections' (``global_direction``, ``control_correction``,
        ``client_control``, the pre-pass entries) and the server quantities
        (``ServerState.extra``).
      start: how a client's optimizer state starts a round (``fedorth.fed.start``).
      corrections: the server quantities of the local corrections (``fedorth.fed.corrections``).
      quantities: server quantities kept in ``ServerState.extra``, or None.
      report: what each client reports after its steps, or None.
      server: the server update (``fedorth.fed.update``).
      full_participation_only: the algorithm is only defined with ``S = N`` (FedMuon (Zhang &
        Gao)).
      paper: the citation shown in errors and reports.
      optim_schedule: the learning-rate keys of the ``optim`` dict it was built from
        (``learning_rate``, ``schedule``, ...; recorded by ``fed.get_algorithm``). The round's
        learning rate is ``RoundConfig.learning_rate``; ``RoundConfig.validate`` refuses one
        that contradicts these, so a learning rate in the dict is never silently ignored.
    """

    name: str
    local_tx: optax.GradientTransformationExtraArgs
    start: ClientStart = Reset()
    corrections: Corrections = Corrections()
    quantities: ServerQuantities | None = None
    report: ClientReport | None = None
    server: ServerUpdate = dataclasses.field(default_factory=ServerUpdate)
    full_participation_only: bool = False
    paper: str = ""
    optim_schedule: dict[str, Any] | None = None
