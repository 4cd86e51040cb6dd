"""``curves.png``: loss and accuracy (or AUC) against rounds, from ``metrics.jsonl``.

The loop rewrites it at every evaluation (a long run's curves can be watched) and at the end.
Every point has a marker, so a short run (or the round-0 evaluation alone) is visible. Rows may
lack a key (round 0 has no ``train_loss``: no local step ran): each curve uses the rows that
have it.
"""

from __future__ import annotations

import io
import pathlib
from collections.abc import Sequence
from typing import Any

from fedorth.train import workdir


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(row["round"], row[key]) for row in rows if key in row]
    return [p[0] for p in points], [p[1] for p in points]


def save_curves(rows: Sequence[dict[str, Any]], path: str | pathlib.Path, title: str = "") -> None:
    """Plots train/test loss and test accuracy/AUC/recall@5 against the round into ``path``.

    Written to a temporary file, then renamed: a viewer never reads a half-written PNG.
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    path = pathlib.Path(path)
    scores = ("test_auc", "test_recall_at_5")  # the AUC model's, a multi-label model's
    score = next((k for k in scores if any(k in row for row in rows)), "test_accuracy")
    fig = Figure(figsize=(10, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for key, marker in (("train_loss", "o"), ("test_loss", "s")):
        x, y = _series(rows, key)
        if x:
            ax_loss.plot(x, y, marker=marker, markersize=4, label=key.replace("_", " "))
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("loss")
    if ax_loss.lines:
        ax_loss.legend()
    x, y = _series(rows, score)
    if x:
        ax_acc.plot(x, y, marker="o", markersize=4, color="C2")
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel(score.replace("_", " "))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    # Fixed margins, room for the tick labels and the title: ``tight_layout`` measures every
    # text first, a third of the redraw's CPU time, at every evaluation of every run.
    fig.subplots_adjust(
        left=0.08, right=0.98, bottom=0.12, top=0.88 if title else 0.95, wspace=0.22
    )
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=100, format="png")
    workdir.write_atomic(path, buffer.getvalue())  # never through a symbolic link


class CurvePlotter:
    """Redraws ``curves.png`` in a background thread at every evaluation.

    A redraw takes ~0.2 s of CPU; in the training thread it would stall every evaluation.
    :meth:`update` hands the rows to one daemon thread and returns at once; evaluations that
    come while a redraw runs are coalesced into one redraw of the newest rows. :meth:`close`
    waits until the newest rows are drawn (the loop calls it before returning).
    """

    def __init__(self, path: str | pathlib.Path, title: str = ""):
        import threading

        self.path, self.title = pathlib.Path(path), title
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] | None = None
        self._thread: threading.Thread | None = None
        self.drawn = 0  # redraws done (tests)
        self.error: BaseException | None = None

    def update(self, rows: Sequence[dict[str, Any]]) -> None:
        import threading

        with self._lock:
            self._pending = [dict(r) for r in rows]
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="curves", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                rows, self._pending = self._pending, None
                if rows is None:
                    self._thread = None
                    return
            try:
                save_curves(rows, self.path, self.title)
                self.drawn += 1
            except Exception as e:  # noqa: BLE001 -- a plot must never stop a run
                self.error = e

    def wait(self) -> None:
        """Waits for the newest rows to be drawn."""
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join()

    def close(self) -> None:
        """Waits for the newest rows to be drawn; re-raises a drawing error."""
        self.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
