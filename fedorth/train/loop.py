"""The training loop behind ``python -m experiments.main``.

``run(config, workdir)`` builds the experiment, resumes from the newest complete checkpoint in
``workdir`` if there is one, runs the remaining rounds (one compiled call each), evaluates every
``eval_every`` rounds, and writes ``config.json``, ``run_info.json``, ``metrics.jsonl``,
checkpoints and ``curves.png``. Running the same command again after a crash resumes, and ends
with the same metrics as an uninterrupted run (rounds derive all randomness from config.seed and the
round index).

Live outputs: ``metrics.jsonl`` starts with a round-0 row (the initial model's evaluation; no
``train_loss``, no local step ran), ``curves.png`` is redrawn at every evaluation, TensorBoard
event files (tensorboardX) go to ``tensorboard/``, and the progress line shows the rate of the
recent rounds (the first, compiling, round excluded) and an ETA. A finished run ends with one line:
its last metrics and where its files are. The rounds run in
:func:`fedorth.train.rounds.run_rounds`, the loop a sweep's replicas run in too
(:class:`_RunRounds` is what a single run gives it).

Stopping: Ctrl-C (SIGINT) or SIGTERM stops the run after the round in progress, saved: "interrupted
(SIGTERM) at round r; the same command resumes from round r" (:class:`RunInterrupted`); a second
one stops it at once ("interrupted at round r; the same command resumes from round c", the newest
checkpoint); one that comes during the last round lets the run finish.

Safety of the outputs: one run at a time per workdir (:mod:`fedorth.train.workdir`); each
checkpoint carries the config of its run, which a rerun must match (as ``config.json``);
``metrics.jsonl`` keeps every readable row, and TensorBoard's events are rewritten from it at each
start (:class:`~fedorth.train.logging_utils.MetricsWriter`); a full disk ends with one line naming
the file, the space and the last intact checkpoint (:class:`DiskFullError`).

``fed.rounds`` is not part of a run's identity: the same config with more rounds continues a
finished run (fewer stops early), unless the learning-rate schedule decays over ``fed.rounds``
(``cosine``, ``warmup_cosine``), which is refused, since its rounds so far followed another
schedule (:data:`ROUNDS_FREE_SCHEDULES`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import fedorth
from fedorth import fed
from fedorth.data import DatasetNotPreparedError
from fedorth.fed import client_store
from fedorth.train import builders, plots
from fedorth.train import checkpoint as checkpoint_lib
from fedorth.train import feed as feed_lib
from fedorth.train import rounds as rounds_lib
from fedorth.train import trackers as trackers_lib
from fedorth.train import workdir as workdir_lib
from fedorth.train.checkpoint import Checkpointer, CheckpointError
from fedorth.train.logging_utils import MetricsWriter, Progress
from fedorth.train.rounds import RunInterrupted
from fedorth.train.validate import ConfigError, validate
from fedorth.train.workdir import DiskFullError, WorkdirError, WorkdirLockedError


class DivergenceError(FloatingPointError):
    """The training loss or the parameters became NaN/Inf."""


class WorkdirConflictError(RuntimeError):
    """The workdir holds a run of a different config."""


class RoundPlacementError(RuntimeError):
    """A multi-process run's round compiled for fewer devices than its processes hold."""


ROUNDS_FREE_SCHEDULES = ("constant", "step")
"""``optim.schedule`` values that do not depend on ``fed.rounds`` (``step`` decays at the
absolute rounds ``optim.step_rounds``): a finished run with one of them can be extended by
raising ``fed.rounds``. ``cosine`` and ``warmup_cosine`` decay over ``fed.rounds``, so a run
cannot change its length (refused, naming the schedule)."""


USER_ERRORS = (
    ConfigError,
    DatasetNotPreparedError,
    WorkdirConflictError,
    WorkdirError,
    WorkdirLockedError,
    DiskFullError,
    DivergenceError,
    CheckpointError,
    fed.RoundOutOfMemoryError,
    client_store.ClientStoreError,
    trackers_lib.TrackerError,
    RoundPlacementError,
    feed_lib.StreamReadError,
)
"""Errors caused by the input, not by fedorth: the CLI prints their message without a traceback."""


def _project_checkout() -> pathlib.Path | None:
    """The top of the git checkout that holds this fedorth package, or None.

    None when the package is not in a checkout, or when the enclosing checkout is another
    project's (e.g. fedorth unpacked or installed inside someone's repository): its commit
    would say nothing about the code that ran. The project's checkout is recognised by its
    ``setup.cfg`` naming the ``fedorth`` distribution.
    """
    package = pathlib.Path(fedorth.__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(package), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    top = pathlib.Path(out.stdout.strip()).resolve()
    if package.parent != top:
        return None  # the package sits deeper in some other repository
    try:
        setup = (top / "setup.cfg").read_text()
    except OSError:
        return None
    if not re.search(r"(?m)^name\s*=\s*fedorth\s*$", setup):
        return None
    return top


def _git(*args: str) -> subprocess.CompletedProcess | None:
    """``git -C <project checkout> args``, or None outside the project's own checkout."""
    top = _project_checkout()
    if top is None:
        return None
    try:
        return subprocess.run(
            ["git", "-C", str(top), *args],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str | None:
    """The project's own HEAD commit, or None when fedorth does not run from its checkout."""
    out = _git("rev-parse", "HEAD")
    if out is None or out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _git_dirty() -> bool | None:
    """Whether tracked files differ from ``git_commit`` (then the commit alone does not
    reproduce the run); None outside the project's checkout."""
    out = _git("status", "--porcelain", "--untracked-files=no")
    if out is None or out.returncode != 0:
        return None
    return bool(out.stdout.strip())


_write_atomic = workdir_lib.write_atomic  # never through a symbolic link


# Keys configs/base.py gained after runs were recorded, with their defaults. Each default runs
# what a run ran before its key existed (uniform weights, no privacy, the states on the device
# or wherever they fit, bit for bit), so a recorded config without the key is compared as if it
# held the default: such a run resumes, and a value other than the default is a difference.
ADDED_KEYS: dict[str, Any] = {
    "data.prefetch": True,
    "data.stream": "auto",
    "dp.accountant": "rdp",
    "dp.adaptive_quantile": None,
    "dp.clip_learning_rate": 0.2,
    "dp.clip_norm": None,
    "dp.count_noise_multiplier": None,
    "dp.delta": 1e-05,
    "dp.noise_multiplier": 1.0,
    "dp.sampling": "fixed",
    "dp.sampling_rate": None,
    "dp.target_epsilon": None,
    "eval_per_client": False,
    "fed.aggregation": "uniform",
    "fed.client_state": "auto",
    "fed.client_state_dir": "",
}
_ABSENT = "<absent>"


def _config_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """What differs between two configs, one line per key; where the outputs are tracked
    (``trackers_lib.OUTPUT_KEYS``) is not part of a run, so a run can resume with others, and a
    key of :data:`ADDED_KEYS` missing from ``old`` counts as its default."""
    out = []
    for key in sorted(set(old) | set(new)):
        if not prefix and key in trackers_lib.OUTPUT_KEYS:
            continue
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a == _ABSENT and isinstance(b, dict) and f"{prefix}{key}." in _ADDED_SECTIONS:
            a = {}  # a section added since: each of its keys is compared with its default
        if a == _ABSENT and f"{prefix}{key}" in ADDED_KEYS:
            a = ADDED_KEYS[f"{prefix}{key}"]
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} there, {b!r} here")
    return out


_ADDED_SECTIONS = {key.rpartition(".")[0] + "." for key in ADDED_KEYS if "." in key}


def _has_results(workdir: pathlib.Path) -> bool:
    """Whether ``workdir`` holds anything of a run (a run that failed before its first
    checkpoint or metrics row, e.g. on missing data, leaves nothing to protect)."""
    checkpoints = workdir / "checkpoints"
    metrics = workdir / "metrics.jsonl"
    return (checkpoints.is_dir() and any(checkpoints.iterdir())) or (
        metrics.exists() and metrics.stat().st_size > 0
    )


def _recorded_config(workdir: pathlib.Path) -> tuple[str, dict | None] | None:
    """The config of the run in ``workdir`` and where it is recorded, or ``None``.

    The newest complete checkpoint's copy comes first: it travels with the state it describes
    (``config.json`` can be deleted, or left by another run). ``config.json`` is used for runs
    without such a checkpoint; ``None`` in place of the dict: it is not valid JSON.
    """
    saved = checkpoint_lib.saved_config(workdir / "checkpoints")
    if saved is not None:
        step, recorded = saved
        return f"checkpoint {step}", recorded
    path = workdir / "config.json"
    if not path.exists():
        return None
    try:
        return "config.json", json.loads(path.read_text())
    except (ValueError, OSError):
        return "config.json", None


def _same_json(path: pathlib.Path, value: dict) -> bool:
    try:
        return json.loads(path.read_text()) == value
    except (ValueError, OSError):
        return False


def _prepare_workdir(
    config: ml_collections.ConfigDict, workdir: pathlib.Path, overwrite: bool
) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    config_json = json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)
    path = workdir / "config.json"
    recorded = _recorded_config(workdir) if _has_results(workdir) else None
    if recorded is not None:
        where, old = recorded
        if old is None:
            diff = [f"{path} is not valid JSON"]
        else:
            diff = _config_differences(old, json.loads(config_json))
        # The checkpoint's copy is named when config.json does not say the same.
        said = f"recorded in {where}: "
        if where == "config.json" or (path.exists() and _same_json(path, old)):
            said = ""
        if not overwrite and diff and all(d.startswith("fed.rounds:") for d in diff):
            # fed.rounds is not part of a run's identity: more rounds continue it, unless the
            # learning-rate schedule is a function of fed.rounds (then the rounds already run
            # followed another schedule than a run of the new length would).
            schedule = config.optim.get("schedule", "constant")
            if schedule not in ROUNDS_FREE_SCHEDULES:
                raise WorkdirConflictError(
                    f"{workdir} holds a run with another fed.rounds ({said}{diff[0]}), and "
                    f"optim.schedule={schedule!r} decays over fed.rounds: its rounds so far "
                    "followed the schedule of the old length, so continuing would match neither "
                    "run. Use another --workdir (this one keeps that run; a constant or 'step' "
                    f"schedule can be extended: {ROUNDS_FREE_SCHEDULES})."
                )
            _write_atomic(path, config_json)
            return
        if diff and not overwrite:
            shown = "; ".join(diff[:5]) + (f"; and {len(diff) - 5} more" if len(diff) > 5 else "")
            raise WorkdirConflictError(
                f"{workdir} holds a run of a different config ({said}{shown}). Use another "
                "--workdir (this one keeps that run)."
            )
        if diff:
            for name in (
                "checkpoints",
                "checkpoints_unreadable",
                "metrics.jsonl",
                "curves.png",
                "tensorboard",
            ):
                target = workdir / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
    _write_atomic(path, config_json)


def _write_run_info(workdir: pathlib.Path, round_fn: fed.RoundFn | fed.MeasuredRoundFn) -> None:
    """``run_info.json``: versions, commit, devices, and how the rounds run: the strategy
    ``fed.strategy="auto"`` chose (``fed.resolve_strategy``, or on one accelerator the timings
    it chose by, ``strategy_selection``) and the devices a round uses."""
    info = {
        "fedorth_version": fedorth.__version__,
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "strategy": round_fn.strategy,
        "strategy_selection": round_fn.selection,
        "round_devices": [str(d) for d in round_fn.devices],
    }
    _write_atomic(workdir / "run_info.json", json.dumps(info, indent=2))


@jax.jit
def _finite_leaves(tree) -> Any:
    """Per leaf: ``True`` unless it is floating point and holds a NaN or Inf."""

    def finite(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.all(jnp.isfinite(x))
        return jnp.asarray(True)

    return jax.tree.map(finite, tree)


def to_host(tree) -> Any:
    """``jax.device_get`` that every process of a multi-process run can call: an array on
    devices of other processes is read from this process's copy when it is replicated, and
    gathered from all processes otherwise (a collective: every process reads it at the same
    point of the loop). Python and NumPy values pass through."""

    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return jax.device_get(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(x, tiled=True)

    return jax.tree.map(get, tree)


def check_round_spans_processes(round_fn, server, data) -> None:
    """Raises :class:`RoundPlacementError` unless the compiled round reads and writes on every
    device of every process of a multi-process run (``jax.devices()``).

    A round on fewer devices is a program of some processes only: they run it alone, and the
    others fail at their first read of the state it returns, which lies on devices they cannot
    address. The compiled program's shardings are what run, whatever the config asked for.
    """
    if jax.process_count() == 1:
        return
    compiled = round_fn.lower(server, data).compile()
    used = {
        device
        for sharding in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
        for device in sharding.device_set
    }
    if used != set(jax.devices()):
        holders = sorted({d.process_index for d in used})
        raise RoundPlacementError(
            f"The round is compiled for {len(used)} of the {len(jax.devices())} devices of the "
            f"run's {jax.process_count()} processes (on processes {holders}): a "
            "multi-process round must span every process's devices, or the processes left out "
            "cannot read the state it returns; give fedorth.fed.RoundConfig a mesh of all "
            "jax.devices(), or none (fedorth.train.distributed.round_mesh)."
        )


def _first_non_finite(tree, name: str, *, on_host: bool = False) -> str | None:
    """The first leaf of ``tree`` holding a NaN or Inf, named from ``name``, or None.
    ``on_host``: checked by NumPy on a host copy (a check of the whole state, before a save:
    the save copies it to the host anyway, and no second program compiles for its tree)."""
    if on_host:
        flags = jax.tree.map(
            lambda x: not np.issubdtype(x.dtype, np.inexact) or bool(np.isfinite(x).all()),
            to_host(tree),
        )
    else:
        flags = to_host(_finite_leaves(tree))
    for path, ok in jax.tree_util.tree_leaves_with_path(flags):
        if not ok:
            return f"{name}{jax.tree_util.keystr(path)}"
    return None


def _check_finite(
    round_index: int,
    metrics: dict[str, Any],
    server: fed.ServerState,
    *,
    full_state: bool,
    checkpointer: Checkpointer,
) -> None:
    """Raises :class:`DivergenceError` if the round's loss or the new state is not finite.

    The loss and the parameters are checked every round; the whole server state (optimizer
    state, control variates, ...) before it is saved, so a checkpoint never holds NaN/Inf.
    """
    loss = float(to_host(metrics["train_loss"]))
    if not math.isfinite(loss):
        quantity = f"the mean local training loss (train_loss) is {loss}"
    else:
        leaf = _first_non_finite(server.params, "params")
        if leaf is None and full_state:
            state = server.replace(key=jax.random.key_data(server.key))
            leaf = _first_non_finite(state, "server", on_host=True)
        if leaf is None and full_state and checkpointer.states is not None:
            checkpointer.states.wait()  # the store checks the rows it writes
            leaf = checkpointer.states.store.non_finite
        quantity = None if leaf is None else f"{leaf} contains NaN/Inf"
    if quantity is None:
        return
    last = checkpointer.manager.latest_step()
    kept = (
        f"the last good checkpoint is round {last} in {checkpointer.directory}"
        if last is not None
        else "no checkpoint was saved before it"
    )
    raise _diverged(
        round_index,
        quantity,
        f"Diverged at round {round_index}: {quantity}. Nothing of round {round_index} was "
        f"written or saved; {kept}. Lower optim.learning_rate or add clipping, and use a new "
        "--workdir (this one keeps the rounds before the divergence).",
    )


DIVERGED_FILE = "diverged.json"


def _diverged(round_index: int, quantity: str, message: str) -> DivergenceError:
    """A :class:`DivergenceError` that also carries the round and the quantity, which
    :func:`run` writes to the run folder's ``diverged.json`` (as a sweep's diverged replica
    has), so that ``experiments.report`` calls the run diverged."""
    error = DivergenceError(message)
    error.round_index, error.quantity = round_index, quantity
    return error


def _mark_diverged(workdir: pathlib.Path, error: DivergenceError) -> None:
    if jax.process_index() != 0 or not hasattr(error, "round_index"):
        return
    marker = {"round": error.round_index, "quantity": error.quantity}
    try:
        _write_atomic(workdir / DIVERGED_FILE, json.dumps(marker) + "\n")
    except OSError:  # the divergence is the message; a full disk must not hide it
        pass


def run(
    config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *, overwrite: bool = False
) -> dict[str, Any]:
    """Runs (or resumes) the experiment described by ``config`` in ``workdir``.

    ``workdir`` may start with ``~``; it is locked for the run (one writer per workdir,
    :mod:`fedorth.train.workdir`). Ctrl-C (SIGINT) or SIGTERM during the rounds stops the run
    after the round in progress, saved; a second one stops it at once (from the newest
    checkpoint). A finished run ends with one line: its last metrics and where its files are.

    Returns:
      The last row written to ``metrics.jsonl``.

    Raises:
      RunInterrupted: a signal stopped the run (a ``KeyboardInterrupt``).
      One of :data:`USER_ERRORS`, when the input or the disk is at fault.
    """
    validate(config)  # before anything is loaded or compiled
    workdir = workdir_lib.resolve(workdir)
    lock = workdir_lib.lock_for_all_processes(workdir, jax.process_index(), jax.process_count())
    try:
        row = _run_locked(config, workdir, overwrite)
    except DivergenceError as error:
        _mark_diverged(workdir, error)
        raise
    finally:
        if lock is not None:
            lock.release()
    if jax.process_index() == 0:  # finished: a divergence of an earlier try no longer holds
        (workdir / DIVERGED_FILE).unlink(missing_ok=True)
    return row


def _refuse_replica_folder(workdir: pathlib.Path) -> None:
    """Refuses a replica folder of a sweep (``fedorth.sweep.runner``): the replica's state is in
    the sweep's checkpoint, which a single run cannot resume, so a single run would start it over
    and cut the sweep's rows."""
    parent = workdir.absolute().parent
    # A sweep's state is in its workdir, or, for the jobs of --sweep.shard, in a folder per job.
    for state in [parent, *sorted(parent.glob("shard_*_of_*"))]:
        saved = checkpoint_lib.saved_config(state / "checkpoints")
        identity = saved[1] if saved is not None else None
        if identity is None or "sweep_grid" not in identity:
            try:
                identity = json.loads((state / "sweep.json").read_text())
            except (OSError, ValueError):
                continue
        grid = identity.get("sweep_grid") if isinstance(identity, dict) else None
        if isinstance(grid, list):
            break
    else:
        return
    from fedorth.sweep.grid import replica_name  # the sweep's package imports this module

    keys = [key for key, _ in grid]
    names = (
        replica_name(dict(zip(keys, combo, strict=True)))
        for combo in itertools.product(*(values for _, values in grid))
    )
    if workdir.name in names:
        raise WorkdirConflictError(
            f"{workdir} is a replica folder of the sweep in {parent}, whose checkpoint holds "
            "the replica's state: extend the sweep by rerunning its command with a larger "
            "--config.fed.rounds, or give the single run another --workdir."
        )


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers send before killing a job) outside the rounds: handled as
    Ctrl-C; during the rounds the loop saves the round in progress first (:class:`_Signals`)."""

    signum = signal.SIGTERM


def _terminate(signum, frame):
    raise Terminated


def stop_on_sigterm() -> None:
    """Makes SIGTERM stop the process as Ctrl-C does (``Terminated``), for a command's whole
    life; the rounds replace it with their own handler while they run."""
    signal.signal(signal.SIGTERM, _terminate)


def _run_locked(config, workdir: pathlib.Path, overwrite: bool) -> dict[str, Any]:
    if jax.process_index() == 0:
        _refuse_replica_folder(workdir)
    # Several processes (jax.distributed) share the checkpoints; process 0 writes the run's files
    # in workdir and process i > 0 its own copy in workdir/process_i (writers of one file race).
    files = workdir if jax.process_index() == 0 else workdir / f"process_{jax.process_index()}"
    workdir_lib.refuse_links(files)  # a received folder's links are data, not places to write
    with _disk_space(files / "config.json", None, None):
        _prepare_workdir(config, files, overwrite)
    # Refuses a file in the place of tensorboard/ at once; the trackers' store is reached here,
    # before anything trains. One process reports to them.
    writer = MetricsWriter(
        files,
        tensorboard="tensorboard" in trackers_lib.names(config),
        trackers=trackers_lib.make(config, files) if jax.process_index() == 0 else None,
        config=config.to_dict(),
    )
    experiment = builders.with_client_store(builders.build(config), files)
    server = builders.init_server(experiment)
    feed = builders.round_feed(experiment)
    try:
        return _run_feed(config, workdir, files, experiment, server, writer, feed)
    finally:
        feed.close()  # a streamed run's prefetch thread and file


def _run_feed(config, workdir, files, experiment, server, writer, feed) -> dict[str, Any]:
    # fed.strategy="auto" on one accelerator times a round of each candidate here, on copies of
    # the server state (fed.MeasuredRoundFn); elsewhere the strategy is already fixed.
    first = feed.read(0)  # a streamed run's round shape: every round's
    selection = experiment.round_fn.select(server, first)
    if selection is not None:
        print(fed.describe_selection(selection), file=sys.stderr)
    check_round_spans_processes(experiment.round_fn, server, first)
    del first
    with _disk_space(files / "run_info.json", None, None):
        _write_run_info(files, experiment.round_fn)
    states = experiment.round_fn if experiment.client_store is not None else None
    checkpointer = Checkpointer(
        workdir,
        every=int(config.get("checkpoint_every", 0)),
        config=config.to_dict(),
        states=states,
    )
    # From here to the end, a signal asks for a stop after the round in progress: one that
    # comes after the last round lets the run finish writing, and it ends as finished. Several
    # processes agree on it after each round (their saves are collective).
    signals = _Signals(processes=jax.process_count())
    with signals:
        try:
            row = _train_rounds(
                config,
                files,
                experiment,
                server,
                checkpointer,
                (writer, signals, feed),
            )
            writer.finish(trackers_lib.finished_files(files))
        except BaseException:
            _close(writer, checkpointer, states, failed=True)
            raise
        _close(writer, checkpointer, states, failed=False)
    _summary(files, row, checkpointer, workdir / "checkpoints")
    return row


def _close(writer: MetricsWriter, checkpointer: Checkpointer, states, *, failed: bool) -> None:
    """Closes the run's outputs (TensorBoard's last events reach the file) and its client-state
    store. After a failure (``failed``), the store's error is not raised in its place: the
    rows of a round that failed (out of memory, a signal) were never computed, and the run
    resumes from its newest checkpoint, which the store's own files agree with."""
    writer.close()
    checkpointer.close()
    if states is None:
        return
    try:
        states.close()
    except Exception:
        if not failed:
            raise


def _summary(
    workdir: pathlib.Path,
    row: dict[str, Any],
    checkpointer: Checkpointer,
    checkpoints: pathlib.Path,
) -> None:
    """One line at the end of a finished run: its last metrics and where its files are, every
    path as ``--workdir`` gave it (relative or absolute)."""
    shown = ", ".join(
        f"{key} {row[key]:.4f}"
        for key in ("train_loss", "test_loss", "test_accuracy", "test_auc", "test_recall_at_5")
        if key in row
    )
    step = checkpointer.manager.latest_step()
    print(
        f"Finished round {row.get('round', step)}: {shown or 'no evaluation'}. Metrics in "
        f"{workdir / 'metrics.jsonl'}, curves in {workdir / 'curves.png'}, TensorBoard events in "
        f"{workdir / 'tensorboard'}, checkpoint {checkpoints / str(step)}.",
        file=sys.stderr,
    )


def _space_needed(error: BaseException) -> bool:
    """Whether ``error`` (or an error it wraps) says the disk or the user's quota is full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


@contextlib.contextmanager
def _disk_space(path: pathlib.Path, needed: int | None, checkpointer: Checkpointer | None):
    """Turns a full disk while writing ``path`` (``needed`` bytes, if known) into one line
    naming the file, the space and the last intact checkpoint (:class:`DiskFullError`)."""
    try:
        yield
    except Exception as e:
        if not _space_needed(e):
            raise
        if checkpointer is not None:
            checkpointer.discard_partial_saves()  # frees what the cut save had written
        try:
            free = shutil.disk_usage(path.parent if path.parent.exists() else path).free
            free_text = f"{_size(free)} free"
        except OSError:
            free_text = "free space unknown"
        need_text = f"about {_size(needed)} needed, " if needed else ""
        last = checkpointer.manager.latest_step() if checkpointer is not None else None
        kept = (
            f"the last intact checkpoint is {checkpointer.directory / str(last)} (the same "
            "command resumes from it once space is freed)"
            if last is not None
            else "no checkpoint of this run was saved yet"
        )
        error = DiskFullError(
            f"No space left on the device of {path}: it could not be written ({need_text}"
            f"{free_text}); {kept}."
        )
        error.errno = errno.ENOSPC
        raise error from None


class _Signals:
    """SIGINT (Ctrl-C) and SIGTERM while rounds run: the first asks the loop to stop after the
    round in progress (saved, so nothing computed is lost; a scheduler's SIGTERM usually leaves
    time for that), the second stops at once (``KeyboardInterrupt``; the run resumes from the
    newest checkpoint). Installed only in the main thread (Python's signal handlers live there).
    Several processes (``processes > 1``) stop together: each asks the others after every round
    (:meth:`stop_requested`), and all save that round and stop, whichever process got the signal.

    A third signal ends the process at once (``os._exit``), even when the main thread is held in
    native code (a computation, a read, a lock), where Python's handlers cannot run: a thread of
    its own reads the signals from :func:`signal.set_wakeup_fd`'s pipe, which the interpreter
    writes to as each signal arrives. The run resumes from its newest complete checkpoint (a
    save cut short leaves a temporary folder that the restore ignores).
    """

    FORCED = 3  # the signal that ends the process at once

    HANDLED = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, enabled: bool = True, processes: int = 1):
        self.enabled = enabled
        self.processes = processes
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        # The notice goes to the run's stderr even when a signal lands during a checkpoint save,
        # which silences sys.stderr (fedorth.train.checkpoint).
        self._stream = sys.stderr
        self._wakeup: tuple[int, int, int] | None = None
        if self.enabled and threading.current_thread() is threading.main_thread():
            for signum in self.HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
            self._watch()
        return self

    def _watch(self) -> None:
        """Starts the thread that ends the process at the :data:`FORCED`-th signal."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the interpreter's handler never waits on it
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd, previous)
        threading.Thread(
            target=_force_exit_at,
            args=(read_fd, self.HANDLED, self.FORCED),
            daemon=True,
            name="fedorth-signals",
        ).start()

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            try:
                print(
                    f"\n{signal.Signals(signum).name}: stopping after the round in progress, "
                    "saved (again to stop at once, from the newest checkpoint).",
                    file=self._stream,
                    flush=True,
                )
            except OSError:
                pass
            return
        for handled in self.HANDLED:  # the clean-up that follows is not interrupted again;
            signal.signal(handled, _count_only)  # a third signal still reaches the watcher
        self.received = signum
        raise KeyboardInterrupt

    def stop_requested(self) -> bool:
        """Whether the run stops after this round: a signal came (to any of its processes; all
        of them ask together, at the same points of the same round)."""
        if self.processes == 1:
            return self.received is not None
        from fedorth.train import distributed

        agreed = distributed.agree_on_signal(self.received or 0)
        if agreed and self.received is None:
            self.received = agreed  # another process's signal: this one stops with it
        return bool(agreed)

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if self._wakeup is not None:
            read_fd, write_fd, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write_fd)  # the watcher reads the end of its pipe and returns
            self._wakeup = None


def _count_only(signum, frame) -> None:
    """A signal after the second: the watcher of :class:`_Signals` counts it (and ends the
    process); the main thread's clean-up goes on uninterrupted."""


def _force_exit_at(read_fd: int, handled: tuple[int, ...], forced: int) -> None:
    """Reads the signal numbers the interpreter writes to the wake-up pipe; at the ``forced``-th
    of ``handled`` it says so in one line and ends the process (exit status ``128 + signal``)."""
    count = 0
    try:
        while chunk := os.read(read_fd, 64):
            for signum in chunk:
                if signum not in handled:
                    continue
                count += 1
                if count >= forced:
                    name = signal.Signals(signum).name
                    os.write(
                        2,
                        f"\n{name} again: exiting now; the same command resumes from the newest "
                        "checkpoint.\n".encode(),
                    )
                    os._exit(128 + signum)
    finally:
        os.close(read_fd)


def communication_row(experiment: builders.Experiment, server) -> dict[str, float]:
    """The communication fields of every ``metrics.jsonl`` row: MB each way per client, and MB
    per round (``fed.communication_bytes``); single runs and sweeps write the same."""
    comm = fed.communication_bytes(experiment.algorithm, server)
    clients = experiment.round_config.clients_per_round
    return {
        "comm_mb_up": comm["bytes_up"] / 1e6,
        "comm_mb_down": comm["bytes_down"] / 1e6,
        "comm_mb_round": (comm["bytes_up"] + comm["bytes_down"]) * clients / 1e6,
    }


def stopped(signum: int, round_index: int, workdir: pathlib.Path, what: str = "") -> RunInterrupted:
    """The stop a signal asked for, after round ``round_index`` was saved (``what``: ``"the
    sweep "`` for a sweep)."""
    return RunInterrupted(
        f"interrupted ({signal.Signals(signum).name}) at round {round_index}; the same command "
        f"resumes {what}from round {round_index} ({workdir}).",
        signum,
    )


def stopped_at_once(
    signum: int | None, done: int, checkpointer: Checkpointer, workdir: pathlib.Path, what: str = ""
) -> RunInterrupted:
    """The stop of a second signal (or a ``KeyboardInterrupt`` raised otherwise) after round
    ``done``: the run resumes from the newest checkpoint, once a save in flight completed."""
    checkpointer.manager.wait_until_finished()
    last = checkpointer.manager.latest_step()
    return RunInterrupted(
        f"interrupted at round {done}; the same command resumes {what}from round "
        f"{last if last is not None else 0}"
        + ("" if last is not None else " (no checkpoint was saved yet)")
        + f" ({workdir}).",
        signum,
        at_once=True,
    )


def _evaluate_checkpoint(
    server, done: int, eval_fn, comm: dict[str, float], writer: MetricsWriter
) -> dict:
    """The row of the restored round, when ``metrics.jsonl`` and TensorBoard both lack it: the
    checkpoint's model evaluated again (the test metrics are those the run wrote; the round's
    training metrics, e.g. ``train_loss``, and its wall clock are gone)."""
    evaluation = to_host(eval_fn(server.params, server.model_state))
    row = {"round": done, **{k: float(v) for k, v in evaluation.items()}, **comm}
    writer.write(row)
    logging.warning(
        "%s lacked the row of round %d, and TensorBoard's events too; rebuilt it by evaluating "
        "checkpoint %d (its training metrics and wall_s cannot be rebuilt).",
        writer.path,
        row["round"],
        row["round"],
    )
    return row


class _RunRounds(rounds_lib.Rounds):
    """A single run's rounds (:func:`fedorth.train.rounds.run_rounds`): one server state; a
    non-finite loss, state or row raises :class:`DivergenceError` before the round is written."""

    def __init__(self, config, workdir, experiment, server, checkpointer, outputs):
        self.config, self.workdir, self.experiment = config, workdir, experiment
        self.server, self.checkpointer = server, checkpointer
        self.writer, self.feed, self.plotter = outputs
        self.rounds = int(config.fed.rounds)
        self.eval_every = int(config.get("eval_every", 1))
        self.checkpoint_every = checkpointer.every
        self.comm = communication_row(experiment, server)
        self.eval_fn = builders.make_eval_fn(experiment)
        self.wall_offset, self.start = 0.0, time.perf_counter()
        self.row: dict[str, Any] = {}
        state = server.replace(key=jax.random.key_data(server.key))
        self.state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))  # what a save writes
        if experiment.client_store is not None and experiment.client_store.kind == "host":
            self.state_bytes += experiment.client_store.nbytes()

    def _evaluation(self) -> dict[str, float]:
        evaluation = to_host(self.eval_fn(self.server.params, self.server.model_state))
        return {k: float(v) for k, v in evaluation.items()}

    def _write(self, row: dict[str, Any]) -> None:
        with _disk_space(self.writer.path, len(json.dumps(row)) + 1, self.checkpointer):
            self.writer.write(row)
        self.row = row
        self.progress.update(row["round"], row)
        # Redrawn at every evaluation (in the background), so a run can be watched.
        self.plotter.update(self.writer.rows())

    def initial(self) -> None:
        # The initial model (no local step ran, so no train_loss); curves start here.
        row = {"round": 0, **self._evaluation(), **self.comm}
        row["wall_s"] = time.perf_counter() - self.start
        self._write(row)

    def round(self, done: int) -> Any:
        self.server, metrics = self.experiment.round_fn(self.server, self.feed(done))
        return metrics

    def check(self, round_index: int, metrics: Any, *, full_state: bool) -> None:
        _check_finite(
            round_index,
            metrics,
            self.server,
            full_state=full_state,
            checkpointer=self.checkpointer,
        )

    def evaluate(self, round_index: int, metrics: Any) -> None:
        row = rounds_lib.evaluated_row(
            self.config,
            round_index,
            to_host(metrics),
            self._evaluation(),
            self.comm,
            self.wall_offset + time.perf_counter() - self.start,
            to_host(self.server.params) if self.config.get("log_condition_number") else None,
        )
        bad = rounds_lib.non_finite(row)
        if bad is not None:
            raise _diverged(
                round_index,
                f"{bad} is {row[bad]}",
                f"Diverged at round {round_index}: {bad} is {row[bad]} "
                "although the parameters are finite. Nothing of this round was "
                "written or saved; lower optim.learning_rate or add clipping.",
            )
        self._write(row)

    def save(self, round_index: int) -> None:
        with _disk_space(
            self.checkpointer.directory / str(round_index), self.state_bytes, self.checkpointer
        ):
            self.checkpointer.save(self.server, force=True)

    def stopped(self, signum: int, round_index: int) -> RunInterrupted:
        return stopped(signum, round_index, self.workdir)

    def stopped_at_once(self, signum: int | None, done: int) -> RunInterrupted:
        return stopped_at_once(signum, done, self.checkpointer, self.workdir)

    def out_of_memory(self, error: BaseException) -> str:
        round_fn = self.experiment.round_fn
        return fed.memory.out_of_memory_message(error, round_fn.config, round_fn.devices[0])

    def wait(self) -> None:
        self.plotter.wait()


def _train_rounds(config, workdir, experiment, server, checkpointer, outputs):
    writer, signals, feed = outputs
    title = f"{config.fed.algorithm} on {config.data.name}"
    plotter = plots.CurvePlotter(workdir / "curves.png", title=title)
    run = _RunRounds(config, workdir, experiment, server, checkpointer, (writer, feed, plotter))
    # A second signal during the restore stops at once, as during the rounds.
    with rounds_lib.stopping_at_once(
        signals, lambda signum: run.stopped_at_once(signum, restored_round(checkpointer))
    ):
        done = _resume(run)
    run.progress = Progress(run.rounds, start=done)
    run.start = time.perf_counter()
    done = rounds_lib.run_rounds(run, signals, done)
    with _disk_space(checkpointer.directory / str(done), run.state_bytes, checkpointer):
        checkpointer.save(run.server, force=True)  # a resumed run that had already finished
    plotter.update(writer.rows())
    with _disk_space(workdir / "curves.png", None, checkpointer):
        plotter.close()
    return run.row


def restored_round(checkpointer: Checkpointer) -> int:
    """The round a run (or a sweep) resumes from while its checkpoint is restored: the newest
    checkpoint's, or 0."""
    last = checkpointer.manager.latest_step()
    return 0 if last is None else int(last)


def _resume(run: _RunRounds) -> int:
    """Restores the newest checkpoint into ``run`` and brings ``metrics.jsonl`` to its round (a
    missing row of that round rebuilt); the round the rounds resume from."""
    config, workdir, checkpointer, writer = run.config, run.workdir, run.checkpointer, run.writer
    rounds, eval_every = run.rounds, run.eval_every
    metrics_path = workdir / "metrics.jsonl"
    restored = checkpointer.restore_latest(run.server)
    # The round counter, kept on the host: each process reads the state it holds once, then
    # counts the rounds it runs (all processes run them together).
    run.server = run.server if restored is None else restored
    done = int(to_host(run.server.round))
    if restored is None:
        with _disk_space(metrics_path, None, checkpointer):
            writer.resume(-1)
        return done
    with _disk_space(metrics_path, None, checkpointer):
        kept = writer.resume(done, exact=dict(run.comm))
        if (done >= rounds or (eval_every > 0 and done % eval_every == 0)) and not any(
            row["round"] == done for row in kept
        ):
            kept.append(_evaluate_checkpoint(run.server, done, run.eval_fn, dict(run.comm), writer))
    run.wall_offset = max((row["wall_s"] for row in kept if "wall_s" in row), default=0.0)
    run.row = writer.rows()[-1] if writer.rows() else {}
    if done >= rounds:
        extend = (
            f"rerun with a larger --config.fed.rounds (> {done}) to extend it"
            if config.optim.get("schedule", "constant") in ROUNDS_FREE_SCHEDULES
            else f"optim.schedule={config.optim.schedule!r} decays over fed.rounds, so it "
            "cannot be extended; start a new --workdir for a longer run"
        )
        print(
            f"{workdir} holds a finished run (round {done} of fed.rounds={rounds}); {extend}.",
            file=sys.stderr,
        )
    else:
        print(f"Resumed from round {done} in {workdir}.", file=sys.stderr)
    return done
