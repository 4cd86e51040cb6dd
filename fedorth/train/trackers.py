"""Experiment trackers: where a run's config, scalars and files go besides its folder.

``config.trackers`` names them, comma-separated (``configs/base.py``: ``"tensorboard"``):

* ``tensorboard``: TensorBoard event files in ``WORKDIR/tensorboard`` (tensorboardX), written
  with ``metrics.jsonl`` by :class:`fedorth.train.logging_utils.MetricsWriter`;
* ``mlflow``: one MLflow run per fedorth run (the ``[mlflow]`` extra), in the tracking store
  ``config.mlflow_uri``: a local SQLite file by default (``sqlite:///<workdir's parent>/mlflow.db``,
  which ``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`` opens), or a tracking server's
  ``http(s)://`` address. A sweep logs each replica as its own run under one parent run (MLflow's
  ``mlflow.parentRunId``), so the UI groups them.

``metrics.jsonl`` is always written: it is the run's record, which resumes, ``experiments.report``
and the tables read. A tracker is a copy of it for viewing: a tracker that fails during a run
(a tracking server going down) is said once and dropped, and the run goes on.

A tracker receives the run's config once (:meth:`Tracker.start`, with the rows a resumed run
keeps), each evaluated round's row (:meth:`Tracker.log_scalars`), the run's files when it finishes
(:meth:`Tracker.log_files`) and :meth:`Tracker.close` at the end, finished or not. A resumed run
continues its MLflow run (its id is kept in ``WORKDIR/mlflow_run.json``); rounds that a resume
computes again are logged again at the same step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pathlib
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fedorth.train.workdir import write_atomic

TRACKERS = ("tensorboard", "mlflow")
# Config keys of where a run's outputs are tracked, not of the run: a run resumes with others.
OUTPUT_KEYS = ("trackers", "mlflow_uri", "mlflow_experiment")
RUN_FILE = "mlflow_run.json"  # the MLflow run of a run folder (or a sweep's parent run)
MLFLOW_EXPERIMENT = "fedorth"
# MLflow's limits: a param value of at most 6000 characters, 100 params per batch call.
_PARAM_VALUE_LIMIT = 6000


class TrackerError(ValueError):
    """A tracker that cannot start: MLflow missing, a tracking store that cannot be reached."""


class Tracker:
    """What a tracker is told; each method does nothing unless overridden."""

    def start(self, config: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> None:
        """The run starts (or resumes): its config, and the ``metrics.jsonl`` rows it keeps."""

    def log_scalars(self, row: Mapping[str, Any]) -> None:
        """One evaluated round's row of ``metrics.jsonl`` (``row["round"]`` is the step)."""

    def log_files(self, paths: Iterable[pathlib.Path]) -> None:
        """The run's files, when it has finished."""

    def close(self, finished: bool) -> None:
        """The run ends: ``finished`` unless it stopped (a signal, an error)."""


class Composite(Tracker):
    """Several trackers as one. One that raises is said once (with the error) and dropped: a
    tracker never stops a run."""

    def __init__(self, trackers: Sequence[Tracker] = ()):
        self.trackers = list(trackers)

    def _each(self, method: str, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001 -- a viewer's copy must never stop the run
                self.trackers.remove(tracker)
                logging.warning(
                    "%s failed (%s: %s); it is dropped for the rest of the run. metrics.jsonl "
                    "holds every row.",
                    type(tracker).__name__,
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                )

    def start(self, config, rows) -> None:
        self._each("start", config, rows)

    def log_scalars(self, row) -> None:
        self._each("log_scalars", row)

    def log_files(self, paths) -> None:
        self._each("log_files", list(paths))

    def close(self, finished: bool) -> None:
        self._each("close", finished)
        self.trackers = []


def names(config) -> list[str]:
    """The trackers ``config.trackers`` names (``""``: none besides ``metrics.jsonl``)."""
    value = config.get("trackers", "tensorboard")
    if isinstance(value, (list, tuple)):
        value = ",".join(value)
    return [name.strip() for name in str(value).split(",") if name.strip()]


def check(config) -> list[str]:
    """Problems of ``config.trackers`` and ``config.mlflow_uri``, one line each (nothing is
    imported or reached: :func:`make` does that)."""
    problems = []
    known = [*TRACKERS, *_REGISTERED]
    unknown = [name for name in names(config) if name not in known]
    if unknown:
        problems.append(
            f"trackers={config.get('trackers')!r} names {unknown}; valid: a comma-separated "
            f"list of {known} (metrics.jsonl is always written)."
        )
    uri = config.get("mlflow_uri", None)
    if uri:
        scheme = urllib.parse.urlparse(str(uri)).scheme
        if scheme not in ("sqlite", "http", "https", "file", "databricks", "postgresql", "mysql"):
            problems.append(
                f"mlflow_uri={uri!r} is not a tracking URI; valid: sqlite:///PATH/mlflow.db (a "
                "local store), http(s)://HOST:PORT (a tracking server), or file:///PATH."
            )
    return problems


_REGISTERED: dict[str, Any] = {}


def register(name: str, factory) -> None:
    """Makes ``config.trackers`` accept ``name``: ``factory(config, workdir)`` returns the
    :class:`Tracker` of the run folder ``workdir`` (called by process 0 of a run, and for each
    replica of a sweep)."""
    if name in TRACKERS:
        raise ValueError(f"tracker {name!r} is built in; register another name.")
    _REGISTERED[name] = factory


def default_mlflow_uri(workdir: pathlib.Path) -> str:
    """``sqlite:///<workdir's parent>/mlflow.db``: every run under one folder in one store."""
    return f"sqlite:///{pathlib.Path(workdir).expanduser().absolute().parent / 'mlflow.db'}"


def make_parent(
    config, state_dir: pathlib.Path, sweep_dir: pathlib.Path | None = None
) -> MlflowRun | None:
    """A sweep's parent run, under which each replica's run is logged (None without MLflow).

    Args:
      config: the sweep's base config.
      state_dir: where the sweep keeps its state (the run's ``mlflow_run.json`` goes there): the
        sweep's folder, or one job's ``shard_i_of_n`` folder in it.
      sweep_dir: the sweep's folder (default ``state_dir``): the default store is beside it, and
        the parent run is named after it (and the job's folder, for one job of a sharded grid).

    Raises:
      TrackerError: as :func:`make`.
    """
    if "mlflow" not in names(config):
        return None
    state_dir = pathlib.Path(state_dir)
    sweep_dir = pathlib.Path(sweep_dir or state_dir)
    store = MlflowStore.open(config, sweep_dir)
    name = sweep_dir.name if state_dir == sweep_dir else f"{sweep_dir.name}/{state_dir.name}"
    return MlflowRun(store, state_dir, name, tags={"fedorth.sweep": "1"})


def make(
    config,
    workdir: pathlib.Path,
    *,
    run_name: str | None = None,
    parent: MlflowRun | None = None,
) -> Composite:
    """The trackers of ``config`` besides TensorBoard (which ``MetricsWriter`` writes), for the
    run folder ``workdir``.

    Raises:
      TrackerError: MLflow named but not installed, or its store cannot be reached.
    """
    trackers: list[Tracker] = []
    if "mlflow" in names(config):
        store = parent.store if parent is not None else MlflowStore.open(config, workdir)
        trackers.append(
            MlflowRun(store, workdir, run_name or pathlib.Path(workdir).name, parent=parent)
        )
    trackers += [
        _REGISTERED[name](config, workdir) for name in names(config) if name in _REGISTERED
    ]
    return Composite(trackers)


# ---------------------------------------------------------------------------------- MLflow


def _import_mlflow():
    try:
        import mlflow  # noqa: F401
        from mlflow.tracking import MlflowClient
    except ImportError as e:
        raise TrackerError(
            f"config.trackers names 'mlflow' but MLflow is not installed ({e}): pip install "
            "'fedorth[mlflow]', or drop mlflow from config.trackers."
        ) from None
    return MlflowClient


@contextlib.contextmanager
def _quick_http():
    """One try of at most 10 s per request while a store is probed (MLflow's default retries a
    dead server for minutes)."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                                            "MLFLOW_HTTP_REQUEST_TIMEOUT")}  # fmt: skip
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "10"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class MlflowStore:
    """A tracking store and its experiment (``config.mlflow_experiment``, default "fedorth")."""

    def __init__(self, client, uri: str, experiment_id: str):
        self.client, self.uri, self.experiment_id = client, uri, experiment_id

    @classmethod
    def open(cls, config, workdir: pathlib.Path) -> MlflowStore:
        """The store of ``config.mlflow_uri`` (default :func:`default_mlflow_uri`), reached once
        here so that a wrong address stops the run before it trains.

        Raises:
          TrackerError: MLflow is missing, or the store cannot be reached or written.
        """
        client_cls = _import_mlflow()
        uri = str(config.get("mlflow_uri", None) or default_mlflow_uri(workdir))
        experiment = str(config.get("mlflow_experiment", None) or MLFLOW_EXPERIMENT)
        if uri.startswith("sqlite:///"):
            path = pathlib.Path(uri[len("sqlite:///") :]).expanduser()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                why = "a file is in its place" if isinstance(e, FileExistsError) else e.strerror
                raise TrackerError(
                    f"config.mlflow_uri={uri!r}: cannot create the store's folder {path.parent} "
                    f"({why}); give a writable sqlite:///PATH/mlflow.db."
                ) from None
        # MLflow logs its store's migrations at INFO; a run's stderr is for the run.
        for name in ("alembic", "mlflow"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            with _quick_http():
                client = client_cls(tracking_uri=uri)
                found = client.get_experiment_by_name(experiment)
                if found is not None:
                    experiment_id = found.experiment_id
                else:
                    # A local store keeps its files beside it (MLflow's default is ./mlruns of
                    # whatever folder the command runs in).
                    artifacts = (
                        (path.parent / "mlartifacts").absolute().as_uri()
                        if uri.startswith("sqlite:///")
                        else None
                    )
                    experiment_id = client.create_experiment(
                        experiment, artifact_location=artifacts
                    )
        except Exception as e:  # noqa: BLE001 -- MLflow raises many kinds for one cause
            text = str(e)
            if any(word in text for word in ("NewConnectionError", "Connection refused",
                                             "Max retries exceeded")):  # fmt: skip
                first = "nothing answers there"
            else:
                first = (text.strip().splitlines() or [type(e).__name__])[0][:200]
            raise TrackerError(
                f"config.mlflow_uri={uri!r} cannot be reached ({first}): start the tracking "
                "server, or use a local store, e.g. --config.mlflow_uri=sqlite:///runs/mlflow.db "
                "(or drop mlflow from config.trackers)."
            ) from None
        return cls(client, uri, experiment_id)


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, name + "."))
        else:
            text = json.dumps(value, default=str) if not isinstance(value, str) else value
            out[name] = text[:_PARAM_VALUE_LIMIT]
    return out


def _scalars(row: Mapping[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in row.items()
        if key != "round"
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    }


class MlflowRun(Tracker):
    """One fedorth run as one MLflow run; its id is kept in ``WORKDIR/mlflow_run.json``, so a
    resumed run continues it. With ``parent`` (a sweep's run), the run is its child."""

    def __init__(
        self,
        store: MlflowStore,
        workdir: pathlib.Path,
        name: str,
        *,
        parent: MlflowRun | None = None,
        tags: Mapping[str, str] | None = None,
    ):
        self.store, self.workdir = store, pathlib.Path(workdir)
        client = store.client
        self.run_id = self._saved_run_id()
        if self.run_id is not None:
            client.update_run(self.run_id, status="RUNNING")
            self.resumed = True
        else:
            tags = dict(tags or {})
            tags["fedorth.workdir"] = str(self.workdir.absolute())
            if parent is not None:
                tags["mlflow.parentRunId"] = parent.run_id
            run = client.create_run(store.experiment_id, run_name=name, tags=tags)
            self.run_id = run.info.run_id
            self.resumed = False
            write_atomic(
                self.workdir / RUN_FILE,
                json.dumps({"tracking_uri": store.uri, "run_id": self.run_id}) + "\n",
            )

    def _saved_run_id(self) -> str | None:
        """The run of an earlier try of this folder, in the same store (else None)."""
        try:
            saved = json.loads((self.workdir / RUN_FILE).read_text())
            if saved.get("tracking_uri") != self.store.uri:
                return None
            run = self.store.client.get_run(saved["run_id"])
            return run.info.run_id if run.info.lifecycle_stage == "active" else None
        except Exception:  # noqa: BLE001 -- no file, another store, a deleted run: a new run
            return None

    def start(self, config, rows) -> None:
        client = self.store.client
        params = _flat(config)
        logged = client.get_run(self.run_id).data.params
        # MLflow never changes a param: a resumed run (an extension's fed.rounds) keeps the
        # first value and says the new one in a tag.
        new = {k: v for k, v in params.items() if k not in logged}
        changed = {f"resumed_with.{k}": v for k, v in params.items() if logged.get(k, v) != v}
        items = sorted(new.items())
        from mlflow.entities import Param, RunTag

        for start in range(0, len(items), 100):
            batch = [Param(k, v) for k, v in items[start : start + 100]]
            client.log_batch(self.run_id, params=batch)
        if changed:
            client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in changed.items()])
        # The kept rows the store lacks (a run that adds MLflow when it resumes).
        first = next((r for r in rows if _scalars(r)), None)
        if first is not None:
            key = next(iter(_scalars(first)))
            have = {m.step for m in client.get_metric_history(self.run_id, key)}
            for row in rows:
                if int(row["round"]) not in have:
                    self.log_scalars(row)

    def log_scalars(self, row) -> None:
        from mlflow.entities import Metric

        step = int(row["round"])
        stamp = _now_ms()
        metrics = [Metric(k, v, stamp, step) for k, v in _scalars(row).items()]
        self.store.client.log_batch(self.run_id, metrics=metrics)

    def log_files(self, paths) -> None:
        for path in paths:
            path = pathlib.Path(path)
            if path.is_file():
                self.store.client.log_artifact(self.run_id, str(path))

    def close(self, finished: bool) -> None:
        self.store.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


def _now_ms() -> int:
    return int(time.time() * 1000)


def finished_files(workdir: pathlib.Path) -> list[pathlib.Path]:
    """What a finished run gives its trackers: its config, metrics, curves and run info."""
    names_ = ("config.json", "metrics.jsonl", "run_info.json", "curves.png")
    return [pathlib.Path(workdir) / name for name in names_]
