"""experiments.report's selection: learning rate picked on validation, test mean ± std there."""

import json
import pathlib
import subprocess
import sys

import numpy as np

from experiments import report

REPO = pathlib.Path(__file__).resolve().parents[1]

# (algorithm, lr) -> {seed: (val accuracy, test accuracy)} at the last round (20). FedAvg's
# lr 0.3 has the best test accuracy but not the best validation accuracy: it must not be picked.
FINAL = {
    ("fedavg", 0.1): {42: (0.80, 0.78), 43: (0.84, 0.80)},
    ("fedavg", 0.3): {42: (0.79, 0.90), 43: (0.81, 0.92)},
    ("fedavg", 0.03): {42: (0.60, 0.61), 43: (0.62, 0.59)},
    ("fedpac", 0.003): {42: (0.88, 0.86), 43: (0.90, 0.87), 44: (0.86, 0.88)},
    ("fedpac", 0.01): {42: (0.85, 0.84), 43: (0.87, 0.85), 44: (0.83, 0.80)},
}


def _write(root: pathlib.Path) -> None:
    for (algorithm, lr), seeds in FINAL.items():
        for seed, (val, test) in seeds.items():
            folder = root / f"{algorithm}_{lr}_{seed}"
            folder.mkdir(parents=True)
            config = {
                "seed": seed,
                "data": {"name": "digits", "partition": "iid", "validation_fraction": 0.1},
                "model": {"name": "mlp"},
                "fed": {"algorithm": algorithm, "rounds": 20, "clients_per_round": 5},
                "optim": {"name": "soap" if algorithm == "fedpac" else "sgd", "learning_rate": lr},
            }
            (folder / "config.json").write_text(json.dumps(config))
            rows = [
                {"round": 10, "val_accuracy": 0.5, "test_accuracy": 0.5, "test_loss": 1.0},
                {"round": 20, "val_accuracy": val, "test_accuracy": test, "test_loss": 0.5},
            ]
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_rate_with_the_best_mean_validation_score_is_picked(tmp_path):
    _write(tmp_path)
    selections = report.select_on_validation(report.find_runs([tmp_path]))
    picked = {s.label: s.picked for s in selections}
    for algorithm, label in (("fedavg", "fedavg"), ("fedpac", "fedpac+soap")):
        means = {
            lr: np.mean([v for v, _ in seeds.values()])
            for (alg, lr), seeds in FINAL.items()
            if alg == algorithm
        }
        assert picked[label] == max(means, key=means.get)
    assert picked["fedavg"] == 0.1  # not 0.3, the best on the test split
    for selection in selections:
        stats = report.summarize(selection.group)
        algorithm = selection.group.runs[0].config["fed"]["algorithm"]
        expected = np.asarray([t for _, t in FINAL[(algorithm, selection.picked)].values()])
        np.testing.assert_allclose(stats["score"], (expected.mean(), expected.std(ddof=1)))


def test_the_report_command_names_the_picked_rate(tmp_path):
    _write(tmp_path / "runs")
    out = subprocess.run(
        [sys.executable, "-m", "experiments.report", str(tmp_path / "runs"), "--no-plot"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "## optim.learning_rate picked on the validation split" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("| fedavg |"))
    # picked 0.1: val (80+84)/2 = 82.00 ± 2.83, test (78+80)/2 = 79.00 ± 1.41 over seeds 42, 43
    assert "| 0.1 | 82.00 ± 2.83 | 2 (42,43) | 79.00 ± 1.41 |" in row, row
    assert "0.3: 80.00 ± 1.41" in row and "0.03: 61.00 ± 1.41" in row, row
