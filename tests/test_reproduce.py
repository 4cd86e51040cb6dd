"""experiments.reproduce: the papers' tables as sweeps, beside the published numbers."""

import csv
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

from experiments.paper_tables import TABLES

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("key", sorted(TABLES))
def test_every_method_has_every_column_preset(key):
    """Each cell of --scale paper is a config and preset that exist (built, not run)."""
    table = TABLES[key]
    for method in table.methods:
        module = importlib.import_module(f"configs.{method.config}")
        for column in table.columns:
            config = module.get_config(column.preset)
            assert config.fed.rounds > 0, (method.config, column.preset)
    if table.published is not None:
        assert set(table.published) == {m.label for m in table.methods}
        assert all(len(row) == len(table.columns) for row in table.published.values())


def test_transcribed_numbers_match_the_papers_rows():
    # FedPAC (Liu et al.) Table 1, rows FedPAC_SOAP and Local Muon, first and last columns.
    fedpac = TABLES["fedpac:table1"].published
    assert fedpac["FedPAC_SOAP"][0] == 69.25 and fedpac["FedPAC_SOAP"][-1] == 31.33
    assert fedpac["Local Muon"][1] == 49.86
    # FedMuon (Liu et al.) Table 2, row FedMuon: 74.12 / 73.05 / 50.22 / 48.18.
    assert TABLES["fedmuon_liu:table2"].published["FedMuon"] == (74.12, 73.05, 50.22, 48.18)


def test_small_table_runs_and_prints_the_paper_numbers_beside(tmp_path):
    """A reduced fedpac:table1 --scale small: two methods, two seeds, 3 rounds (SGD-based
    methods: their rounds compile fastest). The command gets a persistent compilation cache
    folder of its own: its four sweeps build their functions anew, and the programs they share
    (the evaluation, the initialization) are compiled once."""
    workdir = tmp_path / "table"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.reproduce",
            "fedpac:table1",
            "--scale=small",
            f"--workdir={workdir}",
            "--methods=FedAvg,SCAFFOLD",
            "--seeds=42,43",
            "--rounds=3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={
            **os.environ,
            "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "compilation_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        },
    )
    assert out.returncode == 0, out.stderr
    text = (workdir / "table.md").read_text()
    assert text == out.stdout.split("table: ")[0]
    assert "Table 1: Test accuracy of each method on CIFAR-100" in text
    fedavg = next(line for line in text.splitlines() if line.startswith("| FedAvg |"))
    # The paper's numbers of the columns the two small columns stand for: 60.17 and 56.75.
    assert "(60.17)" in fedavg and "(56.75)" in fedavg, fedavg
    assert text.count("Spearman rank correlation") == 2
    rows = list(csv.DictReader((workdir / "table.csv").open()))
    assert len(rows) == 4 and {r["seeds"] for r in rows} == {"2"}
    scaffold = [r for r in rows if r["method"] == "SCAFFOLD"]
    assert [r["paper"] for r in scaffold] == ["60.69", "56.43"]
    assert all(0.0 < float(r["ours_mean"]) <= 100.0 for r in rows)
    assert (workdir / "table.png").stat().st_size > 0
    # Each cell is a sweep: ordinary run folders, one per seed.
    assert len(list(workdir.rglob("metrics.jsonl"))) == 8
