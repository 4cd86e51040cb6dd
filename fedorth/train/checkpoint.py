"""Checkpoints of the server state with orbax, and resume from the newest intact one.

Crash safety rests on three properties:

* **Atomic steps.** Orbax writes each step to a temporary folder and renames it when complete, so
  a run killed at any point leaves only complete steps behind (leftover temporary folders are
  removed by the next run).
* **Verified contents.** Each step stores the SHA-256 digest of every saved array (path, dtype,
  shape, bytes) in its orbax metadata, written atomically with the step. Orbax itself does not
  notice bytes overwritten inside a data file (it restores wrong values silently), so the digest
  is checked on restore. A step that cannot be read or fails the check is skipped with a warning,
  the previous one is used, and the bad step is moved to ``checkpoints_unreadable/`` (kept for
  inspection; otherwise the resumed run could never rewrite that step).
* **Synchronous, host-side saves.** The state is copied to host memory (``jax.device_get``)
  before the save returns, and orbax saves synchronously: nothing is read from device buffers
  after :meth:`Checkpointer.save` returns, so the next round may donate them
  (``donate_argnums`` in ``fedorth.fed.round``) and no background thread outlives a save.

* **Complete steps only.** A step folder without orbax's commit marker (``commit_success.txt``)
  and metadata, e.g. an emptied or half-copied folder, is skipped with the same one-line warning
  and set aside like an unreadable one.
* **The clients' states travel with the server's.** With a client-state store
  (``fed.client_state`` host or disk, ``fedorth.fed.client_store``) every row a round wrote is in
  the store before the step is saved; a host store's arrays are saved in the step, and a disk
  store's files are put back to the restored step's round (its undo files).
* **The config travels with the state.** Each step's metadata holds the resolved config of the
  run that saved it, so a run of another config cannot resume it, even without ``config.json``
  (``saved_config``).

If *no* step can be restored, :class:`CheckpointError` is raised instead of silently starting
over: that usually means the code changed the state's structure. The steps are left as they
are, and the message offers nothing that would discard them.

Multi-process runs (``jax.process_count() > 1``) save the device arrays directly and skip the
digest (each process would only see its own shards).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import logging
import pathlib
import shutil
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fedorth.fed.state import ServerState

_DIGEST_KEY = "fedorth_sha256"
_CONFIG_KEY = "fedorth_config"
# Orbax's own record of a finished step (written last, before the rename that makes it final):
# CheckpointManager lists a step folder by its name alone, an empty folder included.
_COMPLETE_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt")


def _is_complete(step_dir: pathlib.Path) -> bool:
    return all((step_dir / name).is_file() for name in _COMPLETE_MARKERS)


def _step_dirs(directory: pathlib.Path) -> list[pathlib.Path]:
    """The step folders of ``directory``, newest first."""
    if not directory.is_dir():
        return []
    steps = [p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted(steps, key=lambda p: int(p.name), reverse=True)


def saved_config(directory: str | pathlib.Path) -> tuple[int, dict] | None:
    """``(step, config)``: the config saved with the newest complete step that has one.

    Read from the step's orbax metadata file without restoring anything (no JAX). ``None``
    when no step carries a config (none saved yet, or saved by an older fedorth).
    """
    for step_dir in _step_dirs(pathlib.Path(directory)):
        if not _is_complete(step_dir):
            continue
        try:
            metadata = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
        except (OSError, ValueError):
            continue
        config = (metadata.get("custom_metadata") or {}).get(_CONFIG_KEY)
        if isinstance(config, dict):
            return int(step_dir.name), config
    return None


class CheckpointError(RuntimeError):
    """No checkpoint in the workdir could be restored."""


def _to_saveable(server: ServerState, states=None) -> dict[str, Any]:
    # Typed PRNG keys are not serializable: store the raw key data.
    tree = {"server": server.replace(key=jax.random.key_data(server.key))}
    stored = None if states is None else states.store.checkpoint_tree()
    if stored is not None:
        tree["client_states"] = stored
    return tree


def _from_saveable(tree: dict[str, Any], like: ServerState) -> ServerState:
    server = tree["server"]
    return server.replace(
        key=jax.random.wrap_key_data(server.key, impl=jax.random.key_impl(like.key))
    )


def tree_digest(tree: Any) -> str:
    """SHA-256 over every leaf's path, dtype, shape and bytes (in tree order).

    Args:
      tree: a pytree of arrays (device arrays are copied to host).

    Returns:
      The hex digest; equal trees (bit for bit) give equal digests.
    """
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# The coroutines of orbax's array reads and writes (orbax.checkpoint's type handlers).
_ORBAX_READ, _ORBAX_WRITE = "_read_array_index_and_device_put", "_open_and_write"


def _collect_abandoned_reads() -> None:
    """Garbage-collects the reads orbax abandons when one array of a step fails, quietly.

    Each would otherwise be reported later, at a random point, as "Exception ignored in:
    <coroutine _read_array_index_and_device_put>" with a TensorStore spec dump.
    """
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: logging.debug("%s", unraisable.exc_value)
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _abandoned_read(unraisable) -> bool:
    """Whether an unraisable exception is orbax's abandoned read (or its callback into a closed
    event loop): the two kinds ``_collect_abandoned_reads`` collects."""
    if _ORBAX_READ in repr(unraisable.object):
        return True
    closed_loop = isinstance(unraisable.exc_value, RuntimeError)
    return (
        unraisable.object is None
        and closed_loop
        and "Event loop is closed" in str(unraisable.exc_value)
    )


def drop_abandoned_io_reports() -> None:
    """For a command's whole process: the late reports of orbax's abandoned reads and writes are
    dropped, so that the one line reporting an unreadable checkpoint or a full disk stays one.

    The garbage collector can finalize them later than ``_collect_abandoned_reads``, at any
    point of the run: an abandoned read prints "Exception ignored in: <coroutine
    _read_array_index_and_device_put>", an abandoned write of a save that failed (a full disk)
    logs asyncio's "Task exception was never retrieved" for ``_open_and_write``, each with a
    TensorStore spec dump and a traceback. Every other unraisable exception goes to the hook
    there was, every other asyncio report is logged. Installed by the command-line entry
    points, not on import."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if _abandoned_read(unraisable):
            logging.debug("%s", unraisable.exc_value)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_not_an_abandoned_write)


def _not_an_abandoned_write(record: logging.LogRecord) -> bool:
    """A logging filter: False for asyncio's report of an orbax write task whose failure nobody
    retrieved (the save it belonged to has already raised, and was reported)."""
    message = record.getMessage()
    return not (
        message.startswith("Task exception was never retrieved")
        and any(f"{name}()" in message for name in (_ORBAX_READ, _ORBAX_WRITE))
    )


def _warn(message: str) -> None:
    # Python's last-resort handler prints warnings to stderr even when logging is unconfigured.
    logging.warning(message)


@contextlib.contextmanager
def _quiet_orbax():
    """Keeps a failed restore or save to the caller's one line: orbax and TensorStore log each
    failed read or write (with coroutine and spec dumps, from their threads) through absl/Python
    logging at WARNING and ERROR, and TensorStore's callbacks into a closed event loop print
    tracebacks to ``sys.stderr``, all before the error reaches the caller. On an error, the
    abandoned reads and writes are collected here, quietly."""
    loggers = [logging.getLogger(), logging.getLogger("absl")]
    levels = [logger.level for logger in loggers]
    stderr = sys.stderr
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    sys.stderr = io.StringIO()
    try:
        yield
    except BaseException:
        _collect_abandoned_reads()
        raise
    finally:
        sys.stderr = stderr
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class Checkpointer:
    """Saves the server state every ``every`` rounds under ``workdir/checkpoints``.

    Args:
      workdir: the run's folder.
      every: save when ``round % every == 0`` (and at the end); ``0`` disables periodic saves.
      max_to_keep: how many recent checkpoints to keep (>= 2 so a corrupted newest one has a
        predecessor to fall back to).
      config: the run's resolved config (``config.to_dict()``), saved in each step's metadata.
      states: the round of a client-state store (``fedorth.fed.stored_round.StoredRoundFn``),
        whose store each step saves and each restore starts, or None.
    """

    def __init__(
        self,
        workdir: str | pathlib.Path,
        *,
        every: int,
        max_to_keep: int = 3,
        config: dict | None = None,
        states=None,
    ):
        self.states = states
        if every < 0:
            raise ValueError(f"checkpoint_every={every} must be >= 0.")
        self.every = every
        # JSON types only (orbax writes the metadata as JSON); as config.json writes it.
        self.config = None if config is None else json.loads(json.dumps(config, default=str))
        self.workdir = pathlib.Path(workdir).absolute()
        self.directory = self.workdir / "checkpoints"
        with _quiet_orbax():  # orbax warns of each incomplete step it lists
            self.manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max(max_to_keep, 2),
                    create=True,
                    enable_async_checkpointing=False,
                    cleanup_tmp_directories=True,
                ),
            )

    def save(self, server: ServerState, *, force: bool = False) -> bool:
        """Saves ``server`` at step ``server.round`` if due (or ``force``) and not yet saved."""
        step = int(server.round)
        if not force and (self.every == 0 or step % self.every):
            return False
        if step in self.manager.all_steps():
            return False
        if self.states is not None:
            self.states.wait()  # every round's rows are in the store
            self.states.store.sync()
        tree = _to_saveable(server, self.states)
        metadata = {} if self.config is None else {_CONFIG_KEY: self.config}
        if jax.process_count() == 1:
            tree = jax.device_get(tree)  # host copy: the next round may donate the buffers
            metadata[_DIGEST_KEY] = tree_digest(tree)
        with _quiet_orbax():  # a failure is raised here (a full disk: fedorth.train.loop says so)
            self.manager.save(step, args=ocp.args.StandardSave(tree), custom_metadata=metadata)
            self.manager.wait_until_finished()
        if self.states is not None:
            self.states.store.saved(self.manager.all_steps())
        return True

    def _verify(self, step: int, tree: Any) -> None:
        expected = (self.manager.metadata(step).custom_metadata or {}).get(_DIGEST_KEY)
        if expected is None:  # saved by a multi-process run or an older fedorth
            _warn(f"Checkpoint {self.directory / str(step)} has no content digest; not verified.")
            return
        actual = tree_digest(tree)
        if actual != expected:
            raise ValueError("its contents do not match the SHA-256 digest saved with it")

    def _set_aside(self, steps: list[int]) -> None:
        target = self.workdir / "checkpoints_unreadable"
        target.mkdir(exist_ok=True)
        for step in steps:
            source = self.directory / str(step)
            if source.exists():
                shutil.move(str(source), str(target / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"))
        self.manager.reload()

    def discard_partial_saves(self) -> None:
        """Removes the temporary folders of saves that did not complete (a full disk): they hold
        space, and the next run would remove them anyway."""
        for tmp in self.directory.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def restore_latest(self, like: ServerState, *, on_host: bool = False) -> ServerState | None:
        """The newest intact checkpoint (structure of ``like``), or ``None`` if there is none.

        ``on_host``: as NumPy arrays, whole in every process (a multi-process sweep reads every
        replica's rows, whichever processes wrote them).

        Incomplete, unreadable or corrupted steps before it are moved to
        ``checkpoints_unreadable/`` and named in one warning line.

        Raises:
          CheckpointError: checkpoints exist but none can be restored.
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _to_saveable(like))
        if on_host:
            abstract = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), abstract)
        stored = None if self.states is None else self.states.store.abstract_tree()
        if stored is not None:
            abstract["client_states"] = stored
        failed: list[tuple[int, str]] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            if not _is_complete(self.directory / str(step)):
                failed.append((step, "incomplete: a save or copy that did not finish"))
                continue
            try:
                with _quiet_orbax():
                    tree = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
                self._verify(step, tree)
            except Exception as e:  # noqa: BLE001 -- any read failure means: try the previous one
                detail = str(e).splitlines()[0] if str(e) else ""
                detail = detail.split(" See full TensorStore details")[0][:200]
                failed.append((step, f"unreadable or corrupted ({type(e).__name__}: {detail})"))
                continue
            if failed:
                self._set_aside([s for s, _ in failed])
                _warn(
                    " ".join(f"Checkpoint {self.directory / str(s)} is {why}." for s, why in failed)
                    + f" Resuming from checkpoint {step}; the skipped ones were moved to "
                    f"{self.workdir / 'checkpoints_unreadable'}."
                )
            self._start_states(tree.get("client_states"), step)
            return _from_saveable(tree, like)
        if failed:
            raise CheckpointError(
                f"None of the checkpoints {[s for s, _ in failed]} in {self.directory} can be "
                f"restored (newest: {failed[0][1]}); they are left as they are. If fedorth's "
                "code changed the structure of the server state since they were saved, resume "
                "with the version that saved them (run_info.json names its git commit), or start "
                "a new --workdir."
            )
        self._start_states(None, None)
        return None

    def _start_states(self, stored: dict | None, step: int | None) -> None:
        """Starts the client-state store at the restored step (None: round 0)."""
        if self.states is not None:
            self.states.reset()
            self.states.store.start(stored, step)

    def close(self) -> None:
        """Waits for a save in flight and closes orbax's manager. While a Ctrl-C or SIGTERM
        stops the run, a save it cut short may fail here: that failure is dropped (the cut step
        is incomplete, and the next start removes it), so the stop's own message is the one
        the user sees."""
        interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        try:
            with _quiet_orbax():
                self.manager.wait_until_finished()
                self.manager.close()
        except Exception:
            if not interrupted:
                raise
