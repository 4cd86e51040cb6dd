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

The lock is taken on the workdir folder itself, and on ``run.lock``: deleting ``run.lock``
while a run holds it does not let a second run in (the folder's lock still excludes it), and the
file's lock serves file systems that lock files but not folders (NFS).

A multi-process run (``jax.distributed``) takes the lock once, in process 0, for all its
processes; if process 0 is refused, every process stops with the refusal.

A workdir may come from someone else: its files are data, never instructions. The run's own
files (:data:`OWN_FILES`, their temporaries and ``run.lock``) are opened with ``O_NOFOLLOW``,
and a symbolic link in the place of one is refused in one line (:func:`refuse_links`): writing
through it would overwrite the link's target, a file outside the run. Nothing a run reads from
a workdir is unpickled or evaluated: JSON, JSON lines, TensorBoard's protobuf records and
orbax's array files only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pathlib
import shutil
import socket
import sys
import time

LOCK_NAME = "run.lock"
OWN_FILES = ("config.json", "run_info.json", "metrics.jsonl", "curves.png")
"""The files a run writes in its workdir (besides ``run.lock``, ``checkpoints/`` and
``tensorboard/``); each is written through a temporary ``.NAME.tmp`` (``.curves.png.tmp.png``)
renamed over it."""


class WorkdirError(ValueError):
    """The ``--workdir`` argument cannot hold a run (empty, a file, a file where a folder of
    the run's outputs goes, or not writable)."""


class WorkdirLockedError(RuntimeError):
    """Another run is writing to the workdir."""


class DiskFullError(OSError):
    """A file of the run could not be written: no space left on its file system."""


def temporary(path: pathlib.Path) -> pathlib.Path:
    """The temporary file a run writes ``path`` through (then renames it over ``path``)."""
    if path.suffix == ".png":  # matplotlib picks the format by the name's suffix
        return path.with_name(f".{path.name}.tmp.png")
    return path.with_name(f".{path.name}.tmp")


def link_message(path: pathlib.Path) -> str:
    """The refusal of a symbolic link in the place of one of the run's own files."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return (
        f"{path} is a symbolic link{target}; a run writes its own files there and never through "
        "a link, which would overwrite the link's target: remove the link (its target is left as "
        "it is) and rerun, or use another --workdir."
    )


def refuse_links(workdir: pathlib.Path) -> None:
    """Refuses a workdir where one of the run's own files, or its temporary, is a symbolic link.

    Raises:
      WorkdirError: naming the first link found.
    """
    for name in OWN_FILES:
        for path in (workdir / name, temporary(workdir / name)):
            if path.is_symlink():
                raise WorkdirError(link_message(path))


def open_own(path: pathlib.Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of one of the run's own files, never through a symbolic link.

    Raises:
      WorkdirError: ``path`` is a symbolic link (one line naming it).
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise WorkdirError(link_message(path)) from None
        raise


def write_atomic(path: pathlib.Path, text: str | bytes) -> None:
    """Writes ``text`` to ``path`` so a kill at any point leaves the old or the new file.

    Neither ``path`` nor its temporary is followed if it is a symbolic link (``os.replace``
    renames over a link, not through it; the temporary is refused).
    """
    tmp = temporary(path)
    data = text.encode() if isinstance(text, str) else text
    fd = open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_own(path: pathlib.Path, data: bytes) -> None:
    """Appends ``data`` to one of the run's own files (created if missing), not through a link."""
    fd = open_own(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with os.fdopen(fd, "ab") as f:
        f.write(data)
        f.flush()


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


def _holder(path: pathlib.Path) -> dict | None:
    """The holder's details in ``run.lock``; ``{}`` before they are written, ``None`` when the
    file is gone (deleted while its run holds the folder's lock)."""
    try:
        fd = open_own(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except (OSError, WorkdirError):
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return {}  # the holder has not written its details yet (it is starting)


class WorkdirLock:
    """The lock on ``workdir`` (created if missing), held until :meth:`release`.

    Two ``flock`` locks, both taken without waiting: on the folder itself (a deleted
    ``run.lock`` does not defeat it) and on ``run.lock`` (opened with ``O_NOFOLLOW``), which
    holds the holder's details.

    Raises:
      WorkdirLockedError: another process holds it; the message names that process.
      WorkdirError: the workdir cannot be created or written, or ``run.lock`` is a symbolic link.
      DiskFullError: no space for the holder's details in ``run.lock``.
    """

    def __init__(self, workdir: pathlib.Path):
        self.path = workdir / LOCK_NAME
        self._fd: int | None = None
        self._folder_fd: int | None = None
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            self._folder_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            # The folder first: a holder whose run.lock was deleted is found before this run
            # creates another.
            if self._lock(self._folder_fd, workdir, folder=True):
                self._fd = open_own(self.path, os.O_RDWR | os.O_CREAT)
                self._lock(self._fd, workdir, folder=False)
            else:
                self._fd = open_own(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            self._close()
            raise WorkdirError(
                f"--workdir={workdir} cannot be written ({e.strerror}: {e.filename}); pass a "
                "folder this user can create and write."
            ) from e
        except (WorkdirError, WorkdirLockedError):
            self._close()
            raise
        details = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv)[:500],
        }
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, (json.dumps(details) + "\n").encode(), 0)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.release()
            error = DiskFullError(
                f"No space left on the device of {self.path}: it could not be written "
                f"({_free(workdir)}); nothing of the run was changed (free some space, then the "
                "same command starts or resumes it)."
            )
            error.errno = errno.ENOSPC
            raise error from None

    def _lock(self, fd: int, workdir: pathlib.Path, *, folder: bool) -> bool:
        """``flock`` without waiting. Returns whether the file system locks (the folder: a file
        system that locks files only, such as NFS, returns False and ``run.lock`` is locked)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WorkdirLockedError(self._refusal(workdir)) from None
            if folder and e.errno in (errno.EBADF, errno.EINVAL):
                return True  # NFS: a folder cannot be opened for writing, which its locks need
            # A file system without locks: refusing would make it unusable.
            logging.warning(
                "%s cannot be locked (%s): make sure no other run writes to %s at the same time.",
                self.path,
                e.strerror,
                workdir,
            )
            return False

    def _close(self) -> None:
        for name in ("_fd", "_folder_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def _refusal(self, workdir: pathlib.Path) -> str:
        holder = _holder(self.path)
        if holder is None:
            who = f"a process whose {LOCK_NAME}, which would name it, was deleted"
            stop = "wait for it to end or stop it"
        elif not holder:
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
        self._close()  # closing the last descriptor releases the flock


def _free(path: pathlib.Path) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "free space unknown"
    return f"{free / 1e6:.1f} MB free" if free >= 1e6 else f"{free / 1e3:.1f} kB free"


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
        except (WorkdirLockedError, WorkdirError, DiskFullError) as e:
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
