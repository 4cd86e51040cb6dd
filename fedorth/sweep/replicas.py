"""R runs of one algorithm as one compiled round over a replica axis.

Each replica is built exactly as its single run (``fedorth.train.builders.build`` of its
config: its seed's model init, data partition and server key), so a replica is that run: the
same client samples, mini-batches and dropout, round after round. Its traced hyperparameters
(:mod:`fedorth.sweep.grid`) enter the round as float arrays: inside the compiled function the
algorithm and the round are built from them (``fed.get_algorithm``, ``fed.make_round_fn``), so
one compilation serves every value.

Replica strategies (``replica_strategy``), like the clients' (``fed.strategy``; ``"auto"``:
:mod:`fedorth.sweep.strategy`, sequential on CPU, measured on an accelerator):

* ``"sequential"``: one compiled round, called once per replica.
* ``"vmap"``: ``jax.vmap`` over replicas, in chunks of ``replica_chunk_size`` replicas (0: all)
  to bound memory; a last chunk that is short is filled with copies of its last replica, so
  every chunk runs the same compiled round.

With ``"sequential"`` a replica's numbers are bit for bit those of its single run; vmapped,
they agree to float32 rounding (batched products may sum in another order). Two exceptions,
also to float32 rounding: a traced hyperparameter that the single run combines in Python
(float64) before it reaches the round (SOAP's ``1 - b1``), and a traced one in a sharded round
(XLA partitions a call with an operand unlike one with a constant); docs/SWEEPS.md.

The data of the replicas is one argument: a leaf every replica has equal (the examples) is
passed once, a leaf that differs (the clients' index rows of another seed's partition) is
stacked over replicas. Index rows are padded to the longest client of all replicas; a client's
mini-batches draw positions below its own size only (``fedorth.data.sample_batch``), so padding
changes no batch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec

from fedorth import fed
from fedorth.fed import execution
from fedorth.fed.memory import is_out_of_memory
from fedorth.sweep import placement as placement_lib
from fedorth.sweep import strategy as strategy_lib
from fedorth.sweep.grid import SweepError, replica_name, set_key
from fedorth.sweep.strategy import REPLICA_STRATEGIES, resolve_replica_strategy  # noqa: F401
from fedorth.train import builders

PyTree = Any

_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


class _Section(dict):
    """A dict read like a ConfigDict section (``optim.learning_rate``, ``optim.get``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _to_dict(section) -> dict[str, Any]:
    return {} if section is None else section.to_dict()


def _pad_index(data, width: int):
    pad = width - data.client_index.shape[1]
    if pad == 0:
        return data
    return data.replace(client_index=jnp.pad(data.client_index, ((0, 0), (0, pad))))


def _same(a, b) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    if getattr(a, "shape", None) != getattr(b, "shape", None) or a.dtype != b.dtype:
        return False
    return bool(jnp.array_equal(a, b))


@dataclasses.dataclass
class Replica:
    """One replica: its grid values, its single run's config and built experiment."""

    name: str
    values: dict[str, Any]
    config: ml_collections.ConfigDict
    experiment: builders.Experiment


class ReplicaRound:
    """The round of R replicas: ``states = replica_round(states)``; states are per unit.

    A unit is one replica (``"sequential"``) or one chunk of replicas stacked on a leading axis
    (``"vmap"``). :meth:`initial_states` gives the units' round-0 states, :meth:`stack` and
    :meth:`unstack` convert between units and one ``[R, ...]`` state (the checkpoint), and
    :meth:`replica_state` reads one replica's state out of the units.

    Args:
      configs: each replica's config (its single run's).
      replicas: one ``{key: value}`` per replica (``Grid.replicas``).
      traced_keys: the keys passed to the round as arrays (``Grid.traced_keys``).
      names: the replicas' names (their folders).
      strategy: one of :data:`REPLICA_STRATEGIES`.
      chunk_size: replicas per vmapped chunk (0: all at once).
      build: builds a replica's experiment from its config (``builders.build``; a benchmark
        passes one on random data).
      timer: the clock ``"auto"`` times the strategies with (tests pass a fake).
      on_build: called with the number of replicas built so far, after each (a progress line).
      devices_per_replica: None runs every replica on the default device; a number places the
        replicas on groups of that many devices of every process
        (:mod:`fedorth.sweep.placement`; 0: one device each), ``chunk_size`` replicas at once
        on each group.
      assignment: with ``devices_per_replica``, each replica's group of devices (default
        :func:`fedorth.sweep.placement.place`'s).

    Attributes:
      strategy: the replica strategy that runs (never ``"auto"``).
      replica_selection: how ``"auto"`` chose it on an accelerator
        (:func:`fedorth.sweep.strategy.measure_replica_strategies`), else None.
      placement: where the replicas run (:class:`fedorth.sweep.placement.Placement`), or None
        on the default device.
    """

    def __init__(
        self,
        configs: Sequence[ml_collections.ConfigDict],
        replicas: Sequence[Mapping[str, Any]],
        traced_keys: Sequence[str],
        names: Sequence[str],
        *,
        strategy: str = "auto",
        chunk_size: int = 0,
        build: Callable[[ml_collections.ConfigDict], builders.Experiment] = builders.build,
        timer: Callable[[], float] = time.perf_counter,
        on_build: Callable[[int], None] | None = None,
        devices_per_replica: int | None = None,
        assignment: list[int] | None = None,
    ):
        if chunk_size < 0:
            raise SweepError(f"--replica_chunk_size={chunk_size} must be >= 0 (0: all at once).")
        strategy_lib.check_replica_strategy(strategy)
        stores = {c.fed.get("client_state", "auto") for c in configs} - {"auto", "device"}
        if stores:
            # The replicas' rounds are one vmapped call over their whole server states.
            raise SweepError(
                f"fed.client_state={sorted(stores)[0]!r}: a sweep keeps its replicas' client "
                "states on the device (its rounds vmap whole server states); use "
                "--config.fed.client_state=device (or auto), or run the grid's points as single "
                "runs."
            )
        self.traced_keys = list(traced_keys)
        self.replicas: list[Replica] = []
        for name, values, config in zip(names, replicas, configs, strict=True):
            experiment = builders.refuse_stream(build(config))
            self.replicas.append(Replica(name, dict(values), config, experiment))
            if on_build is not None:
                on_build(len(self.replicas))
        first = self.replicas[0].experiment
        self.config = first.config
        self.model = first.model
        self.batch_fn = builders.make_batch_fn(first.config)
        servers = [builders.init_server(r.experiment) for r in self.replicas]
        self.devices_per_replica, self.assignment = devices_per_replica, assignment
        self.placement: placement_lib.Placement | None = None
        mesh = None
        if devices_per_replica is None:
            # The clients' strategy: fed.strategy "auto" on one accelerator times the candidates
            # on the first replica's round (fed.MeasuredRoundFn); the replicas all run the choice.
            first.round_fn.select(servers[0], first.data)
            self.client_strategy = first.round_fn.strategy
            self.selection = first.round_fn.selection
        else:
            # A replica's clients run on its group's devices: sharded over them, or as on one
            # device (the config's strategy where it names a one-device one).
            mesh = placement_lib.place(
                len(self.replicas), devices_per_replica=devices_per_replica
            ).mesh
            configured = first.round_config.strategy
            self.client_strategy = (
                "sharded"
                if mesh.shape[placement_lib.CLIENTS_AXIS] > 1
                else configured
                if configured in ("vmap", "chunked", "sequential")
                else execution.one_device_strategy()
            )
            self.selection = None
        self.round_config = dataclasses.replace(
            first.round_config,
            strategy=self.client_strategy,
            mesh=mesh if self.client_strategy == "sharded" else first.round_config.mesh,
        )
        self._initial = servers
        self._placed: dict[tuple, Any] = {}
        self._prepare_data()
        dtype = jnp.result_type(float)
        self.values = {
            key: np.asarray([r.values[key] for r in self.replicas], dtype) for key in traced_keys
        }
        self.check_traceable()
        self.replica_selection: dict[str, Any] | None = None
        if strategy_lib.measures(strategy, len(self.replicas)):
            plans = {name: self._plan(name, chunk_size) for name in ("vmap", "sequential")}
            self.replica_selection = strategy_lib.measure_replica_strategies(
                {name: self._candidate(plan) for name, plan in plans.items()}, timer=timer
            )
            if jax.process_count() > 1:  # every process runs process 0's choice
                from jax.experimental import multihost_utils

                names = list(plans)
                chosen = names.index(self.replica_selection["strategy"])
                chosen = int(multihost_utils.broadcast_one_to_all(np.int32(chosen)))
                self.replica_selection["strategy"] = names[chosen]
            self._adopt(plans[self.replica_selection["strategy"]])
        else:
            self._adopt(self._plan(resolve_replica_strategy(strategy), chunk_size))

    @classmethod
    def from_grid(
        cls, grid, *, replicas=None, strategy: str = "auto", chunk_size: int = 0, **kwargs
    ):
        """The replicas of a :class:`fedorth.sweep.Grid` (every combination of its values, or
        the given ``replicas``: a list of ``{key: value}`` over its keys), named by
        :func:`replica_name`."""
        replicas = grid.replicas() if replicas is None else replicas
        return cls(
            [grid.replica_config(values) for values in replicas],
            replicas,
            grid.traced_keys,
            [replica_name(values) for values in replicas],
            strategy=strategy,
            chunk_size=chunk_size,
            **kwargs,
        )

    # -- the replica strategy -------------------------------------------------------------

    def _plan(self, strategy: str, chunk_size: int) -> dict[str, Any]:
        """The units, chunk size and jitted round of ``strategy`` (``"sequential"``/``"vmap"``)."""
        count = len(self.replicas)
        if self.devices_per_replica is not None:
            return self._placed_plan(strategy, chunk_size)
        if strategy == "sequential":
            units, step = [[i] for i in range(count)], jax.jit(self._body, donate_argnums=(0,))
            return dict(strategy=strategy, chunk_size=count, units=units, step=step)
        size = min(chunk_size or count, count)
        units = []
        for start in range(0, count, size):
            unit = list(range(start, min(start + size, count)))
            units.append(unit + [unit[-1]] * (size - len(unit)))
        axes = jax.tree.map(lambda shared: None if shared else 0, self._data_shared)
        step = jax.jit(jax.vmap(self._body, in_axes=(0, axes, 0)), donate_argnums=(0,))
        return dict(strategy=strategy, chunk_size=size, units=units, step=step)

    def _placed_plan(self, strategy: str, chunk_size: int) -> dict[str, Any]:
        """The round of ``strategy`` on the placement's mesh: each group of devices runs its
        ``chunk`` replicas vmapped (``"sequential"``: one at a time), inside a ``shard_map``
        over the replica axis, so that no collective crosses replicas."""
        placement = placement_lib.place(
            len(self.replicas),
            devices_per_replica=self.devices_per_replica,
            chunk_size=chunk_size,
            sequential=strategy == "sequential",
            assignment=self.assignment,
        )
        replica = PartitionSpec(placement_lib.REPLICA_AXIS)
        axes = jax.tree.map(lambda shared: None if shared else 0, self._data_shared)
        specs = jax.tree.map(
            lambda shared: PartitionSpec() if shared else replica, self._data_shared
        )
        # The clients axis stays automatic: a replica's sharded clients lay themselves over it.
        mapped = jax.shard_map(
            jax.vmap(self._body, in_axes=(0, axes, 0)),
            mesh=placement.mesh,
            in_specs=(replica, specs, replica),
            out_specs=replica,
            axis_names={placement_lib.REPLICA_AXIS},
            check_vma=False,
        )
        step = _CheckedStep(jax.jit(mapped, donate_argnums=(0,)), placement)
        return dict(
            strategy=strategy,
            chunk_size=placement.chunk,
            units=placement.units,
            step=step,
            placement=placement,
        )

    def collectives(self) -> dict[str, Any]:
        """Placed on a mesh: the compiled round's collectives, ``{"count": all of them,
        "across_replicas": those whose devices span groups}`` (compiled here for the first
        unit, and that compilation runs the rounds); else None."""
        if self.placement is None:
            return None
        step = self._step
        if step.compiled is None:
            unit = self.units[0]
            step.compile(
                self._unit_state([self._initial[i] for i in unit]),
                self._unit_data(unit),
                self._unit_values(unit),
            )
        return {"count": len(step.collectives), "across_replicas": step.across}

    def _adopt(self, plan: dict[str, Any]) -> None:
        self.strategy, self.chunk_size = plan["strategy"], plan["chunk_size"]
        self.units, self._step = plan["units"], plan["step"]
        self.placement = plan.get("placement")

    def _candidate(self, plan: dict[str, Any]) -> strategy_lib.Candidate:
        """``plan``'s round and its first unit's arguments, to time (the states are copied)."""
        self._adopt(plan)
        unit = self.units[0]
        states = self._unit_state([self._initial[i] for i in unit])
        arguments = (states, self._unit_data(unit), self._unit_values(unit))
        return strategy_lib.Candidate(plan["step"], arguments, len(self.units))

    # -- data ---------------------------------------------------------------------------------

    def _prepare_data(self) -> None:
        """Pads the index rows to one width and marks the leaves every replica has equal."""
        width = max(r.experiment.data.client_index.shape[1] for r in self.replicas)
        datas = [_pad_index(r.experiment.data, width) for r in self.replicas]
        first = datas[0]
        leaves0, treedef = jax.tree.flatten(first)
        shared = [True] * len(leaves0)
        for data in datas[1:]:
            for i, (a, b) in enumerate(zip(leaves0, jax.tree.leaves(data), strict=True)):
                shared[i] = shared[i] and _same(a, b)
        self._data_shared = jax.tree.unflatten(treedef, shared)
        # Equal leaves are kept once (the first replica's arrays).
        self._datas = [
            jax.tree.unflatten(
                treedef,
                [
                    a if s else b
                    for a, b, s in zip(leaves0, jax.tree.leaves(d), shared, strict=True)
                ],
            )
            for d in datas
        ]
        for replica, data in zip(self.replicas, self._datas, strict=True):
            replica.experiment.data = data
        # The evaluated splits (test, validation): one compiled evaluation if all are equal.
        splits = ("x_test", "y_test", "x_val", "y_val")
        self._test_shared = all(
            _same(getattr(first, name), getattr(d, name)) for d in datas for name in splits
        )

    def _unit_values(self, unit: list[int]) -> dict[str, jax.Array]:
        if self.placement is not None:
            return {key: self._global(v[unit]) for key, v in self.values.items()}
        pick = unit[0] if self.strategy == "sequential" else unit
        return {key: jnp.asarray(v[pick]) for key, v in self.values.items()}

    def _global(self, x, *, replicated: bool = False):
        """The host array ``x`` as an array over the placement's mesh: stacked over replicas
        (its leading axis over the groups), or ``replicated`` on every device."""
        sharding = self.placement.replicated if replicated else self.placement.sharding
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = self._global(np.asarray(jax.random.key_data(x)), replicated=replicated)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def _unit_data(self, unit: list[int]):
        if self.placement is not None:
            # The data never change: placed once per unit (the shared leaves once for all).
            key = tuple(unit)
            if key not in self._placed:
                shared = jax.tree.leaves(self._data_shared)
                if "shared" not in self._placed:
                    first = jax.tree.leaves(self._datas[0])
                    self._placed["shared"] = [
                        self._global(leaf, replicated=True) if s else None
                        for leaf, s in zip(first, shared, strict=True)
                    ]
                leaves = [jax.tree.leaves(self._datas[i]) for i in unit]
                placed = [
                    self._placed["shared"][j]
                    if shared[j]
                    else self._global(np.stack([np.asarray(ls[j]) for ls in leaves]))
                    for j in range(len(shared))
                ]
                self._placed[key] = jax.tree.unflatten(jax.tree.structure(self._datas[0]), placed)
            return self._placed[key]
        if self.strategy == "sequential":
            return self._datas[unit[0]]
        leaves = [jax.tree.leaves(self._datas[i]) for i in unit]
        shared = jax.tree.leaves(self._data_shared)
        stacked = [
            leaves[0][j] if shared[j] else jnp.stack([ls[j] for ls in leaves])
            for j in range(len(shared))
        ]
        return jax.tree.unflatten(jax.tree.structure(self._datas[0]), stacked)

    # -- the traced round ---------------------------------------------------------------------

    def _body(self, server, data, values: Mapping[str, jax.Array]):
        """One replica's round, its algorithm and learning rate built from ``values``."""
        optim = _to_dict(self.config.optim)
        options = _to_dict(self.config.fed.get("options"))
        tree = {"optim": optim, "fed": {"options": options}}
        for key, value in values.items():
            set_key(tree, key, value)
        algorithm = fed.get_algorithm(self.config.fed.algorithm, optim, **options)
        learning_rate = self.round_config.learning_rate
        if "optim.learning_rate" in values:
            learning_rate = builders.learning_rate_schedule(
                _Section(optim), int(self.config.fed.rounds)
            )
            if not callable(learning_rate):
                learning_rate = _constant(learning_rate)
        round_config = dataclasses.replace(self.round_config, learning_rate=learning_rate)
        round_fn = fed.make_round_fn(algorithm, self.model.loss_fn, self.batch_fn, round_config)
        return round_fn(server, data)

    def check_traceable(self) -> None:
        """Traces the round with each traced key alone; refuses one fedorth reads as a number."""
        server, data = self._initial[0], self._datas[0]
        for key in self.traced_keys:
            value = {key: jnp.asarray(self.values[key][0])}
            try:
                jax.eval_shape(self._body, server, data, value)
            except (*_TRACER_ERRORS, ValueError, TypeError, AttributeError) as e:
                cause = _tracer_error(e)
                if cause is None and len({jax.tree.structure(s) for s in self._initial}) > 1:
                    raise SweepError(
                        f"sweep.{key}: a value 0 leaves out a transform whose state the server "
                        f"keeps for the other values (a weight decay, a momentum, the global "
                        f"direction), so the replicas' states differ in structure; sweep "
                        f"nonzero values and run 0 alone."
                    ) from None
                if cause is None:
                    raise
                raise SweepError(
                    f"sweep.{key} is not sweepable: fedorth reads it as a Python number when it "
                    f"builds the algorithm ({type(cause).__name__}), so its values cannot share "
                    f"a compiled round; run one sweep per value (--config.{key}=VALUE)."
                ) from None

    # -- states -------------------------------------------------------------------------------

    def initial_states(self) -> list[Any]:
        """The units' round-0 states (the replicas' single-run initial states)."""
        return [self._unit_state([self._initial[i] for i in unit]) for unit in self.units]

    def _unit_state(self, servers: list[Any]):
        if self.placement is not None:
            return jax.tree.map(self._global, _host_stack(servers))
        if self.strategy == "sequential":
            return servers[0]
        return _stack(servers)

    def stack(self, states: list[Any]):
        """One state ``[R, ...]`` (round a scalar) of the units' states: the checkpoint's tree.

        Placed on a mesh: ``[units, replicas of a unit, ...]``, each leaf still over the groups
        of devices (every process saves its own part), padding included; replica ``r`` is row
        ``r`` of its first two axes flattened."""
        if self.placement is not None:
            # Every replica is at the same round, and every process holds rows of each unit.
            rounds = np.asarray(states[0].round.addressable_shards[0].data)[0]
            stacked = jax.tree.map(
                lambda *xs: jnp.stack(xs), *[s.replace(round=None) for s in states]
            )
            return stacked.replace(round=rounds)
        per_replica = [self.replica_state(states, i) for i in range(len(self.replicas))]
        stacked = _stack(per_replica)
        return stacked.replace(round=per_replica[0].round)

    def unstack(self, stacked) -> list[Any]:
        """The units' states from :meth:`stack`'s tree."""
        rounds = stacked.round

        def replica(i):
            state = jax.tree.map(lambda x: x[i], stacked.replace(round=None))
            return state.replace(round=jnp.array(rounds))  # a buffer of its own: rounds donate it

        return [self._unit_state([replica(i) for i in unit]) for unit in self.units]

    def replica_state(self, states: list[Any], index: int, *, everywhere: bool = False):
        """Replica ``index``'s server state.

        Placed on a mesh, on the host, and in the process that owns the replica only; with
        ``everywhere``, in every process (a collective: they all call it at the same point)."""
        for unit, state in zip(self.units, states, strict=True):
            if index in unit:
                if self.placement is not None:
                    call, position = self.placement.positions[index]
                    state = states[call]
                    if everywhere:
                        return _host_row(_gathered(state), position)
                    return self._local_rows(state)[position]
                if self.strategy == "sequential":
                    return state
                position = unit.index(index)
                return jax.tree.map(lambda x: x[position], state)
        raise IndexError(index)

    # -- running ------------------------------------------------------------------------------

    def _local_rows(self, tree) -> dict[int, Any]:
        """``{position: host tree}`` of the rows of a unit's tree that this process holds."""
        keys = {}
        if hasattr(tree, "key") and tree.key is not None:
            keys = {"impl": jax.random.key_impl(tree.key)}
            tree = tree.replace(key=jax.random.key_data(tree.key))
        rows: dict[int, list] = {}
        leaves, treedef = jax.tree.flatten(tree)
        for j, leaf in enumerate(leaves):
            for shard in leaf.addressable_shards:
                start = shard.index[0].start or 0
                data = np.asarray(shard.data)
                for offset in range(data.shape[0]):
                    rows.setdefault(start + offset, [None] * len(leaves))[j] = data[offset]
        out = {}
        for position, row in rows.items():
            if any(x is None for x in row):
                continue
            value = jax.tree.unflatten(treedef, row)
            if keys:
                value = value.replace(key=jax.random.wrap_key_data(value.key, **keys))
            out[position] = value
        return out

    def owned(self) -> list[int]:
        """The replicas this process evaluates and writes: all of them, unless placed on the
        devices of several processes."""
        if self.placement is None:
            return list(range(len(self.replicas)))
        return self.placement.owned()

    def out_of_memory_message(self, error: BaseException) -> str:
        """What to change when a round of the replicas runs out of memory: replicas run one at a
        time (``sequential``, on one device) run a single run's round, whose paragraph says it
        (``fed.memory.out_of_memory_message``); several at once, or placed on several devices,
        the sweep's own settings (``fedorth.sweep.strategy.out_of_memory_message``)."""
        if self.placement is None and (self.strategy == "sequential" or self.chunk_size <= 1):
            round_fn = self.replicas[0].experiment.round_fn
            return fed.memory.out_of_memory_message(error, round_fn.config, round_fn.devices[0])
        return strategy_lib.out_of_memory_message(self.strategy, self.chunk_size, self.placement)

    def __call__(self, states: list[Any]) -> tuple[list[Any], list[dict[str, Any]]]:
        """Runs one round of every replica: the new states and each replica's metrics (placed
        on a mesh: on the host, of the replicas this process owns; None for the others)."""
        new_states, metrics = [], [None] * len(self.replicas)
        owned = set(self.owned())
        for call, (unit, state) in enumerate(zip(self.units, states, strict=True)):
            try:
                state, unit_metrics = self._step(
                    state, self._unit_data(unit), self._unit_values(unit)
                )
            except jax.errors.JaxRuntimeError as error:
                if not is_out_of_memory(error):
                    raise
                raise fed.RoundOutOfMemoryError(self.out_of_memory_message(error)) from None
            new_states.append(state)
            if self.placement is not None:
                rows = self._local_rows(unit_metrics)
                for position, index in enumerate(unit):
                    if index in owned and self.placement.positions[index] == (call, position):
                        metrics[index] = rows[position]
                continue
            for position, index in enumerate(unit):
                if metrics[index] is None:
                    metrics[index] = (
                        unit_metrics
                        if self.strategy == "sequential"
                        else jax.tree.map(lambda x, p=position: x[p], unit_metrics)
                    )
        return new_states, metrics

    def evaluators(self) -> list[Any]:
        """Per replica ``evaluate(params, model_state)`` on its test split (one compiled
        evaluation when every replica has the same test split)."""
        if self._test_shared:
            evaluate = builders.make_eval_fn(self.replicas[0].experiment)
            return [evaluate] * len(self.replicas)
        return [builders.make_eval_fn(r.experiment) for r in self.replicas]


class _CheckedStep:
    """A placed round, compiled once (all units have one shape) and read for its collectives."""

    def __init__(self, jitted, placement):
        self.jitted, self.placement = jitted, placement
        self.lower = jitted.lower
        self.compiled = None
        self.collectives: list = []
        self.across: list[str] = []

    def compile(self, *arguments) -> None:
        self.compiled = self.jitted.lower(*arguments).compile()
        text = self.compiled.as_text()
        self.collectives = placement_lib.collectives(text)
        self.across = placement_lib.cross_replica_collectives(text, self.placement)

    def __call__(self, *arguments):
        if self.compiled is None:
            self.compile(*arguments)
        return self.compiled(*arguments)


def _tracer_error(error: BaseException | None) -> BaseException | None:
    """The tracer error behind ``error`` (the factories re-raise it as a ValueError), or None."""
    while error is not None:
        if isinstance(error, _TRACER_ERRORS):
            return error
        error = error.__cause__ or error.__context__
    return None


def _constant(value):
    return lambda round_index: value


def _host_stack(trees: list[Any]):
    """``_stack`` on the host (NumPy; keys stay typed keys, stacked on the host too)."""

    def stack(*xs):
        if jax.dtypes.issubdtype(xs[0].dtype, jax.dtypes.prng_key):
            data = np.stack([np.asarray(jax.random.key_data(x)) for x in xs])
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(xs[0]))
        return np.stack([np.asarray(x) for x in xs])

    return jax.tree.map(stack, *trees)


def _gathered(tree):
    """A tree over the placement's mesh on the host of every process (a collective)."""
    from jax.experimental import multihost_utils

    def get(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = get(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)


def _host_row(tree, position: int):
    return jax.tree.map(lambda x: x[position], tree)


def _stack(trees: list[Any]):
    def stack(*xs):
        if jax.dtypes.issubdtype(xs[0].dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(
                jnp.stack([jax.random.key_data(x) for x in xs]), impl=jax.random.key_impl(xs[0])
            )
        return jnp.stack(xs)

    return jax.tree.map(stack, *trees)
