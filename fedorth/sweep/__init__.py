"""Sweeps: R runs of one algorithm (seeds, hyperparameters) as one compiled program.

``python -m experiments.sweep`` runs a grid of replicas; each writes an ordinary run folder.
"""

from fedorth.sweep.grid import Grid, SweepError, replica_name  # noqa: F401
from fedorth.sweep.replicas import REPLICA_STRATEGIES, ReplicaRound  # noqa: F401
