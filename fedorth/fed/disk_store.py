"""The ``disk`` client-state store (``fed.client_state=disk``): ``[N, ...]`` files read and
written by row, consistent with the checkpoints through per-round undo files
(``fedorth.fed.client_store`` describes the stores)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedorth.fed.client_store import (
    ArrayStore,
    ClientStoreError,
    check_writable,
    disk_free_bytes,
    format_bytes,
)

PyTree = Any


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
        check_writable(self.directory)
        free = disk_free_bytes(self.directory) + self._existing_bytes()
        need = self.nbytes() + num_clients
        if need > free:
            raise ClientStoreError(
                f"fed.client_state=disk: {self.directory} has {format_bytes(free)} free, and the "
                f"states of data.num_clients={num_clients} clients x "
                f"{format_bytes(self.bytes_per_client)} take {format_bytes(need)}; give a folder "
                "on a larger disk with --config.fed.client_state_dir=DIR."
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
