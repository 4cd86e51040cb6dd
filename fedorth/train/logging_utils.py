"""Run outputs: ``metrics.jsonl``, TensorBoard event files (tensorboardX), a progress line.

``metrics.jsonl`` is the run's result, so nothing in it is dropped without a copy: when a run
resumes, the rows up to the restored checkpoint's round are kept (the rounds after it are
computed again, to the same values); a line that is not a JSON row (cut by a kill, garbled, not
UTF-8), or a second row of a round, is moved to ``metrics.jsonl.corrupt-<time>`` beside it; and
a row missing up to that round is rebuilt from the TensorBoard events when they hold it. Each of
these is said in one line. TensorBoard's events are then rewritten from ``metrics.jsonl``, so
after any resume they hold one value per round, as ``metrics.jsonl`` does.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import pathlib
import struct
import sys
import time
from typing import Any

from fedorth.train.workdir import WorkdirError, append_own, write_atomic

_EVENTS_GLOB = "events.out.tfevents.*"


def _parse(text: bytes) -> dict[str, Any] | None:
    """The row a ``metrics.jsonl`` line holds, or ``None`` if it holds none."""
    try:
        row = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(row, dict) or type(row.get("round")) is not int:
        return None
    return row


def read_metrics(path: pathlib.Path) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The rows of a ``metrics.jsonl`` file and its lines that hold no row.

    Returns:
      ``(rows, unreadable)``: the rows in file order (one per round: a second row of a round
      counts as unreadable) and the raw lines that are not a JSON object with an integer
      ``round``.
    """
    if not path.exists():
        return [], []
    rows, unreadable, seen = [], [], set()
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        row = _parse(line)
        if row is None or row["round"] in seen:
            unreadable.append(line)
            continue
        seen.add(row["round"])
        rows.append(row)
    return rows, unreadable


def read_scalars(logdir: pathlib.Path) -> list[tuple[str, int, float]]:
    """Every scalar ``(tag, step, value)`` in the TensorBoard event files under ``logdir``.

    Reads the TFRecord framing (length, its CRC, the record, its CRC) and stops at a file's
    first cut or unreadable record (a writer killed mid-record). Files in name (time) order.
    """
    event_pb2 = import_tensorboardx().proto.event_pb2

    out = []
    for path in sorted(logdir.glob(_EVENTS_GLOB)) if logdir.is_dir() else []:
        raw = path.read_bytes()
        at = 0
        while at + 12 <= len(raw):
            (length,) = struct.unpack("<Q", raw[at : at + 8])
            if at + 12 + length + 4 > len(raw):
                break
            try:
                event = event_pb2.Event.FromString(raw[at + 12 : at + 12 + length])
            except Exception:  # noqa: BLE001 -- protobuf's DecodeError: a damaged record
                break
            at += 12 + length + 4
            for value in event.summary.value:
                out.append((value.tag, int(event.step), float(value.simple_value)))
    return out


class MetricsWriter:
    """Appends one JSON object per evaluated round to ``workdir/metrics.jsonl``, and its scalars
    to TensorBoard's event files in ``workdir/tensorboard``.

    Raises:
      WorkdirError: ``workdir/tensorboard`` exists and is not a folder.
    """

    def __init__(
        self,
        workdir: pathlib.Path,
        *,
        tensorboard: bool = True,
        trackers: Any = None,
        config: dict[str, Any] | None = None,
    ):
        """Args:
        workdir: the run's folder.
        tensorboard: write TensorBoard's events (``config.trackers`` names ``tensorboard``).
        trackers: a :class:`fedorth.train.trackers.Composite` of the other trackers, told the
          run's ``config`` and rows too.
        config: the run's config, for the trackers.
        """
        self.tensorboard = tensorboard
        self.trackers = trackers
        self.config = config or {}
        self._finished = False
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self.logdir = pathlib.Path(workdir) / "tensorboard"
        if self.logdir.exists() and not self.logdir.is_dir():
            raise WorkdirError(
                f"{self.logdir} is a file; the run writes its TensorBoard events into a folder "
                "of that name: move the file away (or delete it) and rerun."
            )
        self._tb = None

    def rows(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)[0]

    def resume(
        self, round_index: int, exact: dict[str, float] | None = None
    ) -> list[dict[str, Any]]:
        """Makes ``metrics.jsonl`` and the TensorBoard events those of a run that has just ended
        round ``round_index`` (``-1``: a run that has not started), and opens the events.

        Rows after ``round_index`` are dropped (the resumed run computes them again, to the same
        values); unreadable lines and second rows of a round are moved to
        ``metrics.jsonl.corrupt-<time>``; rows up to ``round_index`` that the file lacks are
        rebuilt from the TensorBoard events when those hold them (float32 copies: exact for the
        metrics computed in float32; ``exact`` gives fields known exactly, e.g. the
        communication per round). One warning line for each of these.

        Returns:
          The rows kept, in round order.
        """
        rows, unreadable = read_metrics(self.path)
        if unreadable:
            aside = self.path.with_name(
                f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
            )
            append_own(aside, b"".join(line + b"\n" for line in unreadable))
            logging.warning(
                "%s: %d line(s) hold no readable row (cut by a kill, garbled, not UTF-8, or a "
                "second row of a round); moved to %s, the %d readable rows are kept.",
                self.path,
                len(unreadable),
                aside,
                len(rows),
            )
        kept = {row["round"]: row for row in rows if row["round"] <= round_index}
        rebuilt = self._rebuild_from_events(kept, round_index, exact or {})
        if rebuilt:
            logging.warning(
                "%s lacked the rows of rounds %s; rebuilt them from the TensorBoard events in %s "
                "(float32 copies: exact for the losses and accuracies, wall_s rounded).",
                self.path,
                _ranges(rebuilt),
                self.logdir,
            )
        kept_rows = [kept[r] for r in sorted(kept)]
        text = "".join(json.dumps(row) + "\n" for row in kept_rows)
        link = self.path.is_symlink()
        if link or not self.path.exists() or self.path.read_text(errors="replace") != text:
            # Write then rename (a kill during the rewrite must not lose the kept rows); the
            # rename replaces a link in the place of the file, never its target.
            write_atomic(self.path, text)
        if self.tensorboard:
            self._rewrite_events(kept_rows)
        if self.trackers is not None:
            self.trackers.start(self.config, kept_rows)
        return kept_rows

    def _rebuild_from_events(
        self, kept: dict[int, dict[str, Any]], round_index: int, exact: dict[str, float]
    ) -> list[int]:
        if round_index < 0 or not self.logdir.is_dir():
            return []
        found: dict[int, dict[str, float]] = {}
        for tag, step, value in read_scalars(self.logdir):
            if step <= round_index and step not in kept:
                found.setdefault(step, {})[tag] = value
        # The key order of the fullest kept row (a round-0 row lacks train_loss), for a file
        # whose rows read alike.
        order = dict.fromkeys(max(kept.values(), key=len, default={}))
        order.update(dict.fromkeys(k for row in kept.values() for k in row))
        for step, values in found.items():
            row = {"round": step, **values}
            row.update({k: v for k, v in exact.items() if k in row})
            keys = [k for k in order if k in row] + [k for k in row if k not in order]
            kept[step] = {k: row[k] for k in keys}
        return sorted(found)

    def _rewrite_events(self, rows: list[dict[str, Any]]) -> None:
        """Rewrites TensorBoard's events as ``rows`` (one file), then opens a file for the rows
        to come. The older event files are removed once the new one is complete: a kill in
        between leaves both, and the next start rewrites them again."""
        old = sorted(self.logdir.glob(_EVENTS_GLOB)) if self.logdir.is_dir() else []
        if not rows and not old:
            self._tb = _tensorboard_writer(self.logdir)
            return
        writer = _tensorboard_writer(self.logdir)
        if writer is None:
            return
        for row in rows:
            _add_scalars(writer, row)
        writer.close()  # tensorboardX writes through a queue and a thread: close() drains both
        for path in old:
            path.unlink(missing_ok=True)
        self._tb = _tensorboard_writer(self.logdir)

    def write(self, row: dict[str, Any]) -> None:
        append_own(self.path, (json.dumps(row) + "\n").encode())
        if self._tb is not None:
            _add_scalars(self._tb, row)
            self._tb.flush()
        if self.trackers is not None:
            self.trackers.log_scalars(row)

    def finish(self, files) -> None:
        """The run has finished: its ``files`` go to the trackers."""
        self._finished = True
        if self.trackers is not None:
            self.trackers.log_files(files)

    def close(self) -> None:
        """Writes TensorBoard's pending events (tensorboardX's ``flush`` does not wait for its
        writer thread; events otherwise reach the file within ``flush_secs``), and ends the
        trackers' run (finished, or stopped)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.trackers is not None:
            self.trackers.close(self._finished)
            self.trackers = None


def _ranges(rounds: list[int]) -> str:
    return ", ".join(str(r) for r in rounds[:10]) + (
        f" and {len(rounds) - 10} more" if len(rounds) > 10 else ""
    )


def _add_scalars(writer, row: dict[str, Any]) -> None:
    for key, value in row.items():
        if key != "round" and isinstance(value, int | float) and math.isfinite(value):
            writer.add_scalar(key, value, row["round"])


_writers = iter(range(1 << 62))


def import_tensorboardx():
    """The ``tensorboardX`` package, imported without PyTorch.

    tensorboardX's writer module imports torch whenever it is installed (the ``[bench]`` extra
    installs it), only to accept torch tensors, which fedorth never passes: 1.6 s of a run's
    start on 2 CPU cores. While tensorboardX loads, ``import torch`` fails as if torch were
    absent (tensorboardX then takes NumPy arrays only); torch imported before stays as it is.
    """
    if "tensorboardX.writer" in sys.modules or "torch" in sys.modules:
        import tensorboardX

        return tensorboardX
    sys.modules["torch"] = None  # Python's way to make an import fail as not installed
    try:
        import tensorboardX
        import tensorboardX.proto.event_pb2  # noqa: F401
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tensorboardX


def _tensorboard_writer(logdir: pathlib.Path):
    """TensorBoard event files through tensorboardX (a dependency of fedorth; it needs no
    TensorFlow). View them with ``tensorboard --logdir WORKDIR/tensorboard``.

    Each writer gets its own file (tensorboardX names files by the second and the host; the
    suffix keeps two writers of one second apart)."""
    try:
        SummaryWriter = import_tensorboardx().SummaryWriter  # noqa: N806
    except ImportError:  # an install without its dependencies: metrics.jsonl is still written
        return None
    # flush_secs: watchable while the run goes on.
    suffix = f".{os.getpid()}.{next(_writers)}"
    return SummaryWriter(str(logdir), flush_secs=5, filename_suffix=suffix)


class ClosedOutputSafe:
    """A text stream (``sys.stdout``, ``sys.stderr``) whose reader may go away (``... | head``):
    on the first broken pipe, the stream's file descriptor is pointed at ``os.devnull``, so the
    run goes on, writing its files, without output, and exits as it would have.
    """

    def __init__(self, stream):
        self._stream = stream

    def _closed(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()
            self._stream.flush()  # what was buffered goes to os.devnull

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def exit_now(code: int) -> None:
    """Flushes ``sys.stdout`` and ``sys.stderr`` and ends the process with ``code``, skipping
    the interpreter's teardown: after a Ctrl-C, a compilation or a save it cut short may still
    run in a thread, and tearing the interpreter down under it can crash (or print a thread's
    traceback after the one-line message)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` (or ``m:ss`` under an hour) of a non-negative number of seconds."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """A one-line progress bar on stderr: round, loss, accuracy, recent rounds/s and the ETA.

    The rate is over the last ``window`` rounds, timed from the end of the first round this
    process ran: that round includes the compilation, which later rounds do not pay, so it would
    make both the rate and the ETA wrong. Until two rounds have ended the line shows
    ``compiling`` in their place. On a terminal the line is rewritten every round; otherwise
    (a log file) one line is written per evaluation.
    """

    def __init__(self, total: int, start: int = 0, stream=None, window: int = 20, clock=None):
        self.total, self.start = total, start
        self.stream = stream or sys.stderr
        self.clock = clock or time.perf_counter
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last: dict[str, Any] = {}
        self.times: collections.deque[tuple[int, float]] = collections.deque(maxlen=window + 1)

    def rate(self) -> float | None:
        """Rounds per second over the recent window (``None`` before two rounds ended)."""
        if len(self.times) < 2:
            return None
        (r0, t0), (r1, t1) = self.times[0], self.times[-1]
        return (r1 - r0) / max(t1 - t0, 1e-9)

    def update(self, round_index: int, row: dict[str, Any] | None = None) -> None:
        if round_index > self.start and (not self.times or self.times[-1][0] != round_index):
            self.times.append((round_index, self.clock()))
        if row:
            self.last = row
        if not (self.tty or row):
            return
        width = 24
        filled = int(width * round_index / max(self.total, 1))
        parts = [f"[{'#' * filled}{'.' * (width - filled)}] round {round_index}/{self.total}"]
        for key in ("train_loss", "test_loss", "test_accuracy", "test_auc", "test_recall_at_5"):
            if key in self.last:
                parts.append(f"{key} {self.last[key]:.4f}")
        rate = self.rate()
        if round_index >= self.total:
            pass
        elif rate is None:
            parts.append("compiling" if round_index <= self.start + 1 else "")
        else:
            eta = (self.total - round_index) / max(rate, 1e-12)
            parts.append(f"{rate:.2f} rounds/s | ETA {format_duration(eta)}")
        line = " | ".join(p for p in parts if p)
        end = "\n" if row or round_index == self.total else ""
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()
