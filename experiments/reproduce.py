r"""Runs a paper's table as sweeps and prints it in the paper's layout beside the paper's numbers.

    python -m experiments.reproduce --list
    python -m experiments.reproduce fedpac:table1 --scale small     # embedded data, minutes on CPU
    python -m experiments.reproduce fedpac:table1 --scale paper --workdir=runs/table1   # GPU

Each method of the table (``experiments/paper_tables.py``) runs as one sweep over the table's
seeds (``fedorth.sweep``) per column. ``--scale paper`` runs each method's config with the
column's paper preset (the paper's data, model and schedule: prepare the data first with
``python -m experiments.prepare``). ``--scale small`` runs each method's default config on the
embedded data with the column's heterogeneity (Dirichlet concentration, local steps) for
``small_rounds`` rounds and two seeds; columns the small scale cannot tell apart (the same skew
on another dataset or model) are run once, beside the first paper column they stand for.

Out (in ``--workdir``, default ``runs/reproduce/PAPER_TABLE_SCALE``): every sweep's run folders,
``table.md`` (the table: ours mean ± std over seeds, the paper's number beside), ``table.csv``
and ``table.png`` (ours against the paper's, one panel per column). Under each column: whether
the ordering of the methods agrees (Spearman's rank correlation, and whether the best method is
the same). Runs that exist are resumed, not repeated.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import pathlib
import sys
from typing import Any

import numpy as np

from experiments.paper_tables import TABLES, Column, Table


def _config(table: Table, method_config: str, column: Column, scale: str, rounds: int | None):
    module = importlib.import_module(f"configs.{method_config}")
    if scale == "paper":
        config = module.get_config(column.preset)
    else:
        config = module.get_config()
        for key, value in column.small.items():
            section, _, name = key.rpartition(".")
            node = config
            for part in section.split("."):
                node = node[part]
            node[name] = value
        config.fed.rounds = table.small_rounds
        config.checkpoint_every = 0
    if rounds:
        config.fed.rounds = rounds
    config.eval_every = max(int(config.fed.rounds) // 3, 1)
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
    return "embedded, " + ", ".join(f"{k}={v}" for k, v in column.small.items())


def run_table(
    table: Table, scale: str, workdir: pathlib.Path, *, seeds=None, rounds=None, methods=None
) -> dict[str, Any]:
    """Runs the table's sweeps; returns ``{method label: {column name: [final scores]}}``."""
    from fedorth.sweep import Grid
    from fedorth.sweep.runner import run_sweep

    seeds = list(seeds or (table.seeds if scale == "paper" else table.small_seeds))
    results: dict[str, dict[str, list[float]]] = {}
    for method in table.methods:
        if methods and method.label not in methods:
            continue
        for column, _ in _columns(table, scale):
            name = column.name if scale == "paper" else _small_name(column)
            config = _config(table, method.config, column, scale, rounds)
            folder = workdir / method.config / name.replace(" ", "_").replace(",", "")
            print(f"{table.key}: {method.label}, {name}", file=sys.stderr)
            rows = run_sweep(config, Grid(config, {"seed": seeds}), folder)
            results.setdefault(method.label, {})[name] = [
                float(row.get(table.metric, math.nan)) for row in rows
            ]
    return results


def _spearman(ours: list[float], paper: list[float]) -> float:
    from scipy import stats

    if len(ours) < 2:
        return math.nan
    return float(stats.spearmanr(ours, paper).statistic)


def render(table: Table, scale: str, results: dict[str, Any]) -> tuple[str, list[list[str]]]:
    """The markdown table (paper layout: methods x columns) and the CSV rows."""
    columns = _columns(table, scale)
    names = [c.name if scale == "paper" else _small_name(c) for c, _ in columns]
    paper_names = [table.columns[idx[0]].name for _, idx in columns]
    unit = "test AUC (%)" if table.metric == "test_auc" else "test accuracy (%)"
    lines = [
        f"# {table.paper}: {table.key} ({scale} scale)",
        "",
        f"{table.source}.",
        "",
        f"Ours: {unit}, mean ± std over seeds; paper: the published number"
        + ("" if table.published else " (none: the paper shows this comparison as curves only)")
        + ".",
        "",
    ]
    header = ["method"] + [
        f"{n} (paper: {p})" if scale == "small" and table.published else n
        for n, p in zip(names, paper_names, strict=True)
    ]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    csv_rows = [["method", "column", "paper_column", "ours_mean", "ours_std", "seeds", "paper"]]
    means: dict[str, list[float]] = {}
    for method in table.methods:
        if method.label not in results:
            continue
        cells = [method.label]
        for (_, idx), name, paper_name in zip(columns, names, paper_names, strict=True):
            values = np.asarray(results[method.label].get(name, []), np.float64) * 100.0
            mean = float(values.mean()) if values.size else math.nan
            std = float(values.std(ddof=1)) if values.size > 1 else 0.0
            means.setdefault(name, []).append(mean)
            published = table.published[method.label][idx[0]] if table.published else None
            cell = f"{mean:.2f} ± {std:.2f}"
            if published is not None:
                cell += f" ({published:.2f})"
            cells.append(cell)
            csv_rows.append(
                [
                    method.label,
                    name,
                    paper_name,
                    f"{mean:.4f}",
                    f"{std:.4f}",
                    str(values.size),
                    "" if published is None else f"{published:.2f}",
                ]
            )
        lines.append("| " + " | ".join(cells) + " |")
    if table.published:
        labels = [m.label for m in table.methods if m.label in results]
        lines += ["", "Ordering of the methods, ours against the paper's:", ""]
        for (_, idx), name in zip(columns, names, strict=True):
            paper = [table.published[label][idx[0]] for label in labels]
            ours = means[name]
            rho = _spearman(ours, paper)
            best_ours = labels[int(np.nanargmax(ours))]
            best_paper = labels[int(np.argmax(paper))]
            agrees = "agrees" if best_ours == best_paper else "differs"
            lines.append(
                f"* {name}: Spearman rank correlation {rho:.2f}; best method {agrees} "
                f"(ours {best_ours}, paper {best_paper})."
            )
    return "\n".join(lines) + "\n", csv_rows


def plot(table: Table, scale: str, csv_rows: list[list[str]], path: pathlib.Path) -> None:
    """One panel per column: ours (mean ± std) per method, the paper's number beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = csv_rows[1:]
    columns = list(dict.fromkeys(r[1] for r in rows))
    fig, axes = plt.subplots(1, len(columns), figsize=(5 * len(columns), 4), squeeze=False)
    for ax, column in zip(axes.flat, columns, strict=True):
        mine = [r for r in rows if r[1] == column]
        x = np.arange(len(mine))
        ours, spread = [float(r[3]) for r in mine], [float(r[4]) for r in mine]
        ax.bar(x - 0.2, ours, 0.4, yerr=spread, label="ours", color="C0")
        if table.published:
            ax.bar(x + 0.2, [float(r[6] or "nan") for r in mine], 0.4, label="paper", color="C1")
        ax.set_xticks(x, [r[0] for r in mine], rotation=60, ha="right", fontsize="small")
        ax.set_title(column, fontsize="small")
        ax.legend(fontsize="small")
    fig.suptitle(f"{table.paper}: {table.key} ({scale})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def listing() -> str:
    lines = []
    for table in TABLES.values():
        numbers = "published numbers" if table.published else "curves only in the paper"
        lines.append(f"{table.key}: {table.paper} ({numbers})")
        lines.append(f"    methods: {', '.join(m.label for m in table.methods)}")
        lines.append(f"    columns: {'; '.join(c.name for c in table.columns)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.reproduce", description=__doc__)
    parser.add_argument("table", nargs="?", help=f"one of {sorted(TABLES)}")
    parser.add_argument("--list", action="store_true", help="list the tables")
    parser.add_argument("--scale", choices=("small", "paper"), default="small")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--seeds", default=None, help="comma-separated (default: the table's)")
    parser.add_argument("--rounds", type=int, default=None, help="fed.rounds (default: scale's)")
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
    from fedorth import train
    from fedorth.sweep import SweepError

    try:
        results = run_table(
            table, args.scale, workdir, seeds=seeds, rounds=args.rounds, methods=methods
        )
    except (SweepError, *train.USER_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text, csv_rows = render(table, args.scale, results)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "table.md").write_text(text)
    with (workdir / "table.csv").open("w", newline="") as f:
        csv.writer(f).writerows(csv_rows)
    plot(table, args.scale, csv_rows, workdir / "table.png")
    sys.stdout.write(text)
    print(f"table: {workdir / 'table.md'}, {workdir / 'table.csv'}, {workdir / 'table.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
