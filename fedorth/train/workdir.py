"""Where a run writes: the ``--workdir`` argument, and one writer per workdir.

A run holds ``WORKDIR/run.lock`` for its whole life: an advisory lock of the operating system
(``fcntl.flock``) on that file, taken without waiting. A second run on the same workdir is refused
at start with the holder's pid, host, start time and command, which the holder wrote into the
file. The kernel releases the lock when the holding process ends, however it ends (SIGKILL, a
crash, power loss: the file may stay, with the dead holder's details, but it no longer blocks),
so there is no stale lock to clean up by hand. On NFS, Linux maps ``flock`` to the server's
byte-range locks, which also exclude runs on other hosts; a host that lost power releases its
locks when the server's lease on them expires (NFSv4: about 90 s). A file system without locks
(``ENOLCK``) gets a one-line warning and no lock.

A multi-process run (``jax.distributed``) takes the lock once, in process 0, for all its
processes; if process 0 is refused, every process stops with the refusal.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pathlib
import socket
import sys
import time

LOCK_NAME = "run.lock"


class WorkdirError(ValueError):
    """The ``--workdir`` argument cannot hold a run (empty, a file, a file where a folder of
    the run's outputs goes, or not writable)."""


class WorkdirLockedError(RuntimeError):
    """Another run is writing to the workdir."""


def resolve(workdir: str | os.PathLike) -> pathlib.Path:
    """The workdir as a path: ``~`` expanded; an empty one, or a file, refused.

    Raises:
      WorkdirError: ``workdir`` is empty (it would write the run into the current folder) or
        names an existing file.
    """
    text = os.fspath(workdir)
    if not text.strip():
        raise WorkdirError(
            "--workdir is empty: a run needs its own folder for metrics, checkpoints and plots "
            "(it would otherwise write into the current folder); pass --workdir=runs/NAME."
        )
    path = pathlib.Path(os.path.expanduser(text))
    if path.exists() and not path.is_dir():
        raise WorkdirError(
            f"--workdir={text} is a file, not a folder; pass a folder (it is created if missing)."
        )
    return path


def _holder(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # the holder has not written its details yet (it is starting)


class WorkdirLock:
    """The lock on ``workdir`` (created if missing), held until :meth:`release`.

    Raises:
      WorkdirLockedError: another process holds it; the message names that process.
      WorkdirError: the workdir cannot be created or written.
    """

    def __init__(self, workdir: pathlib.Path):
        self.path = workdir / LOCK_NAME
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise WorkdirError(
                f"--workdir={workdir} cannot be written ({e.strerror}: {e.filename}); pass a "
                "folder this user can create and write."
            ) from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(self._fd)
                self._fd = None
                raise WorkdirLockedError(self._refusal(workdir)) from None
            # A file system without locks: refusing would make it unusable.
            logging.warning(
                "%s cannot be locked (%s): make sure no other run writes to %s at the same time.",
                self.path,
                e.strerror,
                workdir,
            )
        details = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv)[:500],
        }
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(details) + "\n").encode(), 0)

    def _refusal(self, workdir: pathlib.Path) -> str:
        holder = _holder(self.path)
        if not holder:
            who = "a process that is starting (its details are not written yet)"
            stop = "wait for it to end or stop it"
        else:
            here = holder.get("host") == socket.gethostname()
            who = (
                f"pid {holder.get('pid')} on host {holder.get('host')}"
                f"{'' if here else ' (another host)'}, started {holder.get('started')}: "
                f"{holder.get('command')}"
            )
            stop = (
                f"wait for it to end or stop it (kill {holder.get('pid')}"
                f"{'' if here else ' on ' + str(holder.get('host'))}; the same command resumes it)"
            )
        return (
            f"{workdir} is in use by another run ({who}). One run writes to a workdir at a "
            f"time: {stop}, or use another --workdir."
        )

    def release(self) -> None:
        """Releases the lock (the file stays: removing it would race with a run opening it)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


def lock_for_all_processes(
    workdir: pathlib.Path, process_index: int, process_count: int
) -> WorkdirLock | None:
    """Process 0 takes the workdir's lock for the whole (multi-process) run.

    Args:
      workdir: the run's folder.
      process_index, process_count: ``jax.process_index()``, ``jax.process_count()`` (after
        ``jax.distributed.initialize``, the CLI's ``--distributed``).

    Returns:
      The lock in process 0, ``None`` in the others.

    Raises:
      WorkdirLockedError: in every process, when process 0 was refused (process 0 raises its
        own error: the holder, or a workdir it cannot write).
    """
    lock, refusal = None, None
    if process_index == 0:
        try:
            lock = WorkdirLock(workdir)
        except (WorkdirLockedError, WorkdirError) as e:
            refusal = e
    if process_count > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        refused = multihost_utils.broadcast_one_to_all(np.int32(refusal is not None))
        if int(refused) and refusal is None:
            raise WorkdirLockedError(
                f"{workdir} cannot be locked by process 0 of this run (its message says why)."
            )
    if refusal is not None:
        raise refusal
    return lock
