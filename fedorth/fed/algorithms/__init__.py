"""Registry of federated algorithms by name.

``get_algorithm(name, optim, **options)`` builds a :class:`fedorth.fed.FedAlgorithm`; ``optim``
is the local optimizer config (``name`` plus hyperparameters), ``options`` the algorithm's own
(e.g. ``alpha``, ``beta``, ``server_lr``).

Every algorithm also takes ``server_opt`` (``fedorth.fed.update.server_optimizer``: ``"sgd"``,
``"nesterov"``, ``"adam"``, ``"yogi"``, ``"adagrad"``): the server optimizer then replaces the
algorithm's own on the pseudo-gradient, and ``server_lr``, ``server_momentum``, ``server_b1``,
``server_b2``, ``server_tau`` are that optimizer's (FedYogi and FedAdagrad are FedAvg with
``server_opt="yogi"``/``"adagrad"``; DiLoCo's outer step is ``server_opt="nesterov"``, on any
algorithm).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from fedorth.fed import local, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.algorithms.baselines_adam_biclip import adam_biclip
from fedorth.fed.algorithms.baselines_fafed import fafed
from fedorth.fed.algorithms.baselines_fedlada import fedadamw, fedlada
from fedorth.fed.algorithms.baselines_momentum_vr import (
    fedavg_m,
    fedavg_vr,
    scaffold_m,
    scaffold_vr,
)
from fedorth.fed.algorithms.baselines_padamfed import padamfed, padamfed_vr
from fedorth.fed.algorithms.baselines_second_order import fed_sophia, fedpm
from fedorth.fed.algorithms.fedavg import fedadam, fedavg, fedavgm
from fedorth.fed.algorithms.fedcm import fedcm
from fedorth.fed.algorithms.feddyn import feddyn
from fedorth.fed.algorithms.fedmuon import fedmuon, fedmuon_svd
from fedorth.fed.algorithms.fedmuon_bc import fedmuon_bc
from fedorth.fed.algorithms.fedmuon_zg import fedmuon_zg
from fedorth.fed.algorithms.fednova import fednova
from fedorth.fed.algorithms.fedpac import LIGHT_RATIOS, fedpac
from fedorth.fed.algorithms.fedprox import fedprox
from fedorth.fed.algorithms.minimax import fed_nsgda_m, fedmuon_da, fedsgda_clip
from fedorth.fed.algorithms.minimax_baselines import (
    f_sagda,
    fedsgda_m,
    fess_gda,
    local_sgda,
    local_sgdam,
)
from fedorth.fed.algorithms.scaffold import scaffold


def _with_optimizer(factory: Callable[..., FedAlgorithm], optimizer: str, name: str, **fixed):
    """A preset that requires ``optim.name == optimizer`` (e.g. ``local_soap``, ``fedpac_muon``)."""

    @functools.wraps(factory)
    def build(optim: Mapping[str, Any], **options) -> FedAlgorithm:
        if optim["name"] != optimizer:
            raise ValueError(
                f"{name} runs the {optimizer!r} local optimizer; got optim.name="
                f"{optim['name']!r} (use 'fedavg'/'fedpac' for any optimizer)."
            )
        return factory(optim, name=name, **{**fixed, **options})

    return build


ALGORITHMS: dict[str, Callable[..., FedAlgorithm]] = {
    "fedavg": fedavg,
    "fedavgm": fedavgm,
    "fedadam": fedadam,
    "scaffold": scaffold,
    "fedcm": fedcm,
    "fedprox": fedprox,
    "feddyn": feddyn,
    "fednova": fednova,
    "fedmuon": fedmuon,
    "fedmuon_svd": fedmuon_svd,
    "fedmuon_bc": fedmuon_bc,
    "fedmuon_zg": fedmuon_zg,
    "fedpac": fedpac,
    "fedlada": fedlada,  # baselines of FedMuon (Liu et al.)
    "fedadamw": fedadamw,
    "fedavg_m": fedavg_m,  # FedMuon (Zhang & Gao)
    "fedavg_vr": fedavg_vr,
    "scaffold_m": scaffold_m,
    "scaffold_vr": scaffold_vr,
    "padamfed": padamfed,
    "padamfed_vr": padamfed_vr,
    "fafed": fafed,
    "adam_biclip": adam_biclip,
    "fed_sophia": fed_sophia,  # FedPAC (Liu et al.)
    "fedpm": fedpm,
    "fed_nsgda_m": fed_nsgda_m,  # Fed minimax (Zhang & Gao) (federated minimax)
    "fedmuon_da": fedmuon_da,
    "fedsgda_clip": fedsgda_clip,
    "local_sgda": local_sgda,
    "local_sgdam": local_sgdam,
    "fedsgda_m": fedsgda_m,
    "f_sagda": f_sagda,
    "fess_gda": fess_gda,
}
for _opt in ("sgd", "adamw", "muon", "soap", "sophia", "lmo"):
    ALGORITHMS[f"local_{_opt}"] = _with_optimizer(fedavg, _opt, f"local_{_opt}")
for _opt, _ratio in LIGHT_RATIOS.items():
    ALGORITHMS[f"fedpac_{_opt}"] = _with_optimizer(fedpac, _opt, f"fedpac_{_opt}")
    ALGORITHMS[f"fedpac_{_opt}_light"] = _with_optimizer(
        fedpac, _opt, f"fedpac_{_opt}_light", light_ratio=_ratio
    )


def get_algorithm(name: str, optim: Mapping[str, Any], **options) -> FedAlgorithm:
    """Builds the registered algorithm ``name`` with local optimizer config ``optim``."""
    if name not in ALGORITHMS:
        raise ValueError(f"fed.algorithm={name!r} is unknown; valid: {sorted(ALGORITHMS)}.")
    outer_tx = None
    if options.get("server_opt") is not None:
        keys = update.SERVER_OPTIMIZER_KEYS[1:]
        server_options = {k: options.pop(k) for k in keys if k in options}
        server_opt = options.pop("server_opt")
        outer_tx = update.server_optimizer(server_opt, **server_options)
    options.pop("server_opt", None)
    accepted = _option_keywords(name)
    unknown = sorted(set(options) - set(accepted)) if accepted is not None else []
    if unknown:
        raise ValueError(
            f"fed.algorithm={name!r}: bad options: it does not take "
            f"{', '.join('fed.options.' + k for k in unknown)}; its options are {accepted}."
        )
    try:
        algorithm = ALGORITHMS[name](optim, **options)
    except TypeError as e:  # a value of the wrong type: name the keys, not the factory
        message = re.sub(r"\b\w+\(\) ", "", str(e))
        raise ValueError(f"fed.algorithm={name!r} with fed.options={options}: {message}") from e
    # The round's learning rate is RoundConfig's: recorded so that RoundConfig.validate refuses
    # a contradicting one instead of ignoring optim["learning_rate"].
    schedule = {k: optim[k] for k in local.SCHEDULE_KEYS if k in optim}
    algorithm = dataclasses.replace(algorithm, optim_schedule=schedule or None)
    if outer_tx is None:
        return algorithm
    return dataclasses.replace(
        algorithm,
        server=dataclasses.replace(algorithm.server, tx=outer_tx),
        paper=f"{algorithm.paper}; server: {update.SERVER_OPTIMIZER_PAPERS[server_opt]}",
    )


def _option_keywords(name: str) -> list[str] | None:
    """The ``fed.options`` keys algorithm ``name`` takes (``None``: any, it takes ``**kwargs``)."""
    params = inspect.signature(inspect.unwrap(ALGORITHMS[name])).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    own = {p.name for p in params if p.kind in named and p.name not in ("optim", "name")}
    return sorted(own | {"server_opt"})


def option_keywords(name: str) -> list[str] | None:
    """The ``fed.options`` keys of algorithm ``name`` (``None`` if it takes any keyword):
    its own and ``server_opt``, with which ``update.SERVER_OPTIMIZER_KEYS`` apply too (module
    docstring)."""
    if name not in ALGORITHMS:
        raise ValueError(f"fed.algorithm={name!r} is unknown; valid: {sorted(ALGORITHMS)}.")
    return _option_keywords(name)
