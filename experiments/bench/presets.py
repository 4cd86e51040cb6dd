"""``--preset targets``: the GPU targets' table of the round benchmark and its summary."""

from __future__ import annotations

from typing import Any

from experiments.bench.workloads import Case

# The targets' table (docs/PERFORMANCE.md, "Running on GPUs"): one command, `--preset targets
# --budget-s 500`. The papers' scale (FedMuon (Liu et al.) Table 2: S = 10 of 100 clients, K = 50,
# B = 50), most important first, so that a run cut short keeps the FedAvg rows; the torch rows at
# S = 1, K = 20, B = 500 are PyTorch's single-model throughput (images/s) at a batch that fills
# the GPU, float32 eager and channels_last + bfloat16 autocast.
TARGET_CASES = (
    Case("resnet18_cifar100", "fedavg", 10, 50, 50, "float32", ("fedorth", "torch")),
    Case("resnet18_cifar100", "fedavg", 10, 50, 50, "bfloat16", ("fedorth",)),
    Case("resnet18_cifar100", "fedavg", 1, 20, 500, "float32", ("torch", "torch_amp")),
    Case("vit_tiny", "fedavg", 10, 50, 50, "float32", ("fedorth", "torch")),
    Case("resnet18_cifar100", "fedpac_muon", 10, 50, 50, "float32", ("fedorth",)),
    Case("vit_tiny", "fedpac_muon", 10, 50, 50, "float32", ("fedorth",)),
)
PRESETS = {"targets": TARGET_CASES}


def _find(rows, impl, workload, algorithm="fedavg", dtype="float32", batch=50):
    for row in rows:
        if (row["impl"], row["workload"], row["algorithm"], row["dtype"], row["batch_size"]) == (
            impl, workload, algorithm, dtype, batch
        ):  # fmt: skip
            return row
    return None


def targets_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU targets from the rows of `--preset targets` (None where a row is missing)."""

    def ratio(a, b, key="round_s"):
        return None if a is None or b is None else a[key] / b[key]

    resnet, vit = "resnet18_cifar100", "vit_tiny"
    f32 = _find(rows, "fedorth", resnet)
    return [
        {"target": f"{resnet} FedAvg float32 (S=10, K=50), × the torch peer", "goal": ">= 3",
         "value": ratio(_find(rows, "torch", resnet), f32), "ok": lambda v: v >= 3},
        {"target": f"{resnet} FedAvg bfloat16 img/s ÷ torch_amp's batch-500 img/s",
         "goal": ">= 0.5",
         "value": ratio(_find(rows, "fedorth", resnet, dtype="bfloat16"),
                        _find(rows, "torch_amp", resnet, dtype="bfloat16 autocast", batch=500),
                        "images_per_s"),
         "ok": lambda v: v >= 0.5},
        {"target": f"{vit} FedAvg float32, × the torch peer", "goal": ">= 10",
         "value": ratio(_find(rows, "torch", vit), _find(rows, "fedorth", vit)),
         "ok": lambda v: v >= 10},
        {"target": f"{resnet} FedPAC_Muon round ÷ FedAvg round (float32)", "goal": "<= 1.5",
         "value": ratio(_find(rows, "fedorth", resnet, "fedpac_muon"), f32),
         "ok": lambda v: v <= 1.5},
        {"target": f"{vit} FedPAC_Muon round ÷ FedAvg round (float32)", "goal": "<= 1.5",
         "value": ratio(_find(rows, "fedorth", vit, "fedpac_muon"), _find(rows, "fedorth", vit)),
         "ok": lambda v: v <= 1.5},
    ]  # fmt: skip


def format_targets(summary) -> tuple[str, list[dict[str, Any]]]:
    """The markdown table of `targets_summary` and its JSON form (``met``: True/False/None)."""
    lines = ["| target | goal | measured | met |", "|---|---|---|---|"]
    out = []
    for t in summary:
        value = t["value"]
        met = None if value is None else bool(t["ok"](value))
        shown = "-" if value is None else f"{value:.2f}"
        lines.append(f"| {t['target']} | {t['goal']} | {shown} | {'-' if met is None else met} |")
        out.append({"target": t["target"], "goal": t["goal"], "value": value, "met": met})
    return "\n".join(lines), out
