"""The loop behind ``python -m experiments.sweep``: R replicas, one run folder each.

``run_sweep(config, grid, workdir)`` runs every replica of ``grid`` for ``fed.rounds`` rounds
(:class:`fedorth.sweep.replicas.ReplicaRound`) and writes, for each, an ordinary run folder
``workdir/<key=value,...>/`` with what ``python -m experiments.main`` writes (its resolved
``config.json``, ``run_info.json``, ``metrics.jsonl``, TensorBoard events, ``curves.png``), so
``python -m experiments.report workdir`` reads a sweep like separate runs. The sweep's own
files sit beside them: ``checkpoints/``, one checkpoint of all replicas (their server states
stacked), and ``sweep.json``. Running the same command again resumes from it, and ends with the
metrics of an uninterrupted sweep.

**Identity.** Each checkpoint carries the sweep's base config and its grid (its keys in order,
and their values), as a single run's checkpoint carries its config; ``sweep.json`` holds the
same, written atomically, and is read only while no checkpoint exists. A resume maps the saved
replicas to the grid's by their values, never by position, so the order of the ``--sweep.*``
flags does not matter (the saved order of the keys names the folders). A grid with other keys,
another base config (``fed.rounds`` aside, as for a single run) or no replica in common with the
saved one is refused; a value added to a key starts only the new replicas, which catch up from
round 0 to the saved round (the others resume); a replica whose value was removed keeps its
folder as it is, and the sweep says so.

**Folders.** The sweep holds its workdir's lock and each replica folder's
(:mod:`fedorth.train.workdir`) while it runs, so a single run there is refused, naming the
sweep's process and command; a single run in a replica folder of a stopped sweep is refused too
(:func:`fedorth.train.loop.run`): the replica's state lives in the sweep's checkpoint. A replica
folder that holds checkpoints of its own (a single run of it) is refused by the sweep, which
never deletes rows. A replica folder deleted, or rows of it lost, is rebuilt: that replica is
computed again from round 0 (its rounds derive their randomness from its seed and the round), with
a warning line naming it.

**Stopping.** The single run's rules (:mod:`fedorth.train.loop`): Ctrl-C or SIGTERM stops after
the round in progress, saved, and says where the same command resumes; a second one stops at
once, from the newest checkpoint; a full disk ends with one line. A resumed sweep says
"Resumed ...", a finished one "Finished ...".

**Size.** Before any work the sweep says how many replicas it runs, the host memory they need
(one replica built and measured) and how long building them takes, and refuses a grid whose
replicas cannot fit in the available memory or open files (:func:`check_size`).

A replica whose loss or parameters become NaN/Inf stops writing rows; its folder gets
``diverged.json`` (the round and the quantity) and the other replicas go on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import resource
import shutil
import signal
import sys
import time
import types
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedorth.sweep import placement as placement_lib
from fedorth.sweep.grid import Grid, SweepError, replica_name
from fedorth.sweep.replicas import ReplicaRound, _stack
from fedorth.sweep.strategy import describe_selection
from fedorth.train import builders, distributed, loop, plots
from fedorth.train import checkpoint as checkpoint_lib
from fedorth.train import rounds as rounds_lib
from fedorth.train import trackers as trackers_lib
from fedorth.train import workdir as workdir_lib
from fedorth.train.checkpoint import Checkpointer
from fedorth.train.logging_utils import MetricsWriter, Progress, format_duration
from fedorth.train.validate import validate

SWEEP_FILE = "sweep.json"
DIVERGED_FILE = loop.DIVERGED_FILE
LOCK_FILES = 2
"""Open files a replica folder's lock holds (``fedorth.train.workdir.WorkdirLock``)."""
UNITS_KEY = "sweep_units"
"""The key, in the identity a sweep placed on several devices saves with its checkpoints, of
the replica in each slot of each call (``ReplicaRound.units``): the saved arrays' rows."""
GRID_KEY = "sweep_grid"
"""The key of the grid (``[[key, values], ...]``, in order) in a sweep's identity."""


def _json(value: Any) -> Any:
    """JSON types only (a checkpoint's metadata is JSON), as ``config.json`` writes them."""
    return json.loads(json.dumps(value, default=str))


SHARD_KEY = "sweep_shard"
"""The key of a slice's ``[i, n]`` in the identity of one job of ``--sweep.shard=i/n``."""


def shard_folder(index: int, count: int) -> str:
    """The folder, inside the sweep's workdir, of job ``index`` of ``count``'s checkpoints,
    ``sweep.json`` and lock (the replica folders are the workdir's, shared by the jobs)."""
    return f"shard_{index}_of_{count}"


def sweep_identity(config: ml_collections.ConfigDict, grid: Grid) -> dict[str, Any]:
    """What a sweep's checkpoints and ``sweep.json`` carry: the base config and the grid (and
    the slice, for one job of several)."""
    identity = {
        "config": _json(config.to_dict()),
        GRID_KEY: [[key, list(values)] for key, values in grid.values.items()],
    }
    if grid.shard[1] > 1:
        identity[SHARD_KEY] = list(grid.shard)
    return identity


def _replica_key(values: dict[str, Any]) -> tuple:
    """A replica's identity: its values, whatever the order of the keys."""
    return tuple(sorted(values.items()))


def _is_identity(value: Any) -> bool:
    if not isinstance(value, dict) or not isinstance(value.get("config"), dict):
        return False
    grid = value.get(GRID_KEY)
    return isinstance(grid, list) and all(
        isinstance(item, list) and len(item) == 2 and isinstance(item[1], list) for item in grid
    )


def _saved_identity(workdir: pathlib.Path) -> tuple[str, dict[str, Any] | None] | None:
    """The identity of the sweep in ``workdir`` and where it is recorded, or ``None``.

    The newest complete checkpoint's copy comes first (it travels with the states it describes);
    ``sweep.json`` only while there is no checkpoint. ``None`` in place of the dict: the record
    holds no grid (written by an older fedorth) or cannot be read.
    """
    directory = workdir / "checkpoints"
    saved = checkpoint_lib.saved_config(directory)
    if saved is not None:
        step, identity = saved
        return f"checkpoint {step}", identity if _is_identity(identity) else None
    if any(checkpoint_lib._is_complete(d) for d in checkpoint_lib._step_dirs(directory)):
        return "checkpoints", None
    path = workdir / SWEEP_FILE
    if not path.exists():
        return None
    try:
        identity = json.loads(path.read_text())
    except (OSError, ValueError):
        identity = None
    return SWEEP_FILE, identity if _is_identity(identity) else None


def _without_rounds(config: dict) -> dict:
    return {**config, "fed": {k: v for k, v in config.get("fed", {}).items() if k != "rounds"}}


class _Plan:
    """How the grid meets the sweep saved in the workdir: the grid in the saved key order, the
    saved replicas (by identity, at their position in the checkpoint) and those removed."""

    def __init__(self, grid: Grid, saved: dict[str, Any] | None):
        self.grid = grid
        self.saved: dict[tuple, int] = {}
        self.removed: list[str] = []
        self.units = None
        if saved is None:
            return
        keys = [key for key, _ in saved[GRID_KEY]]
        self.grid = grid.reordered(keys)
        old = Grid.__new__(Grid)
        old.values = {key: list(values) for key, values in saved[GRID_KEY]}
        old.shard = grid.shard
        now = {_replica_key(v) for v in self.grid.replicas()}
        for index, values in enumerate(old.replicas()):
            self.saved[_replica_key(values)] = index
            if _replica_key(values) not in now:
                self.removed.append(replica_name(values))
        self.old_count = len(self.saved)
        self.units = saved.get(UNITS_KEY)


def _plan(workdir: pathlib.Path, config, grid: Grid, overwrite: bool) -> _Plan:
    """Compares ``grid`` with the sweep saved in ``workdir``; refuses another sweep in one line
    (or discards it with ``overwrite``)."""
    recorded = _saved_identity(workdir)
    if recorded is None:
        return _Plan(grid, None)
    where, saved = recorded
    reason = None
    if saved is None:
        reason = (
            f"its {where} records no grid this fedorth reads (written by an older version, or "
            "damaged): resume it with the version that wrote it, whose git commit run_info.json "
            "names"
        )
    else:
        old_keys = [key for key, _ in saved[GRID_KEY]]
        diff = loop._config_differences(
            _without_rounds(saved["config"]), _without_rounds(_json(config.to_dict()))
        )
        if diff:
            shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
            reason = f"another base config, recorded in {where}: {shown}"
        elif set(old_keys) != set(grid.values):
            reason = (
                f"another grid, recorded in {where}: keys {old_keys} there, {list(grid.values)} "
                "here"
            )
        elif grid.shard[1] > 1 and {k: sorted(v) for k, v in saved[GRID_KEY]} != {
            k: sorted(v) for k, v in grid.values.items()
        }:
            # Another grid deals the replicas to the jobs anew: a replica could move to a job
            # that holds no state of it, while another job wrote its rows.
            reason = (
                f"another grid, recorded in {where}: {dict(saved[GRID_KEY])} there, "
                f"{grid.to_dict()} here; the jobs of --sweep.shard keep their grid"
            )
        else:
            plan = _Plan(grid, saved)
            if len(plan.removed) == plan.old_count:
                reason = (
                    f"another grid, recorded in {where}: no replica in common "
                    f"({dict(saved[GRID_KEY])} there, {grid.to_dict()} here)"
                )
            else:
                return plan
    if not overwrite:
        raise loop.WorkdirConflictError(
            f"{workdir} holds another sweep ({reason}). Use another --workdir (this one keeps "
            "that sweep)."
        )
    if jax.process_index() == 0:  # the other processes of a multi-process sweep wait for it
        for child in workdir.iterdir():
            if child.is_dir() and (child.name == "checkpoints" or (child / "config.json").exists()):
                shutil.rmtree(child)
        (workdir / SWEEP_FILE).unlink(missing_ok=True)
    return _Plan(grid, None)


# -- the size of a grid -----------------------------------------------------------------------


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _available_memory() -> int | None:
    """Bytes of host memory available to new allocations (Linux's ``MemAvailable``, bounded by a
    cgroup's limit), or None where unknown."""
    available = None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            used = int(pathlib.Path("/sys/fs/cgroup/memory.current").read_text().strip())
            free = int(limit) - used
            available = free if available is None else min(available, free)
    except (OSError, ValueError):
        pass
    return available


def _tree_bytes(tree) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


def check_size(config: ml_collections.ConfigDict, grid: Grid, stream) -> None:
    """Says how many replicas ``grid`` makes, the host memory they need and how long building
    them takes, before any folder is made or any replica built; refuses a grid that cannot fit.

    One replica is built and measured (a second is timed): each replica holds its data (built
    from its seed and ``data.alpha``) and its server state, which a round and a checkpoint copy
    twice more.

    Raises:
      SweepError: the replicas need more memory than is available, or more open files (one
        lock per replica folder) than the process may open.
    """
    count = grid.count
    samples = grid.samples()
    start = time.perf_counter()
    experiment = builders.refuse_stream(builders.build(grid.replica_config(samples[0])))
    server = builders.init_server(experiment)
    build_s = time.perf_counter() - start
    if len(samples) > 1:  # the first build also starts JAX and reads the data: time another
        start = time.perf_counter()
        builders.init_server(builders.build(grid.replica_config(samples[1])))
        build_s = time.perf_counter() - start
    data_bytes = _tree_bytes(experiment.data)
    state_bytes = _tree_bytes(server.replace(key=jax.random.key_data(server.key)))
    per_replica = data_bytes + 3 * state_bytes
    needed = count * per_replica
    available = _available_memory()
    print(
        f"Grid of {count} replicas ({' x '.join(str(len(v)) for v in grid.values.values())} "
        f"values of {', '.join(grid.values)}"
        + (f"; slice {grid.shard[0]} of {grid.shard[1]}" if grid.shard[1] > 1 else "")
        + f"): about {_size(needed)} of host memory "
        f"({_size(per_replica)} per replica: data {_size(data_bytes)}, server state "
        f"{_size(state_bytes)} x 3), "
        + (f"{_size(available)} available; " if available is not None else "")
        + f"building them takes about {format_duration(count * build_s)}; the rounds' time "
        "follows from the first round (the progress line's ETA).",
        file=stream,
        flush=True,
    )
    if available is not None and needed > available:
        fits = max(available // max(per_replica, 1), 1)
        raise SweepError(
            f"the grid of {count} replicas needs about {_size(needed)} of host memory "
            f"({_size(per_replica)} per replica), more than the {_size(available)} available: "
            f"split it into sweeps of at most {fits} replicas (fewer --sweep.* values each, one "
            "--workdir per sweep)."
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Each replica folder's lock holds LOCK_FILES descriptors (the folder and its run.lock); the
    # rest is for the files a run opens.
    wanted = LOCK_FILES * count + 256
    if wanted > soft:
        if hard != resource.RLIM_INFINITY and wanted > hard:
            raise SweepError(
                f"the grid of {count} replicas needs {LOCK_FILES * count} open files for the "
                f"locks of its replica folders, more than this process may open ({hard}, "
                f"ulimit -Hn): split it into sweeps of at most {(hard - 256) // LOCK_FILES} "
                "replicas (one --workdir per sweep)."
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


class _Counter:
    """``Preparing N replica folders: i/N`` about every 10% of a large grid (every replica for a
    small one would say nothing the line after it does not)."""

    def __init__(self, what: str, total: int, stream):
        self.what, self.total, self.stream = what, total, stream
        self.step = max(total // 10, 1) if total >= 100 else 0

    def __call__(self, done: int) -> None:
        if self.step and (done % self.step == 0 or done == self.total):
            print(f"{self.what}: {done}/{self.total}", file=self.stream, flush=True)


# -- the sweep ----------------------------------------------------------------------------------


def _params_finite(params) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(params))


def _add_replica_strategy(path: pathlib.Path, replica_round: ReplicaRound) -> None:
    """``run_info.json`` also says how the replicas ran and, on an accelerator, the timings
    ``--replica_strategy=auto`` chose by (``fedorth.sweep.strategy``); placed on several
    devices, where and the compiled round's collectives (none across replicas)."""
    info = json.loads(path.read_text())
    info["replica_strategy"] = replica_round.strategy
    info["replica_strategy_selection"] = replica_round.replica_selection
    if replica_round.placement is not None:
        info["replica_placement"] = replica_round.placement.describe()
        info["replica_collectives"] = replica_round.collectives()
    loop._write_atomic(path, json.dumps(info, indent=2))


def _own_checkpoints(folder: pathlib.Path) -> None:
    """Refuses a replica folder that holds checkpoints of its own: a single run extended it, and
    the sweep would drop that run's rows past the sweep's round."""
    steps = checkpoint_lib._step_dirs(folder / "checkpoints")
    if steps:
        raise loop.WorkdirConflictError(
            f"{folder} holds checkpoints of a single run (round {steps[0].name}), which the "
            "sweep cannot resume and would cut back to its own round: move that folder out of "
            f"{folder.parent} to keep it as a run of its own (the sweep then computes the replica "
            "again), or use another --workdir."
        )


def run_sweep(
    config: ml_collections.ConfigDict,
    grid: Grid,
    workdir: str | pathlib.Path,
    *,
    replica_strategy: str = "auto",
    replica_chunk_size: int = 0,
    overwrite: bool = False,
    stream=None,
    devices_per_replica: int | None = None,
) -> list[dict[str, Any]]:
    """Runs (or resumes) the sweep of ``grid`` over ``config`` in ``workdir``.

    With ``devices_per_replica`` (a number; 0: one device each) the replicas run on groups of
    that many devices of every process (:mod:`fedorth.sweep.placement`); in a multi-process run
    (``jax.distributed``) every process calls it with the same arguments, the checkpoint is
    written by all of them together, and each replica's folder by the process that owns it.

    Returns:
      Each replica's last ``metrics.jsonl`` row, in the order of ``grid.replicas()`` (the saved
      sweep's key order on a resume).

    Raises:
      SweepError: the grid is invalid or cannot fit.
      RunInterrupted: a signal stopped the sweep (a ``KeyboardInterrupt``).
      One of :data:`fedorth.train.loop.USER_ERRORS`, when the input or the disk is at fault.
    """
    stream = stream or sys.stderr
    if devices_per_replica is None:
        return _run_sweep(
            config, grid, workdir, replica_strategy, replica_chunk_size, overwrite, stream, None
        )
    placement_lib.check_same_in_every_process(
        json.dumps(
            [
                sweep_identity(config, grid),
                replica_strategy,
                replica_chunk_size,
                devices_per_replica,
            ],
            sort_keys=True,
        )
    )
    if jax.process_index() != 0:  # one process says what the sweep does
        stream = open(os.devnull, "w")  # noqa: SIM115 -- for the sweep's whole life
    # A replica's round runs on its group's devices, not over every process's.
    with distributed.rounds_of_replicas():
        return _run_sweep(
            config,
            grid,
            workdir,
            replica_strategy,
            replica_chunk_size,
            overwrite,
            stream,
            devices_per_replica,
        )


def _run_sweep(
    config, grid, workdir, replica_strategy, replica_chunk_size, overwrite, stream, per_replica
):
    workdir = workdir_lib.resolve(workdir)
    for values in grid.samples():  # each key's extremes, before anything is loaded or compiled
        validate(grid.replica_config(values))
    owners = None
    if per_replica is not None:
        owners = placement_lib.place(grid.count, devices_per_replica=per_replica)
    check_size(config, grid, stream)
    # One job of --sweep.shard keeps its state in a folder of its own: the jobs share the
    # workdir and its replica folders (each job holds its replicas' locks), and a second job of
    # the same slice is refused by that folder's lock.
    state = workdir if grid.shard[1] == 1 else workdir / shard_folder(*grid.shard)
    # Several processes: process 0 holds the sweep's lock, each process its replicas' folders'.
    lock = workdir_lib.lock_for_all_processes(state, jax.process_index(), jax.process_count())
    locks: list[workdir_lib.WorkdirLock] = []
    try:
        plan = _plan(state, config, grid, overwrite)
        grid = plan.grid
        _agree("the saved sweep is read")
        if jax.process_index() == 0:
            with loop._disk_space(state / SWEEP_FILE, None, None):
                loop._write_atomic(
                    state / SWEEP_FILE, json.dumps(sweep_identity(config, grid), indent=2)
                )
        replicas = grid.replicas()
        folders = [workdir / replica_name(values) for values in replicas]
        had_rows = [(f / "metrics.jsonl").exists() for f in folders]
        owned = set(range(len(folders)) if owners is None else owners.owned())
        counter = _Counter(f"Preparing {len(folders)} replica folders", len(folders), stream)
        for index, folder in enumerate(folders):
            if index not in owned:
                continue
            locks.append(workdir_lib.WorkdirLock(folder))  # a single run there is refused
            _own_checkpoints(folder)
            with loop._disk_space(folder / "config.json", None, None):
                loop._prepare_workdir(grid.replica_config(replicas[index]), folder, overwrite)
            counter(index + 1)
        if owners is not None:
            _agree("the replica folders are ready")
        if plan.removed:
            print(
                f"Not in the grid any more, kept as they are (the sweep's next checkpoints do not "
                f"hold their states): {', '.join(str(workdir / n) for n in plan.removed)}.",
                file=stream,
            )
        return _run_locked(
            config,
            grid,
            plan,
            state,
            folders,
            had_rows,
            replica_strategy,
            replica_chunk_size,
            stream,
            per_replica,
        )
    finally:
        for replica_lock in locks:
            replica_lock.release()
        if lock is not None:
            lock.release()


def _agree(what: str) -> None:
    """Waits until every process of a multi-process sweep has reached this point."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"fedorth sweep: {what}")


def _run_locked(
    config,
    grid,
    plan,
    workdir,
    folders,
    had_rows,
    replica_strategy,
    chunk_size,
    stream,
    per_replica,
):
    replicas = grid.replicas()
    building = _Counter(f"Building {len(replicas)} replicas", len(replicas), stream)
    replica_round = ReplicaRound.from_grid(
        grid,
        strategy=replica_strategy,
        chunk_size=chunk_size,
        on_build=building,
        devices_per_replica=per_replica,
    )
    owned = set(replica_round.owned())
    devices = replica_round.replicas[0].experiment.round_fn.devices
    if replica_round.placement is not None:
        print(replica_round.placement.describe(), file=stream)
        devices = list(replica_round.placement.mesh.devices.flat)
        replica_round.collectives()  # compiled once here, in every process
    described = types.SimpleNamespace(
        strategy=replica_round.client_strategy,
        selection=replica_round.selection,
        devices=devices,
    )
    for index, folder in enumerate(folders):
        if index not in owned:
            continue
        with loop._disk_space(folder / "run_info.json", None, None):
            loop._write_run_info(folder, described)
            _add_replica_strategy(folder / "run_info.json", replica_round)
    identity = sweep_identity(config, grid)
    if replica_round.placement is not None:  # rows of the saved [calls, slots, ...] arrays
        identity[UNITS_KEY] = replica_round.units
    checkpointer = Checkpointer(
        workdir, every=int(config.get("checkpoint_every", 0)), config=identity
    )
    # Each replica is a run of the trackers, under the sweep's parent run (MLflow).
    parent = None
    if jax.process_index() == 0:
        parent = trackers_lib.make_parent(config, workdir, folders[0].parent)
    sweep_run = trackers_lib.Composite([parent] if parent is not None else [])
    sweep_run.start(config.to_dict(), [])
    writers = []
    for index, (folder, values) in enumerate(zip(folders, replicas, strict=True)):
        if index not in owned:
            writers.append(None)
            continue
        replica_config = grid.replica_config(values)
        writers.append(
            MetricsWriter(
                folder,
                tensorboard="tensorboard" in trackers_lib.names(config),
                trackers=trackers_lib.make(replica_config, folder, parent=parent),
                config=replica_config.to_dict(),
            )
        )
    sweep = _Sweep(config, replica_round, folders, writers, checkpointer, stream)
    signals = loop._Signals(processes=jax.process_count())
    finished = False
    try:
        # A second signal outside the rounds (the restore, a catch-up's start, a save): the
        # same stop at once as within them, naming the checkpoint a rerun resumes from.
        at_once = rounds_lib.stopping_at_once(
            signals,
            lambda signum: loop.stopped_at_once(
                signum, sweep.done, checkpointer, sweep.workdir, "the sweep "
            ),
        )
        with signals, at_once:
            rows = sweep.run(plan, had_rows, signals)
        for writer, folder in zip(writers, folders, strict=True):
            if writer is not None:
                writer.finish(trackers_lib.finished_files(folder))
        finished = True
    finally:
        for writer in writers:
            if writer is not None:
                writer.close()
        sweep_run.close(finished)
        checkpointer.close()
    sweep.summary(rows)
    return rows


class _Sweep:
    """The rounds of a sweep's replicas, written to their folders; saved in one checkpoint."""

    def __init__(self, config, replica_round: ReplicaRound, folders, writers, checkpointer, stream):
        self.config, self.replica_round = config, replica_round
        self.folders, self.writers = folders, writers
        self.checkpointer, self.stream = checkpointer, stream
        self.rounds = int(config.fed.rounds)
        self.eval_every = int(config.get("eval_every", 1))
        self.workdir = checkpointer.workdir
        self.diverged: dict[int, int] = {}
        self.wall_offset = 0.0
        states = replica_round.initial_states()
        self.comm_row = loop.communication_row(
            replica_round.replicas[0].experiment, replica_round._initial[0]
        )
        self.initial = states
        self.done = 0

    # -- resuming ----------------------------------------------------------------------------

    def _restore(self, plan):
        """The saved replicas' states ``{index in the grid: state}`` and their round."""
        if not plan.saved:
            return {}, 0
        rr = self.replica_round
        if rr.placement is not None or plan.units is not None:
            return self._restore_on_host(plan)
        stacked = rr.stack(self.initial)
        positions = np.zeros(plan.old_count, dtype=int)
        like = jax.tree.map(lambda x: x[positions], stacked.replace(round=None))
        restored = self.checkpointer.restore_latest(like.replace(round=stacked.round))
        if restored is None:
            return {}, 0
        found = {}
        for index, values in enumerate(rr.replicas):
            old = plan.saved.get(_replica_key(values.values))
            if old is not None:
                state = jax.tree.map(lambda x, o=old: x[o], restored.replace(round=None))
                found[index] = state.replace(round=restored.round)
        return found, int(restored.round)

    def _restore_on_host(self, plan):
        """``_restore`` of a sweep placed on several devices, or saved by one: every process
        reads the whole checkpoint (orbax's multi-process restore reads the arrays it is given
        the shape of; as host arrays, every row) and picks the grid's replicas' rows."""
        rr = self.replica_round
        units = plan.units or [list(range(plan.old_count))]
        shape = (len(units), len(units[0])) if plan.units else (plan.old_count,)
        first = rr._initial[0]
        impl = jax.random.key_impl(first.key)
        host = first.replace(key=jax.random.key_data(first.key), round=None)
        like = jax.tree.map(lambda x: np.zeros((*shape, *x.shape), x.dtype), host)
        like = like.replace(
            key=jax.random.wrap_key_data(like.key, impl=impl),
            round=np.zeros((), np.asarray(first.round).dtype),
        )
        restored = self.checkpointer.restore_latest(like, on_host=True)
        if restored is None:
            return {}, 0
        flat = restored.replace(round=None)
        if plan.units:
            flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), flat)
        rows = {}
        for position, old in enumerate(r for unit in units for r in unit):
            rows.setdefault(old, position)
        found = {}
        for index, values in enumerate(rr.replicas):
            old = plan.saved.get(_replica_key(values.values))
            if old is not None:
                state = jax.tree.map(lambda x, r=rows[old]: x[r], flat)
                found[index] = state.replace(round=jnp.asarray(restored.round))
        return found, int(restored.round)

    def _expected_rounds(self, done: int) -> set[int]:
        if self.eval_every <= 0:
            return {done} if done >= self.rounds else set()
        rounds = set(range(0, done + 1, self.eval_every))
        return rounds | ({done} if done >= self.rounds else set())

    def run(self, plan, had_rows, signals) -> list[dict[str, Any]]:
        rr, count = self.replica_round, len(self.folders)
        self.done = loop.restored_round(self.checkpointer)  # what a stop at once names meanwhile
        restored, done = self._restore(plan)
        self.done = done  # the round a stop at once names until the rounds run
        again: list[int] = [i for i in range(count) if i not in restored]
        for index in sorted(restored):
            if self.writers[index] is None:  # another process's replica
                continue
            path = self.writers[index].path
            with loop._disk_space(path, None, self.checkpointer):
                kept = self.writers[index].resume(done, exact=self.comm_row)
            if kept:
                self.wall_offset = max(self.wall_offset, kept[-1].get("wall_s", 0.0))
            marker = self.folders[index] / DIVERGED_FILE
            at = json.loads(marker.read_text())["round"] if marker.exists() else None
            if at is not None and at <= done:
                self.diverged[index] = at
                continue
            if at is not None:
                marker.unlink()  # diverged after the checkpoint: the resumed rounds redo it
            lost = sorted(self._expected_rounds(done) - {row["round"] for row in kept})
            if lost:
                again.append(index)
                what = "its folder was deleted" if not had_rows[index] else "its rows were lost"
                logging.warning(
                    "%s: %s (no row of rounds %s); the sweep's checkpoint holds its state at "
                    "round %d but not its rows, so the replica is computed again from round 0.",
                    self.folders[index],
                    what,
                    ", ".join(map(str, lost[:5])) + (" ..." if len(lost) > 5 else ""),
                    done,
                )
        again = _union(again, count)
        if done:
            print(f"Resumed the sweep from round {done} in {self.workdir}.", file=self.stream)
            new = [
                rr.replicas[i].name
                for i in again
                if _replica_key(rr.replicas[i].values) not in plan.saved
            ]
            if new:
                print(
                    f"New in the grid, run from round 0 up to round {done} first: "
                    f"{', '.join(new)}.",
                    file=self.stream,
                )
        for index in again:
            if self.writers[index] is not None:
                (self.folders[index] / DIVERGED_FILE).unlink(missing_ok=True)
            self.diverged.pop(index, None)
        print(
            f"Sweep of {count} replicas x {self.rounds} rounds: replicas {rr.strategy}"
            + (" on each group of devices" if rr.placement is not None else "")
            + (
                f" (chunks of {rr.chunk_size})"
                if rr.strategy == "vmap" and rr.chunk_size < count
                else ""
            )
            + f", clients {rr.client_strategy}.",
            file=self.stream,
        )
        if rr.replica_selection is not None:
            print(describe_selection(rr.replica_selection), file=self.stream)
        states = self.initial
        if done and again:
            states = self._catch_up(states, restored, again, done, signals)
        elif done:
            states = rr.unstack(_stack_states([restored[i] for i in range(count)]))
        else:
            for writer in self.writers:
                if writer is None:
                    continue
                with loop._disk_space(writer.path, None, self.checkpointer):
                    writer.resume(-1)
        if done and (again or plan.removed):
            # The saved step holds the old grid's replicas: it is replaced by the new grid's (a
            # kill in between falls back to an older step, or starts the sweep over).
            if done in self.checkpointer.manager.all_steps():
                self.checkpointer.manager.delete(done)
            step_path = self.checkpointer.directory / str(done)
            with loop._disk_space(step_path, None, self.checkpointer):
                self.checkpointer.save(rr.stack(states), force=True)
        ran = done < self.rounds
        states, done, last = self._train(rr, states, done, list(range(count)), signals, save=True)
        self.done = done
        with loop._disk_space(self.checkpointer.directory / str(done), None, self.checkpointer):
            self.checkpointer.save(rr.stack(states), force=True)
        if not ran:  # a finished sweep started again (the loop draws its last round's curves)
            self._save_curves(range(count))
        rows = {
            i: last[i] if last[i] else (self.writers[i].rows() or [{}])[-1]
            for i in range(count)
            if self.writers[i] is not None
        }
        return _gather_rows(rows, count)

    def _catch_up(self, states, restored, again, done, signals):
        """Runs the replicas in ``again`` (new in the grid, or whose rows were lost) from round 0
        to round ``done``, then joins them to the restored ones."""
        rr = self.replica_round
        placed = {}
        if rr.placement is not None:  # each replica on its group: its owner writes its rows
            placed = dict(
                devices_per_replica=rr.devices_per_replica,
                assignment=[rr.placement.assignment[i] for i in again],
            )
        sub = ReplicaRound(
            [rr.replicas[i].config for i in again],
            [rr.replicas[i].values for i in again],
            rr.traced_keys,
            [rr.replicas[i].name for i in again],
            strategy=rr.strategy,
            chunk_size=rr.chunk_size if rr.strategy == "vmap" else 0,
            **placed,
        )
        for index in again:
            if self.writers[index] is None:
                continue
            with loop._disk_space(self.writers[index].path, None, self.checkpointer):
                self.writers[index].resume(-1)
        sub_states, _, _ = self._train(
            sub, sub.initial_states(), 0, again, signals, save=False, stop=done
        )
        per_replica = dict(restored)
        for position, index in enumerate(again):
            per_replica[index] = sub.replica_state(
                sub_states, position, everywhere=sub.placement is not None
            )
        return rr.unstack(_stack_states([per_replica[i] for i in range(len(self.folders))]))

    # -- the rounds --------------------------------------------------------------------------

    def _train(self, rr, states, done, indices, signals, *, save: bool, stop: int | None = None):
        """Rounds ``done + 1 .. stop`` (default ``fed.rounds``) of ``rr``, whose replica ``k`` is
        the sweep's replica ``indices[k]``; with ``save``, checkpoints of the whole sweep."""
        rounds = _SweepRounds(self, rr, states, indices, save=save, stop=stop)
        rounds.progress = Progress(self.rounds, start=done, stream=self.stream)
        done = rounds_lib.run_rounds(rounds, signals, done, stop)
        return rounds.states, done, [rounds.last.get(i) for i in range(len(self.folders))]

    def _mark_diverged(self, index: int, round_index: int, quantity: str) -> None:
        self.diverged[index] = round_index
        (self.folders[index] / DIVERGED_FILE).write_text(
            json.dumps({"round": round_index, "quantity": quantity}) + "\n"
        )
        print(
            f"Replica {self.folders[index].name} diverged at round {round_index} ({quantity}); "
            "the other replicas go on.",
            file=self.stream,
        )

    def _save_curves(self, indices) -> None:
        for index in indices:
            if self.writers[index] is None:
                continue
            folder = self.folders[index]
            with loop._disk_space(folder / "curves.png", None, self.checkpointer):
                plots.save_curves(self.writers[index].rows(), folder / "curves.png")

    def summary(self, rows: list[dict[str, Any]]) -> None:
        """One line at the end of a finished sweep: the best replica and where the files are."""
        score = "test_auc" if any("test_auc" in row for row in rows) else "test_accuracy"
        scored = [(row[score], i) for i, row in enumerate(rows) if score in row]
        best = ""
        if scored:
            value, index = max(scored)
            best = f"; best {score} {value:.4f} ({self.folders[index].name})"
        diverged = f", {len(self.diverged)} diverged" if self.diverged else ""
        step = self.checkpointer.manager.latest_step()
        workdir = self.folders[0].parent
        print(
            f"Finished the sweep at round {self.done}: {len(rows)} replicas{diverged}{best}. "
            f"Metrics in {workdir}/<replica>/metrics.jsonl, checkpoint "
            f"{self.checkpointer.directory / str(step)}.",
            file=self.stream,
        )


class _SweepRounds(rounds_lib.Rounds):
    """A sweep's rounds (:func:`fedorth.train.rounds.run_rounds`): one state per replica; a
    replica whose loss, parameters or row is not finite is marked diverged, and the others go
    on."""

    def __init__(self, sweep: _Sweep, rr: ReplicaRound, states, indices, *, save, stop):
        self.sweep, self.replica_round, self.states, self.indices = sweep, rr, states, indices
        self.rounds, self.eval_every = sweep.rounds, sweep.eval_every
        self.checkpoint_every = sweep.checkpointer.every
        self.saves, self.stop = save, sweep.rounds if stop is None else stop
        self.evaluators = rr.evaluators()
        self.owned = set(rr.owned())  # positions in rr of the replicas this process writes
        self.start = time.perf_counter()
        self.last: dict[int, dict[str, Any]] = {}
        self.checked = 0

    def _live(self):
        """``(k, index)`` of the replicas this process writes that have not diverged."""
        for k, index in enumerate(self.indices):
            if index not in self.sweep.diverged and k in self.owned:
                yield k, index

    def _evaluation(self, k: int, state) -> dict[str, float]:
        out = jax.device_get(self.evaluators[k](state.params, state.model_state))
        return {key: float(v) for key, v in out.items()}

    def _write(self, index: int, row: dict[str, Any]) -> None:
        writer = self.sweep.writers[index]
        with loop._disk_space(writer.path, len(json.dumps(row)) + 1, self.sweep.checkpointer):
            writer.write(row)
        self.last[index] = row

    def initial(self) -> None:
        rows = []
        for k, index in self._live():
            state = self.replica_round.replica_state(self.states, k)
            row = {"round": 0, **self._evaluation(k, state), **self.sweep.comm_row}
            row["wall_s"] = time.perf_counter() - self.start
            self._write(index, row)
            rows.append(row)
        self.progress.update(0, _mean(rows))

    def round(self, done: int) -> Any:
        self.states, metrics = self.replica_round(self.states)
        return metrics

    def check(self, round_index: int, metrics: Any, *, full_state: bool) -> None:
        if self.checked == round_index:  # the loss is read once a round
            return
        self.checked = round_index
        for k, index in list(self._live()):
            loss = float(metrics[k]["train_loss"])
            if not math.isfinite(loss):
                self.sweep._mark_diverged(index, round_index, f"train_loss is {loss}")

    def evaluate(self, round_index: int, metrics: Any) -> None:
        rows = []
        for k, index in list(self._live()):
            replica = self.replica_round.replicas[k]
            state = self.replica_round.replica_state(self.states, k)
            if not _params_finite(state.params):
                self.sweep._mark_diverged(index, round_index, "the parameters contain NaN/Inf")
                continue
            row = rounds_lib.evaluated_row(
                replica.config,
                round_index,
                jax.device_get(metrics[k]),
                self._evaluation(k, state),
                self.sweep.comm_row,
                self.sweep.wall_offset + time.perf_counter() - self.start,
                jax.device_get(state.params)
                if replica.config.get("log_condition_number")
                else None,
            )
            bad = rounds_lib.non_finite(row)
            if bad is not None:
                self.sweep._mark_diverged(index, round_index, f"{bad} is {row[bad]}")
                continue
            self._write(index, row)
            rows.append(row)
        self.progress.update(round_index, _mean(rows))

    def save(self, round_index: int) -> None:
        checkpointer = self.sweep.checkpointer
        with loop._disk_space(checkpointer.directory / str(round_index), None, checkpointer):
            checkpointer.save(self.replica_round.stack(self.states), force=True)
        self.sweep._save_curves(self.indices)

    def stopped(self, signum: int, round_index: int) -> loop.RunInterrupted:
        if self.saves:
            return loop.stopped(signum, round_index, self.sweep.workdir, "the sweep ")
        return loop.RunInterrupted(
            f"interrupted ({signal.Signals(signum).name}) at round {round_index} of the replicas "
            f"computed from round 0; the same command resumes the sweep from round {self.stop} "
            f"and computes them again ({self.sweep.workdir}).",
            signum,
        )

    def stopped_at_once(self, signum: int | None, done: int) -> loop.RunInterrupted:
        return loop.stopped_at_once(
            signum, done, self.sweep.checkpointer, self.sweep.workdir, "the sweep "
        )

    def out_of_memory(self, error: BaseException) -> str:
        return self.replica_round.out_of_memory_message(error)


def _union(indices: list[int], count: int) -> list[int]:
    """``indices`` of every process of a multi-process sweep together, sorted (a collective)."""
    if jax.process_count() == 1:
        return sorted(indices)
    from jax.experimental import multihost_utils

    mask = np.zeros(count, np.int32)
    mask[indices] = 1
    gathered = np.asarray(multihost_utils.process_allgather(mask)).reshape(-1, count)
    return [int(i) for i in np.flatnonzero(gathered.max(axis=0))]


def _gather_rows(rows: dict[int, dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Each replica's row, in every process of a multi-process sweep (each holds the rows of
    its own replicas; a collective)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        text = np.frombuffer(json.dumps(rows).encode(), np.uint8)
        size = int(np.max(multihost_utils.process_allgather(np.int32(text.size))))
        padded = np.zeros(size, np.uint8)
        padded[: text.size] = text
        gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, size)
        rows = {}
        for part in gathered:
            rows.update(
                {int(i): row for i, row in json.loads(part.tobytes().rstrip(b"\0")).items()}
            )
    return [rows.get(i, {}) for i in range(count)]


def _mean(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The progress line's means over the replicas (of every process of a multi-process sweep:
    a collective, at the same rounds in every process)."""
    keys = ("train_loss", "test_loss", "test_accuracy", "test_auc")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        sums = np.array(
            [[sum(row[k] for row in rows if k in row), sum(k in row for row in rows)] for k in keys]
            + [[0.0, len(rows)]]
        )
        total = np.asarray(multihost_utils.process_allgather(sums)).reshape(-1, len(keys) + 1, 2)
        total = total.sum(axis=0)
        count = total[-1, 1]
        return {
            k: float(total[i, 0] / count)
            for i, k in enumerate(keys)
            if count and total[i, 1] == count
        }
    return {
        k: float(np.mean([row[k] for row in rows]))
        for k in keys
        if rows and all(k in row for row in rows)
    }


def _stack_states(per_replica: list[Any]):
    """One ``[R, ...]`` state (round a scalar) of per-replica states, as ``ReplicaRound.stack``."""
    rounds = per_replica[0].round
    return _stack([s.replace(round=rounds) for s in per_replica]).replace(round=rounds)
