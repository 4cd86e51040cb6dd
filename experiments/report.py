r"""Tabulates and plots several runs: one row per config, its runs aggregated over their seed.

    python -m experiments.report runs/fedavg_s42 runs/fedavg_s43 runs/fedpac_soap_s42 ...
    python -m experiments.report runs/ --out report.md
    python -m experiments.report runs/ --no-plot

Each ``DIR`` is a run folder (``config.json`` + ``metrics.jsonl``, as written by
``python -m experiments.main`` or by each replica of ``python -m experiments.sweep``) or a folder
searched recursively for run folders.

Runs are averaged only within one config: runs whose configs are equal in every key but ``seed``
(and ``data.data_dir``, where the data sit) are one group, and any other difference (a learning
rate, K, ...) splits the group and is named in the row's label. Runs of one group made by
different code versions (``run_info.json``'s ``git_commit``) are named under the table. For each
group the table gives, over its runs (one per seed):

* the final test accuracy (``test_auc`` when the runs log it) and test loss as mean ± std, in the
  papers' style (accuracy in %); std is the sample standard deviation (ddof = 1), omitted for a
  single run;
* the round they are read at: the last evaluated round that every run of the group reached (an
  unfinished run does not bias the mean with an earlier round);
* the communication per round in MB (up + down for every sampled client, ``comm_mb_round``).

A run that did not reach ``fed.rounds`` is named under the table with what happened (failed
before its first evaluation, diverged, stopped at round r of R), and its group's round reads
``failed`` or ``r (incomplete)``. A run diverged when its folder holds ``diverged.json`` (a sweep's
replica that diverged) or its metrics hold a non-finite value: its group's row reads
``diverged`` in place of numbers (a mean over the seeds that survived would flatter the config).

Damaged input is read around, and said: a line of ``metrics.jsonl`` that holds no row (garbled,
cut by a kill, not UTF-8, a second row of a round, a field that is not a number) is skipped with
a warning naming the file and the line, and the rest of the file is read, as the run itself does
when it resumes; a run folder whose ``config.json`` cannot be read is left out of the table, with
a warning and a line under the table. Each warning is printed once, on stderr, in one line.

Two runs of a group with the same ``seed`` are the same experiment, not two seeds: the report
keeps one of them (the one with the most evaluated rounds) and warns, naming both folders,
instead of counting it twice (which would show a spurious ``± 0.00``).

Selection as the papers do it: when the runs log a validation split (``data.validation_fraction``:
``val_accuracy`` or ``val_auc``), a second table picks, for each method (configs equal but for
the seed and the learning rate), the learning rate with the best mean validation score and gives
the test score (mean ± std over seeds) at that rate, with every candidate's validation score
beside (``--select KEY`` picks another config key). A diverged candidate is never picked.
Candidates whose scores average other seeds, or are read at another round, are named under the
table. A value picked at the edge of its grid (the smallest or the largest tried) is flagged: the
optimum may lie outside the grid.

The figure (``report.png`` and ``report.pdf``, written beside the runs: in the folder the ``DIR``
arguments share, or beside ``--out``; ``--plot PATH`` writes it elsewhere, an SVG for a ``PATH``
ending in ``.svg``; ``--no-plot`` skips it) has one row of panels per setting: test accuracy (or
AUC) and training loss against rounds, and against the MB communicated so far (``comm_mb_round``
times the rounds run), each curve the mean over seeds with a band of ± 1 sample std.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

import numpy as np

# Generic algorithms whose local optimizer is a free choice: their label names it.
_GENERIC = ("fedavg", "fedavgm", "fedadam", "scaffold", "fedcm", "fedpac")
# (algorithm, local optimizer, fed.options.server_opt) -> the name its paper gives it
# (configs/fedyogi.py, fedadagrad.py, diloco.py, muloco.py).
_SERVER_OPT_NAMES = {
    ("fedavg", "sgd", "yogi"): "fedyogi",
    ("fedavg", "sgd", "adagrad"): "fedadagrad",
    ("fedavg", "adamw", "nesterov"): "diloco",
    ("fedavg", "muon", "nesterov"): "muloco",
}
# Config fields that do not define a run's setting (seeds are aggregated; paths are local; where
# the outputs are tracked: fedorth.train.trackers.OUTPUT_KEYS, not imported: it loads JAX).
_IGNORED = ("seed", "data.data_dir", "trackers", "mlflow_uri", "mlflow_experiment")
# The partitioners' second names (fedorth.data.partition.PARTITIONERS, not imported: it loads
# JAX), so that a config naming either is the same setting.
_PARTITION_ALIASES = {"dirichlet": "dirichlet_label_split", "dirichlet_hsu": "dirichlet_client_mix"}
# What a sweep's replica writes in its folder when it diverges (fedorth.sweep.runner).
DIVERGED_FILE = "diverged.json"
# Required and optional config fields the report reads, with their JSON types.
_REQUIRED = (("fed", dict), ("data", dict), ("fed.algorithm", str), ("data.name", str))
_OPTIONAL = (
    ("fed.rounds", int),
    ("fed.clients_per_round", int),
    ("data.partition", str),
    ("data.alpha", (int, float)),
    ("model", dict),
    ("model.name", str),
    ("optim", dict),
    ("optim.name", str),
)
_JSON_TYPES = {dict: "an object", str: "a string", int: "an integer", (int, float): "a number"}


class ReportError(Exception):
    """A damaged input or a bad flag, said in one line (exit code 2 from the command line)."""


class RunsNotFoundError(ReportError, FileNotFoundError):
    """A ``DIR`` that is not a folder, or folders without any run folder."""


class Notes:
    """The warnings of one report: each printed once, in one line, on ``stream`` (stderr)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self.warnings: list[str] = []
        self.left_out: list[tuple[pathlib.Path, str]] = []  # run folders that could not be read

    def warn(self, message: str) -> None:
        if message in self.warnings:
            return
        self.warnings.append(message)
        print(f"warning: {message}", file=self.stream or sys.stderr)


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return _is(value, (int, float))


@dataclasses.dataclass
class Run:
    """One run folder: its config (a nested dict), its metrics rows (in round order, up to the
    round it diverged at), and how it diverged (``None`` for a run that did not)."""

    path: pathlib.Path
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    divergence: str | None = None
    code: str | None = None  # run_info.json's git commit (``-dirty``), or fedorth's version

    @property
    def score_key(self) -> str | None:
        """``test_auc`` or ``test_accuracy``, whichever the rows log (``None``: neither)."""
        for key in ("test_auc", "test_accuracy"):
            if any(key in row for row in self.rows):
                return key
        return None

    @property
    def status(self) -> str | None:
        """None for a run that reached ``fed.rounds``, else what happened to it: diverged (its
        ``diverged.json``, or a non-finite metric), failed before its first evaluation, or
        stopped at round r of R (killed, interrupted, or still running)."""
        if self.divergence is not None:
            return self.divergence
        if self.score_key is None:
            return "failed: no evaluated round in metrics.jsonl"
        last = self.rows[-1]["round"]
        rounds = self.config["fed"].get("rounds")
        if rounds is not None and last < rounds:
            return f"incomplete: stopped at round {last} of {rounds}"
        return None


def _config_problem(config: Any) -> str | None:
    """What makes ``config`` unreadable as a run's config, or None."""
    if not isinstance(config, dict):
        kind = {list: "array", str: "string", type(None): "null"}.get(type(config), "number")
        return f"holds a JSON {kind}, not an object"
    for fields, required in ((_REQUIRED, True), (_OPTIONAL, False)):
        for name, kind in fields:
            node: Any = config
            for part in name.split("."):
                node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
            if node is KeyError:
                if required:
                    return f"no key {name}"
            elif not (_is(node, kind) or (node is None and not required)):
                return f"{name} is {node!r}, not {_JSON_TYPES[kind]}"
    return None


def _read_config(path: pathlib.Path) -> dict[str, Any]:
    """The config of ``path/config.json``; :class:`ReportError` (one line) when unreadable."""
    file = path / "config.json"
    left_out = (
        "not a run's config as fedorth writes it, so the run is left out of the report (restore "
        "the file from a copy of the run, or move the folder out of the folders given)"
    )
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ReportError(f"{file} cannot be read ({e.strerror}); {left_out}.") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ReportError(f"{file} is not JSON ({e}); {left_out}.") from None
    problem = _config_problem(config)
    if problem is not None:
        raise ReportError(f"{file}: {problem}; {left_out}.")
    return config


def _row_problem(line: bytes, seen: set[int]) -> tuple[dict[str, Any] | None, str | None]:
    """The row ``line`` holds and None, or None and why it holds none."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError:
        return None, "not JSON: garbled, or cut by a kill"
    if not isinstance(row, dict) or not _is(row.get("round"), int):
        return None, "not a JSON object with an integer round"
    if row["round"] in seen:
        return None, f"a second row of round {row['round']}"
    bad = next((key for key, value in row.items() if not _number(value)), None)
    if bad is not None:
        return None, f"{bad} is {row[bad]!r}, not a number"
    return row, None


def _read_metrics(path: pathlib.Path, notes: Notes) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` in round order. Lines that hold no row are skipped, as
    ``fedorth.train.logging_utils.read_metrics`` skips them when a run resumes, with one warning
    per file naming them; the rest of the file is read."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        notes.warn(f"{path} cannot be read ({e.strerror}): the run is read as having no rows.")
        return []
    rows, skipped, seen = [], [], set()
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        row, why = _row_problem(line, seen)
        if row is None:
            skipped.append((number, why))
            continue
        seen.add(row["round"])
        rows.append(row)
    if skipped:
        lines = ", ".join(str(number) for number, _ in skipped)
        whys = "; ".join(f"line {number}: {why}" for number, why in skipped[:3])
        whys += "; ..." if len(skipped) > 3 else ""
        notes.warn(
            f"{path}: skipped {'line' if len(skipped) == 1 else 'lines'} {lines} ({whys}), "
            f"read the other {len(rows)} rows."
        )
    return sorted(rows, key=lambda row: row["round"])


def _divergence(path: pathlib.Path, rows: list[dict[str, Any]]) -> tuple[str | None, int]:
    """How the run diverged (``diverged.json``, or its first non-finite metric) and how many of
    ``rows`` come before it."""
    for index, row in enumerate(rows):
        bad = next((key for key, value in row.items() if not math.isfinite(value)), None)
        if bad is not None:
            return f"diverged at round {row['round']} ({bad} is {row[bad]})", index
    marker = path / DIVERGED_FILE
    if not marker.exists():
        return None, len(rows)
    try:
        info = json.loads(marker.read_text())
        at = int(info["round"])
        return f"diverged at round {at} ({info['quantity']})", sum(r["round"] < at for r in rows)
    except (OSError, ValueError, TypeError, KeyError):
        return f"diverged ({marker} is unreadable)", len(rows)


def _code_version(path: pathlib.Path) -> str | None:
    """The commit (``-dirty`` when uncommitted changes ran) in ``run_info.json``, else the
    version; None where neither is known."""
    try:
        info = json.loads((path / "run_info.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    if info.get("git_commit"):
        return str(info["git_commit"])[:12] + ("-dirty" if info.get("git_dirty") else "")
    version = info.get("fedorth_version")
    return None if version is None else f"fedorth {version}"


def load_run(path: str | pathlib.Path, notes: Notes | None = None) -> Run:
    """Reads a run folder: ``config.json``, ``metrics.jsonl`` (lines that hold no row are
    skipped, with a warning in ``notes``), ``diverged.json`` and ``run_info.json``.

    Raises:
      ReportError: ``config.json`` is missing, not JSON, or not a run's config.
    """
    path = pathlib.Path(path)
    config = _read_config(path)
    rows = _read_metrics(path / "metrics.jsonl", notes if notes is not None else Notes())
    divergence, kept = _divergence(path, rows)
    return Run(path, config, rows[:kept], divergence, _code_version(path))


def find_runs(paths: Iterable[str | pathlib.Path], notes: Notes | None = None) -> list[Run]:
    """The run folders among ``paths`` and below them (folders holding ``config.json``). A folder
    whose config cannot be read is left out, with a warning and an entry in ``notes.left_out``.

    Raises:
      RunsNotFoundError: a path is not a folder, or no run folder is found.
      ReportError: no run folder found can be read.
    """
    notes = notes if notes is not None else Notes()
    paths = [pathlib.Path(p) for p in paths]
    found: dict[pathlib.Path, None] = {}
    for path in paths:
        if not path.is_dir():
            what = "is a file" if path.exists() else "does not exist"
            raise RunsNotFoundError(
                f"{path} {what}: pass run folders (holding config.json and metrics.jsonl) or "
                "folders holding them."
            )
        candidates = [path] if (path / "config.json").exists() else []
        candidates += sorted(p.parent for p in path.rglob("config.json") if p.parent != path)
        for candidate in candidates:
            found[candidate.resolve()] = None
    if not found:
        raise RunsNotFoundError(
            f"No run folders (with config.json) in {', '.join(map(str, paths))}: pass the "
            "--workdir of runs (python -m experiments.main) or of sweeps "
            "(python -m experiments.sweep)."
        )
    runs = []
    for folder in found:
        try:
            runs.append(load_run(folder, notes))
        except ReportError as e:
            notes.warn(str(e))
            notes.left_out.append((folder, str(e)))
    if not runs:
        raise ReportError(
            f"None of the {len(found)} run folders in {', '.join(map(str, paths))} can be read "
            "(the warnings above say why)."
        )
    return runs


@dataclasses.dataclass
class Group:
    """The runs of one config (one run per seed)."""

    label: str
    setting: tuple[str, str, str]  # (dataset, model, partition)
    runs: list[Run]

    @property
    def score_key(self) -> str:
        keys = {run.score_key for run in self.runs} - {None}
        if len(keys) > 1:
            logs = "; ".join(f"{run.path}: {run.score_key}" for run in self.runs if run.score_key)
            raise ReportError(
                f"{self.label}: runs of one config log different scores ({logs}), which cannot "
                "be averaged: report each kind apart, passing only its run folders."
            )
        return keys.pop() if keys else "test_accuracy"

    @property
    def diverged(self) -> list[Run]:
        return [run for run in self.runs if run.divergence is not None]

    def common_rounds(self, key: str | None = None) -> list[int]:
        """Rounds at which every run logs ``key`` (the score by default), ascending."""
        key = key or self.score_key
        sets = [{row["round"] for row in run.rows if key in row} for run in self.runs]
        return sorted(set.intersection(*sets)) if sets else []

    def values(self, key: str, round_index: int) -> np.ndarray:
        """``key`` at ``round_index`` in every run, float64 ``[runs]`` (NaN where missing)."""
        out = []
        for run in self.runs:
            row = next((r for r in run.rows if r["round"] == round_index), {})
            out.append(float(row.get(key, math.nan)))
        return np.asarray(out, np.float64)

    def comm_per_round(self) -> float:
        """MB sent up and down per round by all sampled clients (mean over the runs; NaN when
        no row says)."""
        per_run = []
        for run in self.runs:
            row = next((r for r in run.rows if "comm_mb_up" in r or "comm_mb_round" in r), None)
            if row is None:
                continue
            if "comm_mb_round" in row:
                per_run.append(row["comm_mb_round"])
            elif "comm_mb_down" in row and "clients_per_round" in run.config["fed"]:
                # Runs without comm_mb_round: per-client up + down times the sampled clients.
                clients = run.config["fed"]["clients_per_round"]
                per_run.append((row["comm_mb_up"] + row["comm_mb_down"]) * clients)
        return float(np.mean(per_run)) if per_run else math.nan

    def code_versions(self) -> list[str]:
        return sorted({run.code for run in self.runs if run.code is not None})


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = json.dumps(value, sort_keys=True)
    return out


def _config_fields(config: dict[str, Any], ignored: Sequence[str] = _IGNORED) -> dict[str, str]:
    """The config's fields as ``{dotted key: JSON value}`` but ``ignored``; a partitioner's
    second name is read as its first."""
    flat = {k: v for k, v in _flatten(config).items() if k not in ignored}
    if "data.partition" in flat:
        name = json.loads(flat["data.partition"])
        flat["data.partition"] = json.dumps(_PARTITION_ALIASES.get(name, name))
    return flat


def algorithm_label(config: dict[str, Any]) -> str:
    """The algorithm's name; generic ones (FedAvg, FedPAC, ...) with their local optimizer; with
    ``fed.options.server_opt``, the paper's name (FedYogi, DiLoCo, ...) or the server optimizer."""
    algorithm = config["fed"]["algorithm"]
    optimizer = (config.get("optim") or {}).get("name") or "sgd"
    server_opt = (config["fed"].get("options") or {}).get("server_opt")
    if server_opt is not None and (algorithm, optimizer, server_opt) in _SERVER_OPT_NAMES:
        return _SERVER_OPT_NAMES[algorithm, optimizer, server_opt]
    label = algorithm
    if algorithm in _GENERIC and (algorithm == "fedpac" or optimizer != "sgd"):
        label = f"{algorithm}+{optimizer}"
    return label if server_opt is None else f"{label} ({server_opt} server)"


def partition_label(data: dict[str, Any]) -> str:
    """``Dir-0.1`` for the papers' Dirichlet split (Hsu et al.: each client's class mix drawn
    from Dir(α); ``dirichlet_hsu``), ``per-class Dir-0.1`` for the split of each class across the
    clients (``dirichlet``), else the partitioner's name (docs/FIDELITY.md, "The Dirichlet
    split")."""
    partition = data.get("partition") or "iid"
    partition = _PARTITION_ALIASES.get(partition, partition)
    alpha = data.get("alpha")
    if alpha is None:
        return partition
    if partition == "dirichlet_client_mix":
        return f"Dir-{alpha:g}"
    if partition == "dirichlet_label_split":
        return f"per-class Dir-{alpha:g}"
    return partition


def setting_of(config: dict[str, Any]) -> tuple[str, str, str]:
    """(dataset, model, partition) of a run."""
    return (
        str(config["data"]["name"]),
        str((config.get("model") or {}).get("name") or "?"),
        partition_label(config["data"]),
    )


def group_runs(runs: Sequence[Run], notes: Notes | None = None) -> list[Group]:
    """Groups runs whose configs differ only in the seed; labels name any other difference."""
    notes = notes if notes is not None else Notes()
    by_config: dict[tuple, list[Run]] = {}
    flats: dict[tuple, dict[str, str]] = {}
    for run in runs:
        flat = _config_fields(run.config)
        key = tuple(sorted(flat.items()))
        by_config.setdefault(key, []).append(run)
        flats[key] = flat
    # Groups sharing (label, setting) but not their configs: name the fields that differ.
    families: dict[tuple, list[tuple]] = {}
    for key, members in by_config.items():
        base_key = (algorithm_label(members[0].config), setting_of(members[0].config))
        families.setdefault(base_key, []).append(key)
    groups = []
    for (label, setting), keys in families.items():
        for key in keys:
            name = _label(label, key, keys, flats)
            members = _one_run_per_seed(name, by_config[key], notes)
            groups.append(Group(name, setting, members))
    return sorted(groups, key=lambda g: (g.setting, g.label))


def _label(label: str, key: tuple, keys: list[tuple], flats: dict[tuple, dict[str, str]]) -> str:
    """``label``, with the config fields in which ``key`` differs from the other ``keys``."""
    if len(keys) == 1:
        return label
    differing = sorted(
        {name for k in keys for name in flats[k]}
        - {
            name
            for name in flats[keys[0]]
            if all(flats[k].get(name) == flats[keys[0]][name] for k in keys)
        }
    )
    shown = ", ".join(f"{f}={json.loads(flats[key].get(f, 'null'))}" for f in differing)
    return f"{label} ({shown})"


def _seed_order(run: Run) -> tuple[int, int, str, str]:
    # Integer seeds first, in order; any other (a hand-edited config's "42") after, as text.
    seed = run.config.get("seed")
    if _is(seed, int):
        return (0, seed, "", str(run.path))
    return (1, 0, json.dumps(seed), str(run.path))


def _one_run_per_seed(label: str, runs: Sequence[Run], notes: Notes) -> list[Run]:
    """``runs`` sorted by seed, one per seed (the most evaluated rounds); warns on duplicates."""
    by_seed: dict[str, list[Run]] = {}
    for run in sorted(runs, key=_seed_order):
        by_seed.setdefault(json.dumps(run.config.get("seed")), []).append(run)
    kept = []
    for seed, same in by_seed.items():
        best = max(same, key=lambda r: len(r.rows))  # max keeps the first of equals
        if len(same) > 1:
            others = ", ".join(str(r.path) for r in same if r is not best)
            notes.warn(
                f"{label}: {len(same)} runs have seed {seed} (the same experiment, "
                f"not {len(same)} seeds); using {best.path}, ignoring {others}."
            )
        kept.append(best)
    return kept


def _seeds(group: Group) -> str:
    return ",".join(str(run.config.get("seed", "?")) for run in group.runs)


def mean_std(values: np.ndarray) -> tuple[float, float]:
    """Mean and sample std (ddof = 1; 0 for a single value) of ``values``."""
    values = np.asarray(values, np.float64)
    std = float(np.std(values, ddof=1)) if values.size > 1 else 0.0
    return float(np.mean(values)), std


def _fmt(mean: float, std: float, n: int, scale: float = 1.0, digits: int = 2) -> str:
    if math.isnan(mean):
        return "—"
    if n > 1:
        return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f}"


def summarize(group: Group) -> dict[str, Any]:
    """The numbers of a group's table row (floats; NaN where a metric is missing)."""
    rounds = group.common_rounds()
    comm = group.comm_per_round()
    if not rounds:
        nan = math.nan
        return {"round": None, "score": (nan, nan), "test_loss": (nan, nan), "comm": comm}
    last = rounds[-1]
    score = mean_std(group.values(group.score_key, last))
    loss = mean_std(group.values("test_loss", last))
    return {"round": last, "score": score, "test_loss": loss, "comm": comm}


def _diverged_cell(group: Group) -> str:
    return f"diverged ({len(group.diverged)} of {len(group.runs)} runs)"


def markdown_table(groups: Sequence[Group]) -> str:
    """The papers' kind of table, one row per group, as markdown; then the runs that did not
    reach ``fed.rounds`` (:attr:`Run.status`) and the groups whose runs come from different code
    versions. A group with a diverged run reads ``diverged`` in place of its numbers."""
    keys = {g.score_key for g in groups}
    score_name = "test AUC (%)" if keys == {"test_auc"} else "test acc (%)"
    if len(keys) > 1:
        score_name = "test acc / AUC (%)"
    header = (
        f"| algorithm | dataset | model | partition | seeds | round | {score_name} "
        "| test loss | comm MB/round |"
    )
    lines = [header, "|" + " --- |" * 9]
    for group in groups:
        stats = summarize(group)
        n = len(group.runs)
        dataset, model, partition = group.setting
        comm = "—" if math.isnan(stats["comm"]) else f"{stats['comm']:.3f}"
        if group.diverged:
            read_at, score, loss = "diverged", _diverged_cell(group), "—"
        else:
            score = _fmt(*stats["score"], n, scale=100.0)
            if len(keys) > 1 and group.score_key == "test_auc":
                score += " (AUC)"
            loss = _fmt(*stats["test_loss"], n, digits=4)
            read_at = "failed" if stats["round"] is None else str(stats["round"])
            if stats["round"] is not None and any(run.status for run in group.runs):
                read_at += " (incomplete)"
        lines.append(
            f"| {group.label} | {dataset} | {model} | {partition} | {n} ({_seeds(group)}) "
            f"| {read_at} | {score} | {loss} | {comm} |"
        )
    unfinished = [(run.path, run.status) for g in groups for run in g.runs if run.status]
    if unfinished:
        lines += ["", "Runs that did not reach fed.rounds:", ""]
        lines += [f"* {path}: {status}" for path, status in unfinished]
    mixed = [(g.label, g.code_versions()) for g in groups if len(g.code_versions()) > 1]
    if mixed:
        lines += ["", "Rows whose runs were made by different code versions (run_info.json):", ""]
        lines += [
            f"* {label}: {', '.join(versions)}; the same config may compute differently under "
            "each, so its mean ± std mixes them."
            for label, versions in mixed
        ]
    return "\n".join(lines) + "\n"


@dataclasses.dataclass
class Selection:
    """A method's value of ``key`` picked on the validation split, and its groups by value."""

    label: str
    setting: tuple[str, str, str]
    key: str
    picked: Any
    validation: dict[Any, tuple[float, float]]  # value -> (mean, std) of the validation score
    groups: dict[Any, Group]

    @property
    def group(self) -> Group:
        return self.groups[self.picked]

    @property
    def edge(self) -> str | None:
        """``lowest`` or ``highest`` when the picked value is at that edge of the numbers tried
        (the optimum may lie beyond it), else None."""
        tried = [value for value in self.groups if _number(value)]
        if len(tried) < 2 or not _number(self.picked):
            return None
        if self.picked == min(tried):
            return "lowest"
        if self.picked == max(tried):
            return "highest"
        return None


def _validation_key(group: Group) -> str:
    return "val_auc" if group.score_key == "test_auc" else "val_accuracy"


def _validation_score(group: Group) -> tuple[float, float]:
    """Mean and std over seeds of the validation score at the last round every run evaluated."""
    rounds = group.common_rounds(_validation_key(group))
    if not rounds:
        return math.nan, math.nan
    return mean_std(group.values(_validation_key(group), rounds[-1]))


def _unequal_candidates(selection: Selection) -> str | None:
    """What differs between the candidates' validation scores besides the value: the seeds they
    average, or the round they are read at; None when nothing does."""
    seeds = {value: _seeds(group) for value, group in selection.groups.items()}
    rounds = {
        value: (group.common_rounds(_validation_key(group)) or [None])[-1]
        for value, group in selection.groups.items()
        if not group.diverged
    }
    said = []
    if len(set(seeds.values())) > 1:
        said.append(
            "seeds "
            + "; ".join(f"{v}: {s}" for v, s in sorted(seeds.items(), key=lambda kv: str(kv[0])))
        )
    if len(set(rounds.values())) > 1:
        said.append(
            "rounds "
            + "; ".join(f"{v}: {r}" for v, r in sorted(rounds.items(), key=lambda kv: str(kv[0])))
        )
    return " and ".join(said) or None


def select_on_validation(
    runs: Sequence[Run], key: str = "optim.learning_rate", notes: Notes | None = None
) -> list[Selection]:
    """Per method (the runs' configs but for ``seed`` and ``key``), the value of ``key`` whose
    runs have the best mean validation score (``val_accuracy``, or ``val_auc``), as the papers
    pick learning rates: on held-out training data (``data.validation_fraction``), never on
    the test split. A value with a diverged run is never picked. Methods without validation
    metrics are left out.
    """
    notes = notes if notes is not None else Notes()
    families: dict[tuple, dict[Any, list[Run]]] = {}
    flats: dict[tuple, dict[str, str]] = {}
    for run in runs:
        flat = _config_fields(run.config, (*_IGNORED, key))
        method = tuple(sorted(flat.items()))
        value = json.loads(_flatten(run.config).get(key, "null"))
        families.setdefault(method, {}).setdefault(value, []).append(run)
        flats[method] = flat
    by_label: dict[tuple, list[tuple]] = {}
    for method, values in families.items():
        config = next(iter(values.values()))[0].config
        by_label.setdefault((algorithm_label(config), setting_of(config)), []).append(method)
    selections = []
    for (label, setting), methods in by_label.items():
        for method in methods:
            name = _label(label, method, methods, flats)
            groups = {
                value: Group(
                    f"{name} ({key}={value})", setting, _one_run_per_seed(name, members, notes)
                )
                for value, members in families[method].items()
            }
            validation = {value: _validation_score(g) for value, g in groups.items()}
            scored = {
                v: m
                for v, (m, _) in validation.items()
                if not math.isnan(m) and not groups[v].diverged
            }
            if not scored:
                continue
            picked = max(scored, key=lambda v: scored[v])
            selections.append(Selection(name, setting, key, picked, validation, groups))
    return sorted(selections, key=lambda s: (s.setting, s.label))


def selection_table(selections: Sequence[Selection]) -> str:
    """Markdown: per method the picked value, its validation score, and the test score (mean ±
    std over seeds) at that value; every candidate's validation score beside (``diverged`` for
    a value with a diverged run). A value picked at the edge of the grid is flagged, and said
    under the table."""
    if not selections:
        return ""
    key = selections[0].key
    lines = [
        f"## {key} picked on the validation split",
        "",
        f"| method | dataset | model | partition | {key} picked | val (%) | seeds | test (%) "
        "| candidates: val (%) |",
        "|" + " --- |" * 9,
    ]
    for selection in selections:
        group = selection.group
        stats = summarize(group)
        n = len(group.runs)
        val = _fmt(*selection.validation[selection.picked], n, scale=100.0)
        candidates = ", ".join(
            f"{value}: "
            + (
                "diverged"
                if selection.groups[value].diverged
                else _fmt(m, sd, len(selection.groups[value].runs), scale=100.0)
            )
            for value, (m, sd) in sorted(selection.validation.items(), key=lambda kv: str(kv[0]))
        )
        picked = str(selection.picked)
        if selection.edge:
            picked += f" ({selection.edge} tried)"
        dataset, model, partition = selection.setting
        lines.append(
            f"| {selection.label} | {dataset} | {model} | {partition} | {picked} "
            f"| {val} | {n} ({_seeds(group)}) | {_fmt(*stats['score'], n, scale=100.0)} "
            f"| {candidates} |"
        )
    unequal = [(s, _unequal_candidates(s)) for s in selections]
    unequal = [(s, said) for s, said in unequal if said]
    if unequal:
        lines += ["", "Candidates compared over different seeds or rounds:", ""]
        lines += [f"* {s.label}: {said}." for s, said in unequal]
    edges = [s for s in selections if s.edge]
    if edges:
        lines += ["", "Picked at the edge of the grid: the optimum may lie outside it.", ""]
        lines += [
            f"* {s.label}: {key}={s.picked} is the {s.edge} value tried; try values "
            f"{'below' if s.edge == 'lowest' else 'above'} it."
            for s in edges
        ]
    return "\n".join(lines) + "\n"


def curves(group: Group, key: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rounds, mean, std)`` of ``key`` (the score by default) over the group's runs at the
    rounds every run logs it; std is the sample std (ddof = 1; 0 for one run)."""
    rounds = group.common_rounds(key)
    if not rounds:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    values = np.stack([group.values(key or group.score_key, r) for r in rounds])
    mean = values.mean(axis=1)
    std = values.std(axis=1, ddof=1) if values.shape[1] > 1 else np.zeros_like(mean)
    return np.asarray(rounds, np.float64), mean, std


def figure_paths(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The PNG and the vector copy of the figure named ``path``: ``path`` itself when it ends in
    ``.pdf`` or ``.svg``, else ``path`` with ``.pdf``."""
    path = pathlib.Path(path)
    vector = path if path.suffix in (".pdf", ".svg") else path.with_suffix(".pdf")
    return path.with_suffix(".png"), vector


def plot(groups: Sequence[Group], path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """One row of panels per setting: the score and the training loss against rounds and
    against the MB communicated so far; per group the mean over its runs with a ± 1 std band.
    Written as PNG and PDF or SVG (:func:`figure_paths`); returns their paths."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    settings = sorted({g.setting for g in groups})
    fig = Figure(figsize=(16, 4.6 * len(settings)), layout="constrained")
    panels = fig.subfigures(len(settings), 1, squeeze=False)[:, 0]
    communication = "MB communicated, cumulative (up + down)"
    for panel, setting in zip(panels, settings, strict=True):
        members = [g for g in groups if g.setting == setting]
        keys = {g.score_key for g in members}
        score = {
            frozenset({"test_auc"}): "test AUC (%)",
            frozenset({"test_accuracy"}): "test accuracy (%)",
        }.get(frozenset(keys), "test accuracy or AUC (%)")
        row = panel.subplots(1, 4)
        handles = []
        for index, group in enumerate(members):
            color = f"C{index % 10}"
            style = "--" if group.diverged else "-"
            comm = group.comm_per_round()
            for column, (key, scale) in enumerate(((None, 100.0), ("train_loss", 1.0)) * 2):
                rounds, mean, std = curves(group, key)
                x = rounds if column < 2 else rounds * comm
                ax = row[column]
                ax.plot(x, scale * mean, style, color=color, marker="o", markersize=3)
                ax.fill_between(x, scale * (mean - std), scale * (mean + std), color=color,
                                alpha=0.2, linewidth=0)  # fmt: skip
            n = len(group.runs)
            label = f"{group.label}: " + ("one seed" if n == 1 else f"mean of {n} seeds")
            if group.diverged:
                label += f", {_diverged_cell(group)}"
            handles.append(Line2D([], [], color=color, linestyle=style, marker="o", label=label))
        handles.append(Patch(color="0.5", alpha=0.3, label="band: mean ± 1 sample std over seeds"))
        labels = (
            (score, "round"),
            ("training loss (mean local loss)", "round"),
            (score, communication),
            ("training loss (mean local loss)", communication),
        )
        for ax, (ylabel, xlabel) in zip(row, labels, strict=True):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        dataset, model, partition = setting
        panel.suptitle(f"{dataset}, {model}, {partition}")
        panel.legend(handles=handles, loc="outside lower center", ncols=2, fontsize="small")
    png, vector = figure_paths(path)
    fig.savefig(png, dpi=200)
    fig.savefig(vector)
    return png, vector


def _write(path: pathlib.Path, flag: str, write) -> None:
    """``write(path)``, its folder created; a path that cannot be written is one line."""
    file = next((parent for parent in path.parents if parent.is_file()), None)
    if file is not None:
        raise ReportError(f"{flag}={path} cannot be written: {file} is a file; pass another path.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as e:
        raise ReportError(
            f"{flag}={path} cannot be written ({e.strerror or e}): pass a path in a folder you "
            "can write."
        ) from None


def _check_select(runs: Sequence[Run], key: str) -> None:
    """:class:`ReportError` when runs log a validation split but none has the config key."""
    logs_validation = any("val_accuracy" in r or "val_auc" in r for run in runs for r in run.rows)
    if not logs_validation or any(key in _flatten(run.config) for run in runs):
        return
    fields = [_config_fields(run.config) for run in runs]
    differing = sorted({k for f in fields for k in f if any(g.get(k) != f[k] for g in fields)})
    raise ReportError(
        f"--select={key}: no run's config has this key; the keys whose values differ between "
        f"the runs are: {', '.join(differing) or 'none (the runs differ only in seed)'}."
    )


def report(
    paths: Iterable[str | pathlib.Path],
    *,
    out: str | pathlib.Path | None = None,
    plot_path: str | pathlib.Path | None = None,
    select: str = "optim.learning_rate",
    notes: Notes | None = None,
) -> str:
    """Reads the runs under ``paths`` and returns the markdown report (also written to ``out``).

    Args:
      paths: run folders, or folders holding run folders.
      out: where to write the markdown (None: only returned).
      plot_path: where to save the figure, as PNG and PDF or SVG (:func:`figure_paths`; None: no
        figure).
      select: the config key picked per method on the validation split
        (:func:`select_on_validation`; a section of the report when runs log validation
        metrics).
      notes: collects the warnings, each printed once (None: a new one, printing on stderr).

    Returns:
      The markdown text.

    Raises:
      ReportError: a ``DIR`` without runs, a group mixing scores, an unknown ``select`` key, or
        an ``out``/``plot_path`` that cannot be written (one line each).
    """
    notes = notes if notes is not None else Notes()
    runs = find_runs(paths, notes)
    _check_select(runs, select)
    groups = group_runs(runs, notes)
    text = "# fedorth runs\n\n" + markdown_table(groups)
    selected = selection_table(select_on_validation(runs, select, notes))
    if selected:
        text += "\n" + selected
    if notes.left_out:
        text += "\nRun folders left out (their config.json cannot be read):\n\n"
        text += "".join(f"* {path}\n" for path, _ in notes.left_out)
    if out is not None:
        _write(pathlib.Path(out), "--out", lambda path: path.write_text(text))
    if plot_path is not None:
        _write(pathlib.Path(plot_path), "--plot", lambda path: plot(groups, path))
    return text


def default_plot_path(dirs: Sequence[str], out: str | None) -> pathlib.Path:
    """Beside ``--out`` (``report.md`` -> ``report.png``), else ``report.png`` in the folder the
    ``dirs`` share (the folder itself when one is given): beside the runs, never the current
    folder by default."""
    if out is not None:
        return pathlib.Path(out).with_suffix(".png")
    common = os.path.commonpath([os.path.abspath(d) for d in dirs])
    return pathlib.Path(common) / "report.png"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dirs", nargs="+", help="run folders or folders of run folders")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument(
        "--plot",
        default=None,
        help="save the figure here, as .png and .pdf (.svg when PATH ends in .svg; default: "
        "report.png and report.pdf in the folder the DIRs share, or beside --out)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    parser.add_argument(
        "--select",
        default="optim.learning_rate",
        help="config key picked per method on the validation split (data.validation_fraction)",
    )
    args = parser.parse_args(argv)
    plot_path = None
    if not args.no_plot:
        plot_path = pathlib.Path(args.plot or default_plot_path(args.dirs, args.out))
    try:
        text = report(args.dirs, out=args.out, plot_path=plot_path, select=args.select)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.stdout.write(text)
    if plot_path is not None:
        png, vector = figure_paths(plot_path)
        print(
            f"figure: {png} and {vector} (--plot PATH writes it elsewhere, --no-plot skips it)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
