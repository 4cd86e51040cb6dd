r"""Tabulates and plots several runs: one row per algorithm and setting, random seeds aggregated.

    python -m experiments.report runs/fedavg_s42 runs/fedavg_s43 runs/fedpac_soap_s42 ...
    python -m experiments.report runs/ --out report.md --plot report.png
    python -m experiments.report runs/ --no-plot

The figure is written by default (``report.png`` in the current folder, or next to ``--out``:
``report.md`` -> ``report.png``); ``--no-plot`` skips it.

Each ``DIR`` is a run folder (``config.json`` + ``metrics.jsonl``, as written by
``python -m experiments.main``) or a folder searched recursively for run folders. Runs are grouped
by algorithm and setting (dataset, model, partition and its alpha); runs whose configs differ only
in ``seed`` are one group, and any other difference (a learning rate, K, ...) splits the group and
is named in the row's label. For each group the table gives, over its runs (random seeds):

* the final test accuracy (``test_auc`` when the runs log it) and test loss as mean ± std, in the
  papers' style (accuracy in %); std is the sample standard deviation (ddof = 1), omitted for a
  single run;
* the round they are read at: the last evaluated round that every run of the group reached (an
  unfinished run does not bias the mean with an earlier round);
* the communication per round in MB (up + down for every sampled client, ``comm_mb_round``).

A run that did not reach ``fed.rounds`` is named under the table with what happened (failed
before its first evaluation, diverged, stopped at round r of R), and its group's round reads
``failed`` or ``r (incomplete)``.

Two runs of a group with the same ``seed`` are the same experiment, not two seeds: the report
keeps one of them (the one with the most evaluated rounds) and warns on stderr, naming both
folders, instead of counting it twice (which would show a spurious ``± 0.00``).

Selection as the papers do it: when the runs log a validation split (``data.validation_fraction``:
``val_accuracy`` or ``val_auc``), a second table picks, for each method (configs equal but for
the seed and the learning rate), the learning rate with the best mean validation score and gives
the test score (mean ± std over seeds) at that rate, with every candidate's validation score
beside (``--select KEY`` picks another config key).

The plot has one panel per setting: test accuracy (or AUC) against rounds for each algorithm, the
mean over seeds with a ±std band.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

# Generic algorithms whose local optimizer is a free choice: their label names it.
_GENERIC = ("fedavg", "fedavgm", "fedadam", "scaffold", "fedcm", "fedpac")
# Config fields that do not define a run's setting (seeds are aggregated; paths are local).
_IGNORED = ("seed", "data.data_dir")


@dataclasses.dataclass
class Run:
    """One run folder: its config (a nested dict) and its metrics rows."""

    path: pathlib.Path
    config: dict[str, Any]
    rows: list[dict[str, Any]]

    @property
    def score_key(self) -> str:
        return "test_auc" if any("test_auc" in row for row in self.rows) else "test_accuracy"

    @property
    def status(self) -> str | None:
        """None for a run that reached ``fed.rounds``, else what happened to it: failed before
        its first evaluation, diverged (a non-finite loss), or stopped at round r of R (killed,
        interrupted, or still running)."""
        evaluated = [row for row in self.rows if self.score_key in row]
        if not evaluated:
            return "failed: no evaluated round in metrics.jsonl"
        last = self.rows[-1]
        losses = [last.get(key) for key in ("train_loss", "test_loss")]
        if any(isinstance(v, float | int) and not math.isfinite(v) for v in losses):
            return f"diverged: non-finite loss at round {last['round']}"
        rounds = self.config.get("fed", {}).get("rounds")
        if rounds is not None and last["round"] < rounds:
            return f"incomplete: stopped at round {last['round']} of {rounds}"
        return None


@dataclasses.dataclass
class Group:
    """The runs of one algorithm in one setting (seeds aggregated)."""

    label: str
    setting: tuple[str, str, str]  # (dataset, model, partition)
    runs: list[Run]

    @property
    def score_key(self) -> str:
        keys = {run.score_key for run in self.runs}
        if len(keys) > 1:
            raise ValueError(f"{self.label}: runs mix test_accuracy and test_auc ({keys}).")
        return keys.pop()

    def common_rounds(self) -> list[int]:
        """Evaluated rounds present in every run (with the score), ascending."""
        key = self.score_key
        sets = [{row["round"] for row in run.rows if key in row} for run in self.runs]
        return sorted(set.intersection(*sets)) if sets else []

    def values(self, key: str, round_index: int) -> np.ndarray:
        """``key`` at ``round_index`` in every run, float64 ``[runs]`` (NaN where missing)."""
        out = []
        for run in self.runs:
            row = next((r for r in run.rows if r["round"] == round_index), {})
            out.append(float(row.get(key, math.nan)))
        return np.asarray(out, np.float64)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = json.dumps(value, sort_keys=True)
    return out


def load_run(path: str | pathlib.Path) -> Run:
    """Reads ``config.json`` and ``metrics.jsonl`` of a run folder (a cut last line is dropped)."""
    path = pathlib.Path(path)
    config = json.loads((path / "config.json").read_text())
    rows = []
    metrics = path / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill mid-write
                break
    return Run(path, config, rows)


def find_runs(paths: Iterable[str | pathlib.Path]) -> list[Run]:
    """The run folders among ``paths`` and below them (folders holding ``config.json``)."""
    found: dict[pathlib.Path, None] = {}
    for path in map(pathlib.Path, paths):
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is not a folder.")
        candidates = [path] if (path / "config.json").exists() else []
        candidates += sorted(p.parent for p in path.rglob("config.json") if p.parent != path)
        for candidate in candidates:
            found[candidate.resolve()] = None
    if not found:
        raise FileNotFoundError(f"No run folders (with config.json) in {list(map(str, paths))}.")
    return [load_run(p) for p in found]


def algorithm_label(config: dict[str, Any]) -> str:
    """The algorithm's name; generic ones (FedAvg, FedPAC, ...) with their local optimizer."""
    algorithm = config["fed"]["algorithm"]
    optimizer = config.get("optim", {}).get("name", "sgd")
    if algorithm in _GENERIC and (algorithm == "fedpac" or optimizer != "sgd"):
        return f"{algorithm}+{optimizer}"
    return algorithm


def partition_label(data: dict[str, Any]) -> str:
    """``Dir-0.1`` for Dirichlet partitions, else the partitioner's name."""
    partition = data.get("partition", "iid")
    if partition.startswith("dirichlet") and data.get("alpha") is not None:
        prefix = "Dir" if partition == "dirichlet_label_split" else partition
        return f"{prefix}-{data['alpha']:g}"
    return partition


def setting_of(config: dict[str, Any]) -> tuple[str, str, str]:
    """(dataset, model, partition) of a run."""
    return (
        str(config["data"]["name"]),
        str(config.get("model", {}).get("name", "?")),
        partition_label(config["data"]),
    )


def group_runs(runs: Sequence[Run]) -> list[Group]:
    """Groups runs whose configs differ only in the seed; labels name any other difference."""
    by_config: dict[tuple, list[Run]] = {}
    flats: dict[tuple, dict[str, str]] = {}
    for run in runs:
        flat = {k: v for k, v in _flatten(run.config).items() if k not in _IGNORED}
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
            members = _one_run_per_seed(name, by_config[key])
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


def _one_run_per_seed(label: str, runs: Sequence[Run]) -> list[Run]:
    """``runs`` sorted by seed, one per seed (the most evaluated rounds); warns on duplicates."""
    by_seed: dict[Any, list[Run]] = {}
    for run in sorted(runs, key=lambda r: (str(r.config.get("seed", 0)), str(r.path))):
        by_seed.setdefault(run.config.get("seed"), []).append(run)
    kept = []
    for seed, same in by_seed.items():
        best = max(same, key=lambda r: len(r.rows))  # max keeps the first of equals
        if len(same) > 1:
            others = ", ".join(str(r.path) for r in same if r is not best)
            print(
                f"warning: {label}: {len(same)} runs have seed {seed} (the same experiment, "
                f"not {len(same)} seeds); using {best.path}, ignoring {others}.",
                file=sys.stderr,
            )
        kept.append(best)
    return sorted(kept, key=lambda r: (r.config.get("seed", 0), str(r.path)))


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
    if not rounds:
        nan = math.nan
        return {"round": None, "score": (nan, nan), "test_loss": (nan, nan), "comm": nan}
    last = rounds[-1]
    score = mean_std(group.values(group.score_key, last))
    loss = mean_std(group.values("test_loss", last))
    comm = group.values("comm_mb_round", last)
    if np.isnan(comm).any():  # older runs: per-client up + down times the sampled clients
        up, down = group.values("comm_mb_up", last), group.values("comm_mb_down", last)
        clients = np.asarray(
            [run.config["fed"]["clients_per_round"] for run in group.runs], np.float64
        )
        comm = (up + down) * clients
    return {"round": last, "score": score, "test_loss": loss, "comm": float(np.mean(comm))}


def markdown_table(groups: Sequence[Group]) -> str:
    """The papers' kind of table, one row per group, as markdown; then the runs that did not
    reach ``fed.rounds`` (:attr:`Run.status`)."""
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
        seeds = ",".join(str(run.config.get("seed", "?")) for run in group.runs)
        score = _fmt(*stats["score"], n, scale=100.0)
        if len(keys) > 1 and group.score_key == "test_auc":
            score += " (AUC)"
        dataset, model, partition = group.setting
        comm = "—" if math.isnan(stats["comm"]) else f"{stats['comm']:.3f}"
        read_at = "failed" if stats["round"] is None else str(stats["round"])
        if stats["round"] is not None and any(run.status for run in group.runs):
            read_at += " (incomplete)"
        lines.append(
            f"| {group.label} | {dataset} | {model} | {partition} | {n} ({seeds}) "
            f"| {read_at} | {score} | {_fmt(*stats['test_loss'], n, digits=4)} | {comm} |"
        )
    unfinished = [(run.path, run.status) for g in groups for run in g.runs if run.status]
    if unfinished:
        lines += ["", "Runs that did not reach fed.rounds:", ""]
        lines += [f"* {path}: {status}" for path, status in unfinished]
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


def _validation_score(group: Group) -> tuple[float, float]:
    """Mean and std over seeds of the validation score at the last round every run evaluated."""
    key = "val_auc" if group.score_key == "test_auc" else "val_accuracy"
    sets = [{row["round"] for row in run.rows if key in row} for run in group.runs]
    rounds = sorted(set.intersection(*sets)) if sets else []
    if not rounds:
        return math.nan, math.nan
    return mean_std(group.values(key, rounds[-1]))


def select_on_validation(runs: Sequence[Run], key: str = "optim.learning_rate") -> list[Selection]:
    """Per method (the runs' configs but for ``seed`` and ``key``), the value of ``key`` whose
    runs have the best mean validation score (``val_accuracy``, or ``val_auc``), as the papers
    pick learning rates: on held-out training data (``data.validation_fraction``), never on
    the test split. Methods without validation metrics are left out.
    """
    families: dict[tuple, dict[Any, list[Run]]] = {}
    flats: dict[tuple, dict[str, str]] = {}
    for run in runs:
        flat = {k: v for k, v in _flatten(run.config).items() if k not in (*_IGNORED, key)}
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
                value: Group(f"{name} ({key}={value})", setting, _one_run_per_seed(name, members))
                for value, members in families[method].items()
            }
            validation = {value: _validation_score(g) for value, g in groups.items()}
            scored = {v: m for v, (m, _) in validation.items() if not math.isnan(m)}
            if not scored:
                continue
            picked = max(scored, key=lambda v: scored[v])
            selections.append(Selection(name, setting, key, picked, validation, groups))
    return sorted(selections, key=lambda s: (s.setting, s.label))


def selection_table(selections: Sequence[Selection]) -> str:
    """Markdown: per method the picked value, its validation score, and the test score (mean ±
    std over seeds) at that value; every candidate's validation score beside."""
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
        seeds = ",".join(str(run.config.get("seed", "?")) for run in group.runs)
        val = _fmt(*selection.validation[selection.picked], n, scale=100.0)
        candidates = ", ".join(
            f"{value}: {_fmt(m, sd, len(selection.groups[value].runs), scale=100.0)}"
            for value, (m, sd) in sorted(selection.validation.items(), key=lambda kv: str(kv[0]))
        )
        dataset, model, partition = selection.setting
        lines.append(
            f"| {selection.label} | {dataset} | {model} | {partition} | {selection.picked} "
            f"| {val} | {n} ({seeds}) | {_fmt(*stats['score'], n, scale=100.0)} | {candidates} |"
        )
    return "\n".join(lines) + "\n"


def curves(group: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rounds, mean, std)`` of the score over the group's runs at their common rounds."""
    rounds = group.common_rounds()
    values = np.stack([group.values(group.score_key, r) for r in rounds]) if rounds else None
    if values is None:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    mean = values.mean(axis=1)
    std = values.std(axis=1, ddof=1) if values.shape[1] > 1 else np.zeros_like(mean)
    return np.asarray(rounds, np.float64), mean, std


def plot(groups: Sequence[Group], path: str | pathlib.Path) -> None:
    """One panel per setting: score against rounds, mean over seeds with a ±std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({g.setting for g in groups})
    cols = min(3, len(settings))
    rows = math.ceil(len(settings) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, setting in zip(axes.flat, settings, strict=False):
        for index, group in enumerate(g for g in groups if g.setting == setting):
            rounds, mean, std = curves(group)
            color = f"C{index % 10}"
            ax.plot(
                rounds,
                100 * mean,
                color=color,
                marker="o",
                markersize=3,
                label=f"{group.label} (n={len(group.runs)})",
            )
            ax.fill_between(rounds, 100 * (mean - std), 100 * (mean + std), color=color, alpha=0.2)
            ax.set_ylabel(group.score_key.replace("_", " ") + " (%)")
        ax.set_title(" / ".join(setting))
        ax.set_xlabel("round")
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(settings) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(
    paths: Iterable[str | pathlib.Path],
    *,
    out: str | pathlib.Path | None = None,
    plot_path: str | pathlib.Path | None = None,
    select: str = "optim.learning_rate",
) -> str:
    """Reads the runs under ``paths`` and returns the markdown report (also written to ``out``).

    Args:
      paths: run folders, or folders holding run folders.
      out: where to write the markdown (None: only returned).
      plot_path: where to save the accuracy-vs-rounds figure (None: no figure).
      select: the config key picked per method on the validation split
        (:func:`select_on_validation`; a section of the report when runs log validation
        metrics).

    Returns:
      The markdown text.
    """
    runs = find_runs(paths)
    groups = group_runs(runs)
    text = "# fedorth runs\n\n" + markdown_table(groups)
    selected = selection_table(select_on_validation(runs, select))
    if selected:
        text += "\n" + selected
    if out is not None:
        pathlib.Path(out).write_text(text)
    if plot_path is not None:
        plot(groups, plot_path)
    return text


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dirs", nargs="+", help="run folders or folders of run folders")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument(
        "--plot",
        default=None,
        help="save the accuracy-vs-rounds figure here (default: report.png, or next to --out)",
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
        plot_path = args.plot or (
            pathlib.Path(args.out).with_suffix(".png") if args.out else pathlib.Path("report.png")
        )
    sys.stdout.write(report(args.dirs, out=args.out, plot_path=plot_path, select=args.select))
    if plot_path is not None:
        print(f"figure: {plot_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
