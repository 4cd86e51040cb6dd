"""The loop behind ``python -m experiments.sweep``: R replicas, one run folder each.

``run_sweep(config, grid, workdir)`` runs every replica of ``grid`` for ``fed.rounds`` rounds
(:class:`fedorth.sweep.replicas.ReplicaRound`) and writes, for each, an ordinary run folder
``workdir/<key=value,...>/`` with what ``python -m experiments.main`` writes (its resolved
``config.json``, ``run_info.json``, ``metrics.jsonl``, TensorBoard events, ``curves.png``), so
``python -m experiments.report workdir`` reads a sweep like separate runs. The sweep's own
files sit beside them: ``sweep.json`` (the base config and the grid) and ``checkpoints/``, one
checkpoint of all replicas (their server states stacked). Running the same command again
resumes from it, and ends with the metrics of an uninterrupted sweep.

A replica whose loss or parameters become NaN/Inf stops writing rows; its folder gets
``diverged.json`` (the round and the quantity) and the other replicas go on.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import sys
import time
import types
from typing import Any

import jax
import ml_collections
import numpy as np

from fedorth import fed
from fedorth.sweep.grid import Grid, replica_name
from fedorth.sweep.replicas import ReplicaRound
from fedorth.sweep.strategy import describe_selection
from fedorth.train import loop, plots
from fedorth.train import workdir as workdir_lib
from fedorth.train.checkpoint import Checkpointer
from fedorth.train.logging_utils import MetricsWriter, Progress
from fedorth.train.validate import validate

SWEEP_FILE = "sweep.json"
DIVERGED_FILE = "diverged.json"


def _sweep_identity(config: ml_collections.ConfigDict, grid: Grid) -> str:
    return json.dumps(
        {"config": config.to_dict(), "grid": grid.to_dict()}, indent=2, sort_keys=True, default=str
    )


def _prepare(workdir: pathlib.Path, config, grid: Grid, names: list[str], overwrite: bool):
    """Writes ``sweep.json``; refuses a workdir holding another sweep unless ``overwrite``."""
    identity = _sweep_identity(config, grid)
    path = workdir / SWEEP_FILE
    if path.exists() and path.read_text() != identity:
        if not overwrite:
            raise loop.WorkdirConflictError(
                f"{workdir} holds another sweep (its {SWEEP_FILE} differs: another config or "
                "grid). Use another --workdir (this one keeps that sweep)."
            )
    if overwrite and path.exists() and path.read_text() != identity:
        for child in workdir.iterdir():
            if child.is_dir() and (child.name == "checkpoints" or (child / "config.json").exists()):
                shutil.rmtree(child)
    path.write_text(identity)


def _finite(row: dict[str, Any]) -> str | None:
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            return key
    return None


def _params_finite(params) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(params))


def _add_replica_strategy(path: pathlib.Path, replica_round: ReplicaRound) -> None:
    """``run_info.json`` also says how the replicas ran and, on an accelerator, the timings
    ``--replica_strategy=auto`` chose by (``fedorth.sweep.strategy``)."""
    info = json.loads(path.read_text())
    info["replica_strategy"] = replica_round.strategy
    info["replica_strategy_selection"] = replica_round.replica_selection
    loop._write_atomic(path, json.dumps(info, indent=2))


def run_sweep(
    config: ml_collections.ConfigDict,
    grid: Grid,
    workdir: str | pathlib.Path,
    *,
    replica_strategy: str = "auto",
    replica_chunk_size: int = 0,
    overwrite: bool = False,
    stream=None,
) -> list[dict[str, Any]]:
    """Runs (or resumes) the sweep of ``grid`` over ``config`` in ``workdir``.

    Returns:
      Each replica's last ``metrics.jsonl`` row, in the order of ``grid.replicas()``.
    """
    stream = stream or sys.stderr
    workdir = workdir_lib.resolve(workdir)
    replicas = grid.replicas()
    names = [replica_name(values) for values in replicas]
    configs = [grid.replica_config(values) for values in replicas]
    for replica_config in configs:
        validate(replica_config)  # before anything is loaded or compiled
    lock = workdir_lib.WorkdirLock(workdir)
    try:
        _prepare(workdir, config, grid, names, overwrite)
        folders = [workdir / name for name in names]
        for replica_config, folder in zip(configs, folders, strict=True):
            loop._prepare_workdir(replica_config, folder, overwrite)
        replica_round = ReplicaRound.from_grid(
            grid, strategy=replica_strategy, chunk_size=replica_chunk_size
        )
        described = types.SimpleNamespace(
            strategy=replica_round.client_strategy,
            selection=replica_round.selection,
            devices=replica_round.replicas[0].experiment.round_fn.devices,
        )
        for folder in folders:
            loop._write_run_info(folder, described)
            _add_replica_strategy(folder / "run_info.json", replica_round)
        checkpointer = Checkpointer(workdir, every=int(config.get("checkpoint_every", 0)))
        writers = [MetricsWriter(folder) for folder in folders]
        try:
            return _run(config, replica_round, folders, writers, checkpointer, stream)
        finally:
            for writer in writers:
                writer.close()
            checkpointer.close()
    finally:
        lock.release()


def _run(config, replica_round: ReplicaRound, folders, writers, checkpointer, stream):
    rounds = int(config.fed.rounds)
    eval_every = int(config.get("eval_every", 1))
    count = len(folders)
    states = replica_round.initial_states()
    restored = checkpointer.restore_latest(replica_round.stack(states))
    done = 0
    wall_offset = 0.0
    if restored is not None:
        states = replica_round.unstack(restored)
        done = int(restored.round)
        print(f"Resumed the sweep from round {done} in {checkpointer.workdir}.", file=stream)
    first = replica_round.replicas[0]
    comm = fed.communication_bytes(
        first.experiment.algorithm, replica_round.replica_state(states, 0)
    )
    clients = replica_round.round_config.clients_per_round
    comm_row = {
        "comm_mb_up": comm["bytes_up"] / 1e6,
        "comm_mb_down": comm["bytes_down"] / 1e6,
        "comm_mb_round": (comm["bytes_up"] + comm["bytes_down"]) * clients / 1e6,
    }
    diverged: dict[int, int] = {}
    for index, (folder, writer) in enumerate(zip(folders, writers, strict=True)):
        kept = writer.resume(done if restored is not None else -1, exact=comm_row)
        if kept:
            wall_offset = max(wall_offset, kept[-1]["wall_s"])
        marker = folder / DIVERGED_FILE
        if marker.exists():
            at = json.loads(marker.read_text())["round"]
            if at <= done:
                diverged[index] = at
            else:
                marker.unlink()  # diverged after the checkpoint: the resumed rounds redo it
    evaluators = replica_round.evaluators()
    print(
        f"Sweep of {count} replicas x {rounds} rounds: replicas {replica_round.strategy}"
        + (
            f" (chunks of {replica_round.chunk_size})"
            if replica_round.strategy == "vmap" and replica_round.chunk_size < count
            else ""
        )
        + f", clients {replica_round.client_strategy}.",
        file=stream,
    )
    if replica_round.replica_selection is not None:
        print(describe_selection(replica_round.replica_selection), file=stream)
    progress = Progress(rounds, start=done, stream=stream)
    start = time.perf_counter()

    def evaluate(index: int, state) -> dict[str, float]:
        out = jax.device_get(evaluators[index](state.params, state.model_state))
        return {k: float(v) for k, v in out.items()}

    def mark_diverged(index: int, round_index: int, quantity: str) -> None:
        diverged[index] = round_index
        (folders[index] / DIVERGED_FILE).write_text(
            json.dumps({"round": round_index, "quantity": quantity}) + "\n"
        )
        print(
            f"Replica {folders[index].name} diverged at round {round_index} ({quantity}); the "
            "other replicas go on.",
            file=stream,
        )

    def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
        keys = ("train_loss", "test_loss", "test_accuracy", "test_auc")
        return {
            k: float(np.mean([row[k] for row in rows]))
            for k in keys
            if rows and all(k in row for row in rows)
        }

    if done == 0 and eval_every > 0:
        rows = []
        for index in range(count):
            row = {"round": 0, **evaluate(index, replica_round.replica_state(states, index))}
            row.update(comm_row)
            row["wall_s"] = time.perf_counter() - start
            writers[index].write(row)
            rows.append(row)
        progress.update(0, summary(rows))
    last_rows = [w.rows()[-1] if w.rows() else {} for w in writers]

    def save_curves() -> None:
        for writer, folder in zip(writers, folders, strict=True):
            plots.save_curves(writer.rows(), folder / "curves.png")

    ran = done < rounds
    try:
        while done < rounds:
            states, metrics = replica_round(states)
            done += 1
            is_last = done == rounds
            is_eval = is_last or (eval_every > 0 and done % eval_every == 0)
            rows = []
            for index in range(count):
                if index in diverged:
                    continue
                loss = float(metrics[index]["train_loss"])
                if not math.isfinite(loss):
                    mark_diverged(index, done, f"train_loss is {loss}")
                    continue
                if not is_eval:
                    continue
                state = replica_round.replica_state(states, index)
                if not _params_finite(state.params):
                    mark_diverged(index, done, "the parameters contain NaN/Inf")
                    continue
                row = {"round": done}
                row.update({k: float(v) for k, v in jax.device_get(metrics[index]).items()})
                row.update(evaluate(index, state))
                row.update(comm_row)
                row["wall_s"] = wall_offset + time.perf_counter() - start
                bad = _finite(row)
                if bad is not None:
                    mark_diverged(index, done, f"{bad} is {row[bad]}")
                    continue
                writers[index].write(row)
                last_rows[index] = row
                rows.append(row)
            progress.update(done, summary(rows) if is_eval else None)
            every = checkpointer.every
            if is_last or (every and done % every == 0):
                checkpointer.save(replica_round.stack(states), force=is_last)
                save_curves()
    except KeyboardInterrupt as e:
        checkpointer.manager.wait_until_finished()
        last = checkpointer.manager.latest_step()
        raise loop.RunInterrupted(
            f"interrupted at round {done}; the same command resumes the sweep from round "
            f"{last if last is not None else 0} ({checkpointer.workdir})."
        ) from e
    checkpointer.save(replica_round.stack(states), force=True)
    if not ran:  # a finished sweep started again (the loop draws its last round's curves)
        save_curves()
    return last_rows
