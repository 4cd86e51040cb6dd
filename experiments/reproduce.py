r"""Runs a paper's table as sweeps and prints it in the paper's layout beside the paper's numbers.

    python -m experiments.reproduce --list
    python -m experiments.reproduce fedpac:table1 --scale small     # embedded data, minutes on CPU
    python -m experiments.reproduce fedpac:table1 --scale paper --workdir=runs/table1   # GPU

Each method of the table (``experiments/paper_tables.py``) runs as one sweep over the table's
seeds (``fedorth.sweep``) per column. ``--scale paper`` runs each method's config with the
column's paper preset (the paper's data, model and schedule: prepare the data first with
``python -m experiments.prepare``). ``--scale small`` runs each method's default config on the
embedded digits (1,437 training and 360 test images) with the column's heterogeneity (the
papers' Dirichlet split and concentration, local steps, clients) for ``small_rounds`` rounds
and two seeds, each method with the settings its paper shares between the methods it compares
(``Method.small``); columns the small scale cannot tell apart (the same skew on another dataset
or model) are run once, beside the first paper column they stand for.

Out (in ``--workdir``, default ``runs/reproduce/PAPER_TABLE_SCALE``): every sweep's run folders,
``table.md`` (what ran beside what the paper ran; the table: ours mean ± std over seeds, final
or best accuracy as the paper reports it, the paper's number beside; diverged replicas marked),
``table.csv`` and ``table.png`` (ours and the paper's in separate panels, each on its own
axis). Under each column: whether the ordering of the methods agrees (Spearman's rank
correlation with a bootstrap interval over seeds, a warning when the spread over seeds is as
large as the gaps between methods, and whether the best method is the same).

``--seeds``, ``--rounds`` reduce a run: it goes to its own folder
(``WORKDIR/reduced_seeds=...,rounds=...``), so the full command still finds only its own runs.
Runs that exist are resumed, not repeated; Ctrl-C or SIGTERM stops the table, and the same
command resumes it.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import pathlib
import signal
import sys
from typing import Any

import numpy as np

from experiments.paper_tables import TABLES, Column, Method, Table

# What the embedded datasets are, for a reader of table.md (fedorth.data.DATASETS).
_DATA = {
    "digits": "the embedded 8x8 digits (1,437 training and 360 test images)",
    "synthetic": "the embedded synthetic classification data",
    "zipf_sentiment": "the embedded Zipf-distributed sentiment data",
}
_BOOTSTRAP = 2000


def _set(config, key: str, value: Any) -> None:
    import ml_collections

    section, _, name = key.rpartition(".")
    node = config
    for part in filter(None, section.split(".")):
        node = node[part]
    node[name] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value


def _config(table: Table, method: Method, column: Column, scale: str, rounds: int | None):
    module = importlib.import_module(f"configs.{method.config}")
    if scale == "paper":
        config = module.get_config(column.preset + method.preset_suffix)
    else:
        config = module.get_config()
        for key, value in (*column.small.items(), *method.small.items()):
            _set(config, key, value)
        config.fed.rounds = table.small_rounds
    if rounds:
        config.fed.rounds = rounds
    if table.reported == "best":
        if scale == "small":
            config.eval_every = 1  # the best of every round, as the paper's curves
    else:
        config.eval_every = max(int(config.fed.rounds) // 3, 1)
    if scale == "small":
        # Three checkpoints a sweep: Ctrl-C loses at most the rounds since the last.
        config.checkpoint_every = max(int(config.fed.rounds) // 3, 1)
    return config


def _columns(table: Table, scale: str) -> list[tuple[Column, list[int]]]:
    """The columns to run, each with the indices of the paper columns it stands for."""
    if scale == "paper":
        return [(column, [i]) for i, column in enumerate(table.columns)]
    runs: dict[str, tuple[Column, list[int]]] = {}
    for i, column in enumerate(table.columns):
        key = json.dumps(column.small, sort_keys=True)
        runs.setdefault(key, (column, []))[1].append(i)
    return list(runs.values())


def _small_name(column: Column) -> str:
    return "small: " + ", ".join(f"{k.rpartition('.')[2]}={v}" for k, v in column.small.items())


def _column_name(column: Column, scale: str) -> str:
    return column.name if scale == "paper" else _small_name(column)


def run_folder(
    table: Table, scale: str, workdir: pathlib.Path, seeds=None, rounds=None
) -> pathlib.Path:
    """The folder of a run: ``workdir`` for the table's own seeds and rounds, a subfolder named
    after the reduction otherwise (a reduced sweep's config and grid differ from the full one's,
    and one folder holds one sweep)."""
    default = list(table.seeds if scale == "paper" else table.small_seeds)
    reduced = []
    if seeds and list(seeds) != default:
        reduced.append("seeds=" + ",".join(str(s) for s in seeds))
    if rounds and not (scale == "small" and rounds == table.small_rounds):
        reduced.append(f"rounds={rounds}")
    return workdir / ("reduced_" + ",".join(reduced)) if reduced else workdir


def _replica(folder: pathlib.Path, seed: int, table: Table) -> dict[str, Any]:
    """One seed's number: the metric at the last row (``final``) or its maximum over the
    evaluated rounds (``best``), and whether the replica diverged (``diverged.json``)."""
    from fedorth.sweep.grid import replica_name
    from fedorth.sweep.runner import DIVERGED_FILE
    from fedorth.train.logging_utils import read_metrics

    replica = folder / replica_name({"seed": seed})
    rows, _ = read_metrics(replica / "metrics.jsonl")
    values = [float(r[table.metric]) for r in rows if table.metric in r]
    marker = replica / DIVERGED_FILE
    diverged = json.loads(marker.read_text()) if marker.exists() else None
    if not values:
        value = math.nan
    else:
        value = max(values) if table.reported == "best" else values[-1]
    return {"seed": seed, "value": value, "diverged": diverged}


def run_table(
    table: Table, scale: str, workdir: pathlib.Path, *, seeds=None, rounds=None, methods=None
) -> dict[str, Any]:
    """Runs the table's sweeps; returns ``{method label: {column name: [replicas]}}``, a replica
    being ``{"seed", "value" (a fraction), "diverged" (diverged.json's content or None)}``."""
    from fedorth.sweep import Grid
    from fedorth.sweep.runner import run_sweep

    seeds = list(seeds or (table.seeds if scale == "paper" else table.small_seeds))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for method in table.methods:
        if methods and method.label not in methods:
            continue
        for column, _ in _columns(table, scale):
            name = _column_name(column, scale)
            config = _config(table, method, column, scale, rounds)
            folder = workdir / _slug(method.label) / _slug(name)
            print(f"{table.key}: {method.label}, {name}", file=sys.stderr)
            run_sweep(config, Grid(config, {"seed": seeds}), folder)
            results.setdefault(method.label, {})[name] = [
                _replica(folder, seed, table) for seed in seeds
            ]
    return results


def _slug(text: str) -> str:
    """A folder name: ``text`` with every character but letters, digits, ``.``, ``=`` and ``-``
    replaced by ``_`` (two methods of one config, e.g. SCAFFOLD and SCAFFOLD (Adam), differ)."""
    return "".join(c if c.isalnum() or c in ".=-" else "_" for c in text).strip("_")


def _spearman(ours, paper) -> float:
    from scipy import stats

    if len(ours) < 2 or len(set(ours)) < 2 or len(set(paper)) < 2:
        return math.nan
    return float(stats.spearmanr(ours, paper).statistic)


def _bootstrap(values: list[np.ndarray], paper: list[float]) -> tuple[float, float] | None:
    """The 95% interval of Spearman's rho when each method's seeds are resampled with
    replacement; None when no method has two seeds (nothing to resample)."""
    from scipy import stats

    if all(v.size < 2 for v in values) or len(set(paper)) < 2:
        return None
    rng = np.random.default_rng(0)
    means = np.array([[rng.choice(v, v.size).mean() for v in values] for _ in range(_BOOTSTRAP)])
    # Spearman's rho of each resample at once: Pearson's r of the ranks (ties averaged), as
    # scipy.stats.spearmanr computes it; a resample whose means are all equal has none.
    varied = means.max(axis=1) > means.min(axis=1)
    if not varied.any():
        return None
    ranks = stats.rankdata(means[varied], axis=1)
    ranks -= ranks.mean(axis=1, keepdims=True)
    target = stats.rankdata(paper)
    target -= target.mean()
    rhos = ranks @ target / np.sqrt((ranks**2).sum(axis=1) * (target**2).sum())
    low, high = np.percentile(rhos, [2.5, 97.5])
    return float(low), float(high)


def _cell_values(replicas: list[dict[str, Any]]) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The tabulated values (%, diverged replicas left out) and the diverged replicas."""
    kept = [r["value"] * 100.0 for r in replicas if r["diverged"] is None]
    kept = [v for v in kept if math.isfinite(v)]
    return np.asarray(kept, np.float64), [r for r in replicas if r["diverged"] is not None]


def _settings(config) -> dict[str, Any]:
    return {
        "data": config.data.name,
        "model": config.model.name
        + (f" {tuple(config.model.hidden_sizes)}" if "hidden_sizes" in config.model else ""),
        "rounds": int(config.fed.rounds),
        "clients": int(config.data.num_clients),
        "clients per round": int(config.fed.clients_per_round),
        "local steps K": int(config.fed.local_steps),
        "batch": int(config.fed.batch_size),
        "split": config.data.partition
        + (f" (alpha {config.data.alpha:g})" if "dirichlet" in config.data.partition else ""),
    }


def _optimizer(config) -> str:
    optim = config.optim
    text = f"{optim.name} lr {optim.learning_rate:g}"
    for key in ("b1", "b2", "beta", "ema", "fallback_lr_ratio", "fallback_b2", "weight_decay"):
        if key in optim:
            text += f", {key} {optim[key]:g}" if key != "ema" else f", ema {optim[key]}"
    options = {k: v for k, v in config.fed.options.items() if isinstance(v, int | float | bool)}
    if options:
        text += "; " + ", ".join(f"{k} {v}" for k, v in sorted(options.items()))
    return text


def _caption(table: Table, scale: str, rounds, seeds, labels: list[str]) -> list[str]:
    """What ran (from the configs run) beside what the paper ran."""
    seeds = list(seeds or (table.seeds if scale == "paper" else table.small_seeds))
    methods = [m for m in table.methods if m.label in labels]
    unit = "test AUC" if table.metric == "test_auc" else "test accuracy"
    lines = []
    per_column = []
    for column, _ in _columns(table, scale):
        configs = {m.label: _config(table, m, column, scale, rounds) for m in methods}
        settings = {label: _settings(c) for label, c in configs.items()}
        first = next(iter(settings.values()), {})
        shared = ", ".join(
            f"{k} {v}" for k, v in first.items() if all(s[k] == v for s in settings.values())
        )
        if k_differs := [k for k in first if any(s[k] != first[k] for s in settings.values())]:
            shared += "; differs between methods: " + "; ".join(
                f"{k}: " + ", ".join(f"{label} {s[k]}" for label, s in settings.items())
                for k in k_differs
            )
        per_column.append(f"* {_column_name(column, scale)}: {shared}.")
        optimizers = {label: _optimizer(c) for label, c in configs.items()}
    data = first.get("data", "")
    data = "each column's paper preset" if scale == "paper" else _DATA.get(data, data)
    lines += [
        f"**What ran here** ({scale} scale): {data}, seeds "
        + ", ".join(str(s) for s in seeds)
        + f" ({len(seeds)} replica{'s' if len(seeds) > 1 else ''} of each cell); per column:",
        "",
        *per_column,
        "",
        "Each method's optimizer (and its algorithm's options): "
        + "; ".join(f"{label}: {text}" for label, text in optimizers.items())
        + ".",
        "",
        f"**What the paper ran**: {table.source}.",
        "",
        f"**Each cell**: {table.reported} {unit} (%)"
        + (
            " (the maximum over the evaluated rounds)"
            if table.reported == "best"
            else " (at the last round)"
        )
        + f", as the paper reports it ({table.reported_why}). Ours: the mean over seeds, "
        "± the standard deviation between them (n − 1) where there are two or more, no spread "
        "for one; the paper's number in brackets"
        + ("" if table.published else " (none: the paper shows this comparison as curves only)")
        + ". A diverged replica is left out of its cell and named under the table.",
        "",
    ]
    return lines


def render(
    table: Table, scale: str, results: dict[str, Any], *, seeds=None, rounds=None
) -> tuple[str, list[list[str]]]:
    """The markdown table (caption; paper layout: methods x columns; ordering) and CSV rows."""
    columns = _columns(table, scale)
    names = [_column_name(c, scale) for c, _ in columns]
    paper_names = [table.columns[idx[0]].name for _, idx in columns]
    labels = [m.label for m in table.methods if m.label in results]
    lines = [f"# {table.paper}: {table.key} ({scale} scale)", ""]
    lines += _caption(table, scale, rounds, seeds, labels)
    header = ["method"] + [
        f"{n} (paper: {p})" if scale == "small" and table.published else n
        for n, p in zip(names, paper_names, strict=True)
    ]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    csv_rows = [
        [
            "method",
            "column",
            "paper_column",
            "reported",
            "ours_mean",
            "ours_std",
            "seeds",
            "diverged",
            "paper",
        ]
    ]
    values_by: dict[str, dict[str, np.ndarray]] = {}
    notes = []
    for label in labels:
        cells = [label]
        for (_, idx), name, paper_name in zip(columns, names, paper_names, strict=True):
            values, diverged = _cell_values(results[label].get(name, []))
            values_by.setdefault(name, {})[label] = values
            mean = float(values.mean()) if values.size else math.nan
            std = float(values.std(ddof=1)) if values.size > 1 else math.nan
            published = table.published[label][idx[0]] if table.published else None
            if not values.size:
                cell = "diverged" if diverged else "no result"
            elif values.size == 1:
                cell = f"{mean:.2f}"
            else:
                cell = f"{mean:.2f} ± {std:.2f}"
            if diverged:
                cell += " †"
                notes.append(
                    f"† {label}, {name}: "
                    + "; ".join(
                        f"seed {r['seed']} diverged at round {r['diverged'].get('round')} "
                        f"({r['diverged'].get('quantity')})"
                        for r in diverged
                    )
                    + f"; the cell holds the other {values.size} seed(s)."
                )
            if published is not None:
                cell += f" ({published:.2f})"
            cells.append(cell)
            csv_rows.append(
                [
                    label,
                    name,
                    paper_name,
                    table.reported,
                    f"{mean:.4f}",
                    "" if math.isnan(std) else f"{std:.4f}",
                    str(values.size),
                    ",".join(str(r["seed"]) for r in diverged),
                    "" if published is None else f"{published:.2f}",
                ]
            )
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *notes]
    lines += _ordering(table, columns, names, labels, values_by)
    return "\n".join(lines) + "\n", csv_rows


def _ordering(table, columns, names, labels, values_by) -> list[str]:
    """Under each column: Spearman's rho (bootstrap interval over seeds), the best method,
    and a warning when the spread over seeds is as large as the gaps between the methods."""
    if not table.published:
        return []
    lines = ["", "Ordering of the methods, ours against the paper's:", ""]
    for (_, idx), name in zip(columns, names, strict=True):
        ranked = [label for label in labels if values_by[name][label].size]
        if len(ranked) < 2:
            lines.append(f"* {name}: fewer than two methods have a number; no ordering.")
            continue
        values = [values_by[name][label] for label in ranked]
        ours = [float(v.mean()) for v in values]
        paper = [table.published[label][idx[0]] for label in ranked]
        rho = _spearman(ours, paper)
        interval = _bootstrap(values, paper)
        if interval is None:
            spread = "no interval: one seed per method, so nothing says how sure the order is"
        else:
            spread = (
                f"95% bootstrap interval [{interval[0]:.2f}, {interval[1]:.2f}] over seeds "
                f"({_BOOTSTRAP} resamples of each method's seeds; few seeds understate it)"
            )
        best_ours = ranked[int(np.argmax(ours))]
        best_paper = ranked[int(np.argmax(paper))]
        agrees = "agrees" if best_ours == best_paper else "differs"
        lines.append(
            f"* {name}: Spearman rank correlation {rho:.2f} over {len(ranked)} methods, {spread}; "
            f"best method {agrees} (ours {best_ours}, paper {best_paper})."
        )
        stds = [float(v.std(ddof=1)) for v in values if v.size > 1]
        gaps = np.diff(np.sort(ours))
        if stds and max(stds) >= float(np.median(gaps)):
            lines.append(
                f"  Warning: the standard deviation over seeds reaches {max(stds):.2f} points "
                f"(median {np.median(stds):.2f}) while the median gap between methods of "
                f"neighbouring rank is {np.median(gaps):.2f} points: these seeds do not settle "
                "the order; run more (--seeds) before reading it."
            )
    return lines


def figure(table: Table, scale: str, csv_rows: list[list[str]]):
    """Per column, ours and the paper's in two panels, each with its own labelled axis (the
    small scale's accuracies are not the paper's: another dataset, model and length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = csv_rows[1:]
    columns = list(dict.fromkeys(r[1] for r in rows))
    panels = 2 if table.published else 1
    fig, axes = plt.subplots(
        len(columns), panels, figsize=(6 * panels, 4 * len(columns)), squeeze=False
    )
    unit = "test AUC (%)" if table.metric == "test_auc" else "test accuracy (%)"
    for row_axes, column in zip(axes, columns, strict=True):
        mine = [r for r in rows if r[1] == column]
        x = np.arange(len(mine))
        ours = [float(r[4]) for r in mine]
        spread = [float(r[5] or 0.0) for r in mine]
        ax = row_axes[0]
        _ranked_bars(ax, x, ours, spread, "C0")
        ax.set_ylabel(f"ours: {table.reported} {unit}")
        ax.set_title(f"ours ({scale} scale): {column}", fontsize="small")
        ax.set_xticks(x, [r[0] for r in mine], rotation=60, ha="right", fontsize="small")
        if table.published:
            ax = row_axes[1]
            _ranked_bars(ax, x, [float(r[8] or "nan") for r in mine], None, "C1")
            ax.set_ylabel(f"paper: {unit}")
            ax.set_title(f"paper: {mine[0][2]}", fontsize="small")
            ax.set_xticks(x, [r[0] for r in mine], rotation=60, ha="right", fontsize="small")
    note = "error bars: std over seeds; above each bar its rank in the panel (1: best)" + (
        "\nthe two panels have separate axes (other data, model and length): compare the ranks"
        if table.published
        else ""
    )
    fig.suptitle(f"{table.paper}: {table.key} ({scale} scale)\n{note}", fontsize="medium")
    fig.tight_layout()
    return fig


def _ranked_bars(ax, x, values, spread, color) -> None:
    ax.bar(x, values, 0.6, yerr=spread, color=color, capsize=3)
    finite = [v for v in values if math.isfinite(v)]
    for i, (position, value) in enumerate(zip(x, values, strict=True)):
        if math.isfinite(value):
            rank = 1 + sum(v > value for v in finite)
            top = value + (spread[i] if spread is not None else 0.0)  # above the error bar
            ax.annotate(str(rank), (position, top), ha="center", va="bottom", fontsize="small")


def plot(table: Table, scale: str, csv_rows: list[list[str]], path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(table, scale, csv_rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def listing() -> str:
    lines = []
    for table in TABLES.values():
        numbers = "published numbers" if table.published else "curves only in the paper"
        metric = "AUC" if table.metric == "test_auc" else "accuracy"
        lines.append(f"{table.key}: {table.paper} ({numbers}; {table.reported} test {metric})")
        lines.append(f"    methods: {', '.join(m.label for m in table.methods)}")
        lines.append(f"    columns: {'; '.join(c.name for c in table.columns)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.reproduce", description=__doc__)
    parser.add_argument("table", nargs="?", help=f"one of {sorted(TABLES)}")
    parser.add_argument("--list", action="store_true", help="list the tables")
    parser.add_argument("--scale", choices=("small", "paper"), default="small")
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--seeds", default=None, help="comma-separated (default: the table's); a reduced run"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="fed.rounds (default: scale's); a reduced run"
    )
    parser.add_argument("--methods", default=None, help="comma-separated labels (default: all)")
    args = parser.parse_args(argv)
    if args.list or not args.table:
        print(listing())
        return 0
    if args.table not in TABLES:
        print(f"error: unknown table {args.table!r}; valid: {sorted(TABLES)}.", file=sys.stderr)
        return 2
    table = TABLES[args.table]
    workdir = pathlib.Path(
        args.workdir or f"runs/reproduce/{table.key.replace(':', '_')}_{args.scale}"
    )
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    methods = args.methods.split(",") if args.methods else None
    if methods and (unknown := sorted(set(methods) - {m.label for m in table.methods})):
        valid = [m.label for m in table.methods]
        print(f"error: --methods: {unknown} not in {table.key}; valid: {valid}.", file=sys.stderr)
        return 2
    workdir = run_folder(table, args.scale, workdir, seeds, args.rounds)
    from fedorth import train
    from fedorth.sweep import SweepError
    from fedorth.train.loop import stop_on_sigterm

    stop_on_sigterm()  # SIGTERM as Ctrl-C: the sweep in progress stops, saved
    try:
        results = run_table(
            table, args.scale, workdir, seeds=seeds, rounds=args.rounds, methods=methods
        )
        _write(
            table,
            args.scale,
            workdir,
            render(table, args.scale, results, seeds=seeds, rounds=args.rounds),
        )
    except train.WorkdirConflictError:
        print(
            f"error: {workdir} holds runs of another setting of {table.key} (a config, preset or "
            "Method.small of experiments/paper_tables.py changed since they ran); give this "
            "command another --workdir to run the table anew (this one keeps those runs).",
            file=sys.stderr,
        )
        return 1
    except (SweepError, *train.USER_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        for signum in (signal.SIGINT, signal.SIGTERM):  # no traceback from a further one
            signal.signal(signum, signal.SIG_IGN)
        # The sweep's RunInterrupted names the round; the signal may be its cause's.
        signum = getattr(e, "signum", None) or getattr(e.__cause__, "signum", None) or signal.SIGINT
        print(
            f"\n{signal.Signals(signum).name}: stopped; {str(e) + '; ' if str(e) else ''}the "
            "finished sweeps are kept and the same command resumes the table.",
            file=sys.stderr,
        )
        return 128 + signum
    return 0


def _write(table: Table, scale: str, workdir: pathlib.Path, rendered) -> None:
    """table.md, table.csv, table.png in ``workdir``; the table on stdout."""
    text, csv_rows = rendered
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "table.md").write_text(text)
    with (workdir / "table.csv").open("w", newline="") as f:
        csv.writer(f).writerows(csv_rows)
    plot(table, scale, csv_rows, workdir / "table.png")
    sys.stdout.write(text)
    print(f"table: {workdir / 'table.md'}, {workdir / 'table.csv'}, {workdir / 'table.png'}")


if __name__ == "__main__":
    sys.exit(main())
