"""Where the clients' persistent states live: on the device, in host memory, or on disk.

An algorithm that keeps state per client (SCAFFOLD's control variates ``c_i``, FedDyn's duals,
persistent local optimizer states, a user's ``start.Persistent`` or ``Global(keep=...)`` state)
holds one :class:`~fedorth.fed.state.ClientState` per client. ``fed.client_state`` says where
the ``N`` of them live:

* ``"device"``: stacked over ``N`` in ``ServerState.clients`` on the device; the round gathers
  the ``S`` sampled rows and scatters them back inside its compiled call.
* ``"host"``: one NumPy ``[N, ...]`` array per leaf in host memory (:class:`ArrayStore`).
* ``"disk"``: one ``[N, ...]`` file per leaf in a folder of the run, read and written by row
  (:class:`DiskStore`); host memory holds the sampled clients' rows only.

With ``host`` and ``disk``, the round of ``fedorth.fed.stored_round`` hands the compiled round the
``S`` sampled rows (``RoundConfig.client_rows``) and writes the rows it returns back into the
store. The round's sampled ids are known before it runs (``fed.context.sample_clients`` of the
server's key and round), so the next round's rows are read in a background thread while a round
runs, and a round's rows are written back in another while the next one runs; rows that two
consecutive rounds share come from the device. The rows pass through unchanged (same dtype, same
bytes), so every store gives the same states, bit for bit, as ``device``.

Checkpoints: a ``host`` store's arrays are saved in the orbax checkpoint beside the server state.
A ``disk`` store's files are not copied: before a round's rows overwrite the files, the rows they
replace are written to an undo file of that round (``undo/<round>.npz``, renamed into place when
complete); a resume from checkpoint ``c`` applies the undo files of the rounds after ``c``, newest
first, which puts the files back as they were when ``c`` was saved, whether the run was killed
during a round's write or after it. Undo files older than the oldest kept checkpoint are removed.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

PyTree = Any

STORES = ("auto", "device", "host", "disk")
"""The values of ``fed.client_state``."""

# What ``auto`` leaves to everything else of a run: the store takes at most this share of the
# memory (or disk) it is measured against.
FRACTION = 0.5


class ClientStoreError(RuntimeError):
    """The clients' states cannot be kept where ``fed.client_state`` says (the message is one
    line naming the key and the remedy)."""


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def bytes_per_client(template: PyTree) -> int:
    """The bytes of one client's state (``template``: one client's ``ClientState``)."""
    return sum(
        int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(template)
    )


def device_free_bytes(device=None) -> int | None:
    """Free memory of ``device`` (default: the first), or None when the backend does not say
    (XLA:CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 -- a backend without memory statistics
        return None
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def host_available_bytes() -> int:
    """The host memory available to new allocations (``MemAvailable``), or the physical memory."""
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def disk_free_bytes(directory: pathlib.Path) -> int:
    """Free bytes of the file system ``directory`` is (or would be) created on."""
    path = pathlib.Path(directory).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def choose(
    num_clients: int,
    per_client: int,
    *,
    device_free: int | None,
    host_free: int,
    disk_free: int,
    directory: pathlib.Path,
) -> tuple[str, str]:
    """``fed.client_state="auto"``'s choice and the one line that states it with the estimate.

    The first of ``device``, ``host``, ``disk`` whose free memory holds the ``N`` states within
    :data:`FRACTION` of it; on a backend that does not report its memory (CPU), the device's is
    the host's.

    Raises:
      ClientStoreError: none holds them.
    """
    total = num_clients * per_client
    device = host_free if device_free is None else device_free
    estimate = f"{num_clients} clients x {_size(per_client)} = {_size(total)}"
    free_text = (
        f"free: device {_size(device)}, host {_size(host_free)}, disk {_size(disk_free)} "
        f"({directory})"
    )
    for kind, free in (("device", device), ("host", host_free), ("disk", disk_free)):
        if total <= FRACTION * free:
            return kind, f"fed.client_state=auto: {kind} ({estimate}; {free_text})."
    raise ClientStoreError(
        f"The clients' states fit nowhere: data.num_clients={num_clients} clients x "
        f"{_size(per_client)} per client = {_size(total)} ({free_text}). Remedies: "
        "--config.fed.client_state=disk with --config.fed.client_state_dir on a larger disk, "
        "fewer clients (data.num_clients), or an algorithm that keeps no per-client state."
    )


def _check_writable(directory: pathlib.Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".writable"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ClientStoreError(
            f"fed.client_state=disk: the store folder {directory} is not writable "
            f"({e.strerror or e}); give a writable one with --config.fed.client_state_dir=DIR."
        ) from None


class ArrayStore:
    """The ``N`` clients' states as one NumPy ``[N, ...]`` array per leaf (``fed.client_state=
    host``).

    Rows no round has written yet read as ``template`` (the state every client starts with); the
    arrays start as zeros, which the operating system maps lazily, so memory grows with the
    clients that have joined a round.

    Args:
      template: one client's initial state (``ClientState``; device or NumPy leaves).
      num_clients: ``N``.
    """

    kind = "host"

    def __init__(self, template: PyTree, num_clients: int):
        leaves, self.treedef = jax.tree.flatten(template)
        self.template = [np.asarray(x) for x in leaves]
        self.num_clients = num_clients
        self.arrays: list[np.ndarray] = []
        self.touched: np.ndarray | None = None
        self.bytes_per_client = bytes_per_client(self.template)
        self.non_finite: str | None = None

    def _allocate(self) -> None:
        n = self.num_clients
        self.arrays = [np.zeros((n, *x.shape), x.dtype) for x in self.template]
        self.touched = np.zeros(n, bool)

    def start(self, restored: dict | None = None, step: int | None = None) -> None:
        """Starts the store for round 0 (``restored`` None) or from a checkpoint's contents."""
        del step
        if restored is None:
            self._allocate()
            return
        # Written in place by the rounds: copied only where the restored array is read-only.
        self.arrays = [
            np.require(restored["leaves"][str(i)], requirements="W")
            for i in range(len(self.template))
        ]
        self.touched = np.require(restored["touched"], requirements="W")

    def read(self, ids: np.ndarray) -> list[np.ndarray]:
        """The rows ``ids`` of every leaf (NumPy ``[S, ...]``)."""
        fresh = ~self.touched[ids]
        rows = []
        for array, first in zip(self.arrays, self.template, strict=True):
            row = array[ids]
            if fresh.any():
                row[fresh] = first
            rows.append(row)
        return rows

    def write(self, ids: np.ndarray, rows: Sequence[np.ndarray], round_index: int) -> None:
        """Writes ``rows`` (one ``[S, ...]`` per leaf, from round ``round_index``) at ``ids``."""
        del round_index
        for array, row in zip(self.arrays, rows, strict=True):
            array[ids] = row
        self.touched[ids] = True

    def checkpoint_tree(self) -> dict | None:
        """What the orbax checkpoint saves of the store (None: nothing)."""
        return {"leaves": {str(i): a for i, a in enumerate(self.arrays)}, "touched": self.touched}

    def abstract_tree(self) -> dict | None:
        """The structure :meth:`checkpoint_tree` is restored into (NumPy leaves: host memory)."""
        n = self.num_clients
        leaves = {
            str(i): jax.ShapeDtypeStruct((n, *x.shape), x.dtype)
            for i, x in enumerate(self.template)
        }
        return {"leaves": leaves, "touched": jax.ShapeDtypeStruct((n,), np.dtype(bool))}

    def saved(self, kept_steps: Sequence[int]) -> None:
        """After a checkpoint: ``kept_steps`` are the steps orbax keeps."""

    def sync(self) -> None:
        """Makes what was written durable before a checkpoint records it."""

    def nbytes(self) -> int:
        return self.num_clients * self.bytes_per_client

    def describe(self) -> str:
        return "host memory"

    def close(self) -> None:
        """Releases what the store holds open."""


class _RowFile:
    """An ``[N, ...]`` array in a file, indexed by a list of rows like a NumPy array.

    Rows are read and written with ``pread``/``pwrite``, not through a memory map: the pages a
    map touches count in the process's resident memory until the kernel reclaims them, so a run
    over many clients would look as large as the whole store; read this way, the process holds
    the rows it asked for, and the kernel's page cache the rest.
    """

    def __init__(self, path: pathlib.Path, row_shape, dtype, num_clients: int, create: bool):
        self.row_shape, self.dtype = tuple(row_shape), np.dtype(dtype)
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        if create:  # a sparse file of zeros: no block is written until a row is
            os.ftruncate(self.fd, 0)
            os.ftruncate(self.fd, num_clients * self.row_bytes)

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), *self.row_shape), self.dtype)
        for j, i in enumerate(ids):
            data = os.pread(self.fd, self.row_bytes, int(i) * self.row_bytes)
            out[j] = np.frombuffer(data, self.dtype).reshape(self.row_shape)
        return out

    def __setitem__(self, ids: np.ndarray, rows) -> None:
        rows = np.broadcast_to(np.asarray(rows, self.dtype), (len(ids), *self.row_shape))
        for j, i in enumerate(ids):
            os.pwrite(self.fd, np.ascontiguousarray(rows[j]).tobytes(), int(i) * self.row_bytes)

    def flush(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class DiskStore(ArrayStore):
    """The ``N`` clients' states as ``[N, ...]`` files in ``directory``, read and written by row
    (``fed.client_state=disk``), consistent with the checkpoints through per-round undo files.

    Files: ``leaf_<i>.bin`` (one per leaf of ``ClientState``, C order), ``touched.bin`` (one
    byte per client: written by a round yet), ``store.json`` (the layout and the last round
    written), ``undo/<round>.npz`` (what round ``round`` overwrote).
    """

    kind = "disk"

    def __init__(self, template: PyTree, num_clients: int, directory: str | pathlib.Path):
        super().__init__(template, num_clients)
        self.directory = pathlib.Path(directory).absolute()
        _check_writable(self.directory)
        free = disk_free_bytes(self.directory) + self._existing_bytes()
        need = self.nbytes() + num_clients
        if need > free:
            raise ClientStoreError(
                f"fed.client_state=disk: {self.directory} has {_size(free)} free, and the "
                f"states of data.num_clients={num_clients} clients x {_size(self.bytes_per_client)}"
                f" take {_size(need)}; give a folder on a larger disk with "
                "--config.fed.client_state_dir=DIR."
            )
        self.undo = self.directory / "undo"

    def _existing_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.glob("*.bin"))

    def _layout(self) -> dict:
        return {
            "num_clients": self.num_clients,
            "leaves": [[list(x.shape), x.dtype.str] for x in self.template],
        }

    def _open(self, create: bool) -> None:
        self.close()
        n = self.num_clients
        self.arrays = [
            _RowFile(self.directory / f"leaf_{i}.bin", x.shape, x.dtype, n, create)
            for i, x in enumerate(self.template)
        ]
        self.touched = _RowFile(self.directory / "touched.bin", (), np.bool_, n, create)

    def close(self) -> None:
        for array in (*self.arrays, *([self.touched] if self.touched is not None else [])):
            array.close()
        self.arrays, self.touched = [], None

    def _write_meta(self, last_round: int) -> None:
        meta = {**self._layout(), "last_round": last_round}
        tmp = self.directory / "store.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self.directory / "store.json")

    def start(self, restored: dict | None = None, step: int | None = None) -> None:
        if step is None:
            # A new run: whatever a run killed before its first checkpoint left is dropped.
            shutil.rmtree(self.undo, ignore_errors=True)
            for path in self.directory.glob("*.bin"):
                path.unlink()
            self._open(create=True)
            self.undo.mkdir()
            self._write_meta(0)
            return
        try:
            meta = json.loads((self.directory / "store.json").read_text())
        except (OSError, ValueError):
            meta = None
        if meta is None or {k: meta.get(k) for k in ("num_clients", "leaves")} != self._layout():
            raise ClientStoreError(
                f"fed.client_state=disk: checkpoint {step} needs the clients' states in "
                f"{self.directory}, which lacks them or holds another layout; resume with the "
                "fed.client_state_dir the run was started with, or start a new --workdir."
            )
        self._open(create=False)
        self.rewind(step, int(meta["last_round"]))

    def rewind(self, step: int, last_round: int) -> None:
        """Puts the files back as they were after round ``step`` (``last_round``: the newest
        round whose writes may have reached them)."""
        undone = sorted(
            (int(p.stem), p)
            for p in self.undo.glob("*.npz")
            if p.stem.isdigit() and int(p.stem) > step
        )
        have = {r for r, _ in undone}
        missing = [r for r in range(step + 1, last_round + 1) if r not in have]
        if missing:
            raise ClientStoreError(
                f"fed.client_state=disk: the clients' states in {self.directory} were written up "
                f"to round {last_round}, and the record of rounds {missing[0]}..{missing[-1]} "
                f"needed to return to checkpoint {step} is gone; start a new --workdir."
            )
        for _, path in reversed(undone):
            with np.load(path) as saved:
                ids = saved["ids"]
                for i, array in enumerate(self.arrays):
                    array[ids] = saved[f"leaf_{i}"]
                self.touched[ids] = saved["touched"]
        self.sync()
        for _, path in undone:
            path.unlink()
        self._write_meta(step)

    def write(self, ids: np.ndarray, rows: Sequence[np.ndarray], round_index: int) -> None:
        # The rows this round replaces go to its undo file first, complete (renamed into place,
        # synced) before the first byte of the store changes: a run killed at any point of the
        # write leaves what a resume needs to undo it.
        old = {f"leaf_{i}": array[ids] for i, array in enumerate(self.arrays)}
        path = self.undo / f"{round_index}.npz"
        tmp = self.undo / f"{round_index}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, ids=ids, touched=np.asarray(self.touched[ids]), **old)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._write_meta(round_index)
        super().write(ids, rows, round_index)

    def checkpoint_tree(self) -> dict | None:
        return None

    def abstract_tree(self) -> dict | None:
        return None

    def sync(self) -> None:
        for array in (*self.arrays, self.touched):
            array.flush()

    def saved(self, kept_steps: Sequence[int]) -> None:
        if not kept_steps:
            return
        oldest = min(kept_steps)
        for path in self.undo.glob("*.npz"):
            if path.stem.isdigit() and int(path.stem) <= oldest:
                path.unlink()

    def describe(self) -> str:
        return str(self.directory)


def make_store(
    kind: str, template: PyTree, num_clients: int, directory: pathlib.Path
) -> ArrayStore:
    """The store of ``fed.client_state=kind`` (``"host"`` or ``"disk"``)."""
    if kind == "host":
        return ArrayStore(template, num_clients)
    return DiskStore(template, num_clients, directory)
