"""FedMuon with momentum aggregation and local-global alignment (FedMuon (Liu et al.)).

FedMuon (Liu et al.) (docs/PAPERS.md: Liu et al., "FedMuon: Accelerating Federated
Learning with Matrix Orthogonalization"), Alg. 2:

* clients start from the server's averaged momentum ``M-bar`` (line 4) -- ``start.Global()``
  (``momentum_aggregation=False``: ``start.Reset()``);
* local step ``M <- beta M + G``; ``x <- x - eta [(1 - alpha) UV^T + lambda x + alpha Delta_G]``
  (lines 7-9) -- Muon's direction, mixing with the global direction
  (:func:`fedorth.optim.federated.mix_with_global`), decoupled weight decay;
* the server averages parameters (line 14, ``update.Mean()``) and momenta (line 15, the
  ``start.Global()`` upload) and sets ``Delta_G = -mean_i(x_i^K - x_i^0) / (K eta)`` (line 13)
  -- ``Corrections(global_direction=True)`` (``alpha = 0``: no ``Delta_G``);
* FedMuon_SVD (Sec. 5.2, Table 7) uploads each momentum matrix as its top-k singular triplets,
  ``k`` = 5% of the rank -- ``start.Global(compression=0.05)``.

Choices where the paper is loose: the box writes ``UV^T`` of an exact SVD; like its experiments we
use Newton-Schulz (``optim.ns_steps``, ``optim.ns_coeffs``). Non-matrix leaves (biases, norms)
use Muon's Adam fallback, whose state is averaged with the momentum. ``Delta_G^0 = 0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedorth.fed import local, start
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import Corrections
from fedorth.optim import federated as fed_optim


def fedmuon(
    optim: Mapping[str, Any],
    *,
    alpha: float = 0.5,
    momentum_aggregation: bool = True,
    svd_ratio: float | None = None,
    name: str = "fedmuon",
) -> FedAlgorithm:
    """FedMuon (Liu et al., Alg. 2); ``svd_ratio`` gives FedMuon_SVD.

    Args:
      optim: the local optimizer config (``name="muon"``: beta, ns_steps, ...; weight_decay).
      alpha: local-global alignment weight in [0, 1] (0 disables alignment).
      momentum_aggregation: warm-start clients from the averaged momentum (else reset).
      svd_ratio: fraction of the rank kept when uploading momentum (FedMuon_SVD: 0.05).
    """
    concrete = fed_optim.is_concrete(alpha)  # else a sweep's traced value: always aligns
    if concrete and not 0.0 <= alpha <= 1.0:
        raise ValueError(f"fed.options.alpha={alpha} must lie in [0, 1].")
    aligns = not concrete or alpha > 0
    opt, weight_decay, hp = local.split_optim(optim)
    tx = local.local_tx(
        local.direction(opt, **hp),
        weight_decay=local.decay_rates(opt, weight_decay, hp),
        mix_beta=alpha if aligns else None,
    )
    return FedAlgorithm(
        name=name,
        local_tx=tx,
        start=start.Global(compression=svd_ratio) if momentum_aggregation else start.Reset(),
        corrections=Corrections(global_direction=aligns),
        paper="FedMuon (Liu et al.) Alg. 2",
    )


def fedmuon_svd(optim: Mapping[str, Any], *, svd_ratio: float = 0.05, **kwargs) -> FedAlgorithm:
    """FedMuon_SVD: momentum uploaded as its top 5% singular triplets (FedMuon (Liu et al.) Sec.
    5.2)."""
    return fedmuon(optim, svd_ratio=svd_ratio, name="fedmuon_svd", **kwargs)
