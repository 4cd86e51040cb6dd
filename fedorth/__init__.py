"""fedorth: federated learning with orthogonalized and second-order local optimizers.

Subpackages, imported on first use (``import fedorth; fedorth.optim.muon(...)``, as
``optax.adam`` after ``import optax``; ``import fedorth`` alone loads neither JAX nor Flax):
  optim:  Optax transforms (Newton–Schulz/Muon, LMOs, SOAP, Sophia, federated pieces).
  fed:    the federated engine (one compiled round) and the papers' algorithms.
  data:   federated datasets (embedded offline default, TFDS loaders, partitioners).
  models: Flax models of the papers' experiments.
  train:  the experiment loop behind ``python -m experiments.main`` and ``fedorth run``.
  theory: the toy problems and rollouts behind the notebooks.
"""

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = ("data", "fed", "models", "optim", "theory", "train")
__all__ = ["__version__", *_SUBPACKAGES]


def __getattr__(name: str):
    # PEP 562: the subpackage is imported (and bound here by the import system) on first access.
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBPACKAGES))
