"""The round benchmark's output: the markdown table, the cross-process ratios, the JSON file."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from typing import Any

from experiments.bench.workloads import PEERS


def add_cross_ratios(rows: list[dict[str, Any]]) -> None:
    """``speedup_vs_<peer>`` for fedorth rows timed apart from that peer (``--isolate``, or a
    different case): the ratio of medians of the peer's row with the same workload, algorithm,
    S, K and B (and dtype, where the peer ran in it; else its float32 row)."""
    key = lambda r: (r["workload"], r["algorithm"], r["clients_per_round"], r["local_steps"],
                     r["batch_size"])  # fmt: skip
    peers = {(key(r), r["impl"], r["dtype"]): r for r in rows if r["impl"] != "fedorth"}
    for row in rows:
        if row["impl"] != "fedorth":
            continue
        for kind in PEERS:  # the peer in the row's dtype if it ran, else in float32
            peer = peers.get((key(row), kind, row["dtype"]), peers.get((key(row), kind, "float32")))
            if peer is not None and f"speedup_vs_{kind}" not in row:
                row[f"speedup_vs_{kind}"] = peer["round_s"] / row["round_s"]


def format_table(rows: list[dict[str, Any]]) -> str:
    columns = [
        ("workload", "{}"), ("algorithm", "{}"), ("aligned", "{}"), ("S", "{}"), ("K", "{}"),
        ("B", "{}"),
        ("dtype", "{}"), ("impl", "{}"), ("strategy", "{}"), ("conv", "{}"), ("unroll", "{}"),
        ("lapack", "{}"),
        ("steps/s", "{:.2f}"), ("img/s", "{:.0f}"), ("round ms", "{:.0f}"), ("LAPACK s", "{:.2f}"),
        ("compile s", "{:.1f}"), ("peak MB", "{:.1f}"),
        ("GFLOP/s", "{:.1f}"), ("%matmul", "{:.0%}"), ("×torch", "{:.2f}"), ("×jax_loop", "{:.2f}"),
    ]  # fmt: skip
    keys = {
        "S": "clients_per_round", "K": "local_steps", "B": "batch_size", "conv": "conv_impl",
        "lapack": "lapack_threads", "LAPACK s": "lapack_s",
        "img/s": "images_per_s",
        "steps/s": "client_steps_per_s", "compile s": "compile_s", "GFLOP/s": "gflops",
        "%matmul": "fraction_of_matmul", "×torch": "speedup_vs_torch",
        "×jax_loop": "speedup_vs_jax_loop",
    }  # fmt: skip
    lines = ["| " + " | ".join(name for name, _ in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        cells = []
        for name, fmt in columns:
            if name == "round ms":
                value = 1e3 * row["round_s"]
            elif name == "peak MB":
                value = row["memory"]["peak_bytes"] / 2**20 if "memory" in row else None
                if "device_peak_bytes" in row:  # --isolate: the row's own process
                    value = row["device_peak_bytes"] / 2**20
            else:
                value = row.get(keys.get(name, name))
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: str, result: dict[str, Any]) -> None:
    """Atomic: a temporary file beside `path`, then `os.replace` (a reader never sees half)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def project_commit() -> str | None:
    """HEAD of this checkout (the directory holding experiments/), None outside a git checkout."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or None
