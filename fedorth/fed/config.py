"""The static settings of a round (:class:`RoundConfig`) and their checks.

``fedorth.train.builders.make_round_config`` builds one from an experiment's config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from fedorth.fed import aggregation as aggregation_lib
from fedorth.fed import privacy as privacy_lib
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.privacy import ClientDP

STRATEGIES = ("auto", "vmap", "chunked", "sequential", "sharded")


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """Static settings of a round.

    Attributes:
      num_clients: ``N``.
      clients_per_round: ``S``, sampled without replacement each round.
      local_steps: ``K``.
      learning_rate: the local learning rate ``eta_r``: a float or a schedule over rounds.
      strategy: one of :data:`STRATEGIES` (``"auto"``: :func:`resolve_strategy`).
      chunk_size: clients per chunk for ``"chunked"``.
      mesh: the device mesh for ``"sharded"``, with a ``"clients"`` axis whose size divides
        ``clients_per_round`` (default: :func:`client_mesh`).
      unroll: ``unroll`` of the local-step ``lax.scan`` (1 = a rolled loop, the measured best
        with the models' default convolutions; ``True`` = fully unrolled).
      spectral_drift: also compute the spectral-norm preconditioner drift (power iteration).
      privacy: client-level differential privacy (``fedorth.fed.privacy.ClientDP``: DP-FedAvg's
        clipped, noised aggregate), or None.
      aggregation: how the server weighs the sampled clients, one of
        ``fedorth.fed.aggregation.AGGREGATIONS``: ``"uniform"`` (``1/S`` each) or
        ``"examples"`` (by their example counts, FedAvg's original rule).
      client_rows: ``ServerState.clients`` holds the ``S`` sampled clients' states (in the order
        of the sorted sampled ids) instead of all ``N``, and the round returns theirs in it: the
        states of all clients live in a store outside the round (``fedorth.fed.client_store``).
    """

    num_clients: int
    clients_per_round: int
    local_steps: int
    learning_rate: float | Callable[[jax.Array], jax.Array]
    strategy: str = "auto"
    chunk_size: int | None = None
    mesh: Mesh | None = None
    unroll: int | bool = 1
    spectral_drift: bool = False
    privacy: ClientDP | None = None
    aggregation: str = "uniform"
    client_rows: bool = False

    def validate(self, algorithm: FedAlgorithm) -> None:
        n, s, k = self.num_clients, self.clients_per_round, self.local_steps
        if n < 1:
            raise ValueError(f"fed.num_clients={n} must be >= 1.")
        if not 1 <= s <= n:
            raise ValueError(
                f"fed.clients_per_round={s} must lie in [1, num_clients={n}] "
                "(clients are sampled without replacement)."
            )
        if k < 1:
            raise ValueError(f"fed.local_steps={k} must be >= 1.")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"fed.strategy={self.strategy!r}; valid: {STRATEGIES}.")
        if not (
            isinstance(self.unroll, bool) or (isinstance(self.unroll, int) and self.unroll >= 1)
        ):
            raise ValueError(f"fed.unroll={self.unroll!r}; valid: an int >= 1 or True.")
        if self.strategy == "chunked" and not (self.chunk_size and self.chunk_size >= 1):
            raise ValueError(f"fed.chunk_size={self.chunk_size} must be >= 1 for 'chunked'.")
        if self.mesh is not None:
            if "clients" not in self.mesh.axis_names:
                raise ValueError(
                    f"fed.mesh has axes {self.mesh.axis_names}; the clients are laid over an "
                    "axis named 'clients'."
                )
            devices = self.mesh.shape["clients"]
            if s % devices:
                raise ValueError(
                    f"fed.clients_per_round={s} must be a multiple of the {devices} devices "
                    "of the mesh's 'clients' axis for strategy 'sharded'."
                )
        aggregation_lib.check(
            self.aggregation,
            algorithm,
            privacy=self.privacy,
            spectral_drift=self.spectral_drift,
        )
        if self.privacy is not None:
            if self.privacy.sampling == "poisson" and s != n:
                raise ValueError(
                    f"dp.sampling='poisson' runs every client and masks them: set "
                    f"fed.clients_per_round={n} (= num_clients), got {s}."
                )
            if algorithm.server.combine is not None:
                raise ValueError(
                    f"dp: {algorithm.name} combines the clients' updates with its own rule "
                    "(ServerUpdate.combine), which DP-FedAvg's noised sum does not cover; "
                    "use an algorithm that averages its uploads, or leave config.dp off."
                )
            if privacy_lib.averages_by_own_rule(algorithm, self.spectral_drift):
                raise ValueError(privacy_lib.OWN_RULE.format(name=algorithm.name))
            privacy_lib.check_count_noise(self.privacy)
        if algorithm.full_participation_only and s != n:
            raise ValueError(
                f"{algorithm.name} is defined for full participation only ({algorithm.paper}): "
                f"set fed.clients_per_round={n} (= num_clients), got {s}."
            )
        if not callable(self.learning_rate) and not float(self.learning_rate) > 0:
            raise ValueError(f"optim.learning_rate={self.learning_rate} must be > 0.")
        given = algorithm.optim_schedule or {}
        if not callable(self.learning_rate) and given:
            # The optim dict of fed.get_algorithm named a learning rate: it must be this one.
            schedule = given.get("schedule", "constant")
            if schedule != "constant" or float(
                given.get("learning_rate", self.learning_rate)
            ) != float(self.learning_rate):
                raise ValueError(
                    f"{algorithm.name} was built from an optim dict with {given}, but "
                    f"RoundConfig.learning_rate={self.learning_rate}: the round's learning rate "
                    "is RoundConfig.learning_rate (a float, or a schedule over rounds such as "
                    "fedorth.train.builders.learning_rate_schedule(optim, rounds)); give the "
                    "same there, or leave the learning-rate keys out of the optim dict."
                )

    def lr(self, round_index: jax.Array) -> jax.Array:
        # Default float dtype: float32, or float64 under jax_enable_x64 (exact reference tests).
        dtype = jnp.result_type(float)
        if callable(self.learning_rate):
            return jnp.asarray(self.learning_rate(round_index), dtype)
        return jnp.asarray(self.learning_rate, dtype)
