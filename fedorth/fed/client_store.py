"""Where the clients' persistent states live: on the device, in host memory, or on disk.

An algorithm that keeps state per client (SCAFFOLD's control variates ``c_i``, FedDyn's duals,
persistent local optimizer states, a user's ``start.Persistent`` or ``Global(keep=...)`` state)
holds one :class:`~fedorth.fed.state.ClientState` per client. ``fed.client_state`` says where
the ``N`` of them live:

* ``"device"``: stacked over ``N`` in ``ServerState.clients`` on the device; the round gathers
  the ``S`` sampled rows and scatters them back inside its compiled call.
* ``"host"``: one NumPy ``[N, ...]`` array per leaf in host memory (:class:`ArrayStore`).
* ``"disk"``: one ``[N, ...]`` file per leaf in a folder of the run, read and written by row
  (``fedorth.fed.disk_store.DiskStore``); host memory holds the sampled clients' rows only.

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

import os
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fedorth.fed import memory as fed_memory

PyTree = Any

STORES = ("auto", "device", "host", "disk")
"""The values of ``fed.client_state``."""

# What ``auto`` leaves to everything else of a run: the store takes at most this share of the
# memory (or disk) it is measured against.
FRACTION = 0.5


class ClientStoreError(RuntimeError):
    """The clients' states cannot be kept where ``fed.client_state`` says (the message is one
    line naming the key and the remedy)."""


def format_bytes(n: float) -> str:
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
    """What the host can still allocate (``fedorth.fed.memory.available_host_bytes``: the
    smaller of ``MemAvailable`` and the room under the process's ``RLIMIT_AS``), or the physical
    memory when neither is known."""
    available = fed_memory.available_host_bytes()
    if available is not None:
        return available
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
    estimate = f"{num_clients} clients x {format_bytes(per_client)} = {format_bytes(total)}"
    free_text = (
        f"free: device {format_bytes(device)}, host {format_bytes(host_free)}, "
        f"disk {format_bytes(disk_free)} ({directory})"
    )
    for kind, free in (("device", device), ("host", host_free), ("disk", disk_free)):
        if total <= FRACTION * free:
            return kind, f"fed.client_state=auto: {kind} ({estimate}; {free_text})."
    raise ClientStoreError(
        f"The clients' states fit nowhere: data.num_clients={num_clients} clients x "
        f"{format_bytes(per_client)} per client = {format_bytes(total)} ({free_text}). Remedies: "
        "--config.fed.client_state=disk with --config.fed.client_state_dir on a larger disk, "
        "fewer clients (data.num_clients), or an algorithm that keeps no per-client state."
    )


def check_writable(directory: pathlib.Path) -> None:
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
