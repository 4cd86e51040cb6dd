"""FedPAC: preconditioner alignment and correction for any averageable optimizer (FedPAC (Liu et
al.)).

FedPAC (Liu et al.) (docs/PAPERS.md: Liu et al., "Taming Preconditioner Drift"),
Alg. 2/3 and Appendix Alg. 5 (SOAP), 7 (Muon), 9 (Sophia):

* **alignment**: clients upload their preconditioner states ``Theta_i^{r,K}`` (Alg. 2 line 12),
  the server averages them (line 16) and clients warm-start from the average (line 3) --
  ``start.Global(mask=fedorth.optim.federated.align_mask)`` (``align=False``:
  ``start.Reset()``); ``Theta`` is §3.2's: SOAP ``{L, R}``, Sophia ``{h}``, Muon ``{m}``. The
  rest of the state restarts from ``init`` every round, as in Local-X (FedPAC = Local-X +
  alignment + correction);
* **correction**: ``x <- x - eta [(1 - beta) P_Theta(g) + beta g_G]`` (line 9), with
  ``g_G = -mean_i(x_i^K - x_i^0) / (K eta)`` (line 14, ``g_G^0 = 0``) --
  ``Corrections(global_direction=True)`` and
  :func:`fedorth.optim.federated.mix_with_global` in the local optimizer (``beta = 0``: neither);
* server: ``x <- x + mean_i(dx_i)`` (Alg. 2 line 15, ``update.Mean()``) or, with
  ``server_lr = gamma``, ``x <- x - gamma g_G`` (Alg. 3 line 15, ``update.GlobalStep(gamma)``);
* ``_light`` variants upload the aligned state low-rank by truncated SVD, keeping 5% (Muon,
  Sophia) or 10% (SOAP) of each matrix's rank, in Muon's matrix view (FedPAC (Liu et al.)
  Table 6, Table 11: 0.05|Theta| and 0.1|Theta|; what that costs, and how the tables count it:
  ``fedorth.optim.compress``) -- ``start.Global(mask=..., compression=light_ratio)``.

FedPAC works over any Optax direction whose state is averageable (float leaves averaged, integer
schedule counters shared, custom rules such as SOAP's registered with
:func:`fedorth.optim.federated.register_average`): e.g. ``optim.name="adamw"`` aligns Adam's
moments across clients -- a capability no other framework has. An optimizer whose state declares
no ``Theta`` (AdamW, momentum SGD) is aligned whole, as with ``aligned="state"``.

Choices (what the boxes leave open):

* ``aligned="theta"`` (default, Alg. 2): what is warm-started besides ``Theta`` itself is what the
  server derives from it and the shared schedule counters (``federated.align_mask``). SOAP:
  ``L, R`` averaged, the eigenbases ``Q`` rebuilt by the server from them (never uploaded,
  compressed or averaged), ``count`` global (the refresh every ``f`` steps of the whole
  training, one update-free first step in all), the moments ``m, v`` from zero with their own
  bias-correction count ``moment_count`` (``soap.soap_align_mask``). Sophia: ``h`` averaged,
  ``count`` global (Alg. 9 line 9's ``(rK + k) mod f_h``), ``m`` from zero;
  ``clip_mode="optax"`` bias-corrects ``m`` by that count and is refused
  (``sophia.sophia_align_mask``). Muon: ``m`` of the matrix leaves averaged, the Adam fallback
  of the other leaves from ``init``. Upload and accounting: ``Theta`` only (SOAP
  ``|x| + sum(m^2 + n^2)``, Sophia ``2|x|``: Table 11).
* ``aligned="state"`` (a fedorth extension, ``start.Global()`` without a mask): the whole float
  state is uploaded, averaged and warm-started (SOAP's m, v, L, R, Sophia's m, h, the Adam
  fallback's moments; never SOAP's Q).
* weight decay sits inside the bracket (Alg. 9 line 20); the preconditioner drift (Def. 1,
  Eq. 7) is measured over ``Theta`` in both modes (``federated.theta_mask``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedorth.fed import local, start, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import Corrections
from fedorth.optim import federated

LIGHT_RATIOS = {"soap": 0.1, "muon": 0.05, "sophia": 0.05}
ALIGNED = ("theta", "state")


def fedpac(
    optim: Mapping[str, Any],
    *,
    beta: float = 0.5,
    align: bool = True,
    aligned: str = "theta",
    light_ratio: float | None = None,
    server_lr: float | None = None,
    name: str = "fedpac",
) -> FedAlgorithm:
    """FedPAC over the local optimizer ``optim`` (FedPAC (Liu et al.) Alg. 2/3).

    Args:
      optim: local optimizer config (any name of ``fedorth.fed.local.DIRECTIONS``).
      beta: correction weight in [0, 1] (0 disables correction).
      align: average and warm-start the preconditioner state (else reset each round).
      aligned: what ``align`` aligns: ``"theta"`` (Alg. 2: ``Theta`` only, the rest restarts
        from ``init`` each round) or ``"state"`` (the whole optimizer state, a fedorth
        extension); see the module docstring.
      light_ratio: upload ``Theta`` with this fraction of the rank (the ``_light`` variants).
      server_lr: ``gamma`` of Alg. 3 (``x <- x - gamma g_G``); ``None`` averages (Alg. 2).
    """
    concrete = federated.is_concrete(beta)  # else a sweep's traced value: always corrects
    if concrete and not 0.0 <= beta <= 1.0:
        raise ValueError(f"fed.options.beta={beta} must lie in [0, 1].")
    corrects = not concrete or beta > 0
    if aligned not in ALIGNED:
        raise ValueError(f"fed.options.aligned={aligned!r}; valid: {ALIGNED}.")
    opt, weight_decay, hp = local.split_optim(optim)
    if align and aligned == "theta" and opt == "sophia" and hp.get("clip_mode") == "optax":
        raise ValueError(
            "fed.options.aligned='theta' with optim.clip_mode='optax': Sophia's optax form "
            "bias-corrects m by the shared count, which Theta alignment keeps across rounds "
            "while m restarts; use optim.clip_mode='paper' (FedPAC (Liu et al.) Alg. 9) or "
            "fed.options.aligned='state'."
        )
    tx = local.local_tx(
        local.direction(opt, **hp),
        weight_decay=local.decay_rates(opt, weight_decay, hp),
        mix_beta=beta if corrects else None,
    )
    return FedAlgorithm(
        name=name,
        local_tx=tx,
        start=start.Global(
            mask=federated.align_mask if aligned == "theta" else None, compression=light_ratio
        )
        if align
        else start.Reset(),
        corrections=Corrections(global_direction=corrects),
        server=update.ServerUpdate(rule=update.global_step_or_mean(server_lr)),
        paper="FedPAC (Liu et al.) Alg. 2/3",
    )
