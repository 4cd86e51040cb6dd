"""experiments.reproduce: the papers' tables as sweeps, beside the published numbers."""

import csv
import importlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from experiments import reproduce
from experiments.paper_tables import TABLES

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("key", sorted(TABLES))
def test_every_method_has_every_column_preset(key):
    """Each cell of --scale paper is a config and preset that exist (built, not run)."""
    table = TABLES[key]
    for method in table.methods:
        module = importlib.import_module(f"configs.{method.config}")
        for column in table.columns:
            config = module.get_config(column.preset + method.preset_suffix)
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


def _small(key: str, label: str, column: int = 0):
    """The config a method of a table runs at --scale small (built, not run)."""
    table = TABLES[key]
    method = next(m for m in table.methods if m.label == label)
    return reproduce._config(table, method, table.columns[column], "small", None)


def test_small_tables_compare_like_for_like():
    """Each small table gives its compared methods the settings their paper shares."""
    # FedPAC (Liu et al.) Sec. 6: FedPAC variants at Local X's learning rate; Table 8: Local and
    # FedPAC Sophia with the same (beta1, beta2) = (0.9, 0.99).
    for local, fedpac in (
        ("Local Muon", "FedPAC_Muon"),
        ("Local SOAP", "FedPAC_SOAP"),
        ("Local Sophia", "FedPAC_Sophia"),
    ):
        a, b = _small("fedpac:table1", local), _small("fedpac:table1", fedpac)
        assert a.optim.to_dict() == b.optim.to_dict(), (local, fedpac)
    sophia = _small("fedpac:table1", "Local Sophia").optim
    assert (sophia.b1, sophia.b2) == (0.9, 0.99)
    # FedMuon (Liu et al.): Local Muon in FedMuon's Muon form (heavy ball 0.98, one rate);
    # FedLADA with its paper presets' alpha 0.1.
    local_muon = _small("fedmuon_liu:table2", "Local Muon").optim
    assert local_muon.to_dict() == _small("fedmuon_liu:table2", "FedMuon").optim.to_dict()
    assert (local_muon.beta, local_muon.ema) == (0.98, False)
    assert _small("fedmuon_liu:table2", "FedLADA").fed.options.alpha == 0.1
    # FedMuon (Zhang & Gao): every method on 8 clients, all every round, an iid split.
    for method in TABLES["fedmuon_zg:main"].methods:
        config = _small("fedmuon_zg:main", method.label)
        setting = (config.data.num_clients, config.fed.clients_per_round, config.data.partition)
        assert setting == (8, 8, "iid"), method.label
    # The LMO paper: LocalMuon in FedMuon's form (EMA weight 0.1, classic Newton-Schulz, the
    # same rate, momentum SGD on the other leaves at FedMuon's other_lr_ratio).
    lmo_local = _small("fedmuon_lmo:cifar10", "LocalMuon")
    lmo_fed = _small("fedmuon_lmo:cifar10", "FedMuon")
    assert lmo_local.optim.learning_rate == lmo_fed.optim.learning_rate
    assert (lmo_local.optim.beta, lmo_local.optim.ema) == (1 - lmo_fed.fed.options.alpha, True)
    assert lmo_local.optim.ns_coeffs == "classic" and lmo_local.optim.shape_scaling == "none"
    assert lmo_local.optim.fallback == "momentum_sgd"
    assert lmo_local.optim.fallback_lr_ratio == lmo_fed.fed.options.other_lr_ratio
    # The papers' Dirichlet split (Hsu et al.) wherever a paper column is Dir-alpha.
    for key in ("fedpac:table1", "fedmuon_liu:table2", "fedmuon_lmo:cifar10"):
        for method in TABLES[key].methods:
            assert _small(key, method.label).data.partition == "dirichlet_hsu", (key, method)


def test_tables_hold_the_papers_baselines():
    zg = TABLES["fedmuon_zg:main"]
    # FedMuon (Zhang & Gao) Sec. 7: its eleven baselines; tau = 16 is its Figure 5.
    assert [m.label for m in zg.methods] == [
        "FedAvg", "SCAFFOLD", "FedAvg-M", "FedAvg-VR", "SCAFFOLD-M", "SCAFFOLD-VR",
        "PAdaMFed", "PAdaMFed-VR", "FedAdam", "FAFED", "Adam-BiClip", "FedMuon",
    ]  # fmt: skip
    assert "Figures 1 and 5" in zg.source
    lmo = TABLES["fedmuon_lmo:cifar10"]
    labels = [m.label for m in lmo.methods]
    assert "FedAvg (Adam)" in labels and "SCAFFOLD (Adam)" in labels
    for label in ("FedAvg (Adam)", "SCAFFOLD (Adam)"):
        method = next(m for m in lmo.methods if m.label == label)
        for column in lmo.columns:
            config = reproduce._config(lmo, method, column, "paper", None)
            assert config.optim.name == "adamw", (label, column.preset)
        assert _small("fedmuon_lmo:cifar10", label).optim.name == "adamw"


def _results(table, spread: float, seeds=(42, 43), diverged=None):
    """Made-up results: method i scores 50 + 5 i (%), its seeds +- ``spread``/2."""
    out = {}
    for i, method in enumerate(table.methods):
        out[method.label] = {
            reproduce._column_name(column, "small"): [
                {
                    "seed": seed,
                    "value": (50 + 5 * i + (spread / 2) * (-1) ** j) / 100,
                    "diverged": None,
                }
                for j, seed in enumerate(seeds)
            ]
            for column, _ in reproduce._columns(table, "small")
        }
    if diverged:
        label, seed = diverged
        for replicas in out[label].values():
            replicas[[r["seed"] for r in replicas].index(seed)]["diverged"] = {
                "round": 12,
                "quantity": "train_loss is nan",
            }
    return out


def test_caption_says_what_ran_beside_what_the_paper_ran():
    table = TABLES["fedpac:table1"]
    text, _ = reproduce.render(table, "small", _results(table, 1.0))
    caption = text.split("| method |")[0]
    ran = caption.split("**What the paper ran**")[0]
    said = ("digits", "360 test images", "mlp", "rounds 30", "clients 10", "clients per round 5",
            "local steps K 10", "seeds 42, 43", "dirichlet_hsu")  # fmt: skip
    assert all(s in ran for s in said), ran
    assert "CIFAR-100" not in ran and "CIFAR-100" in caption.split("**What the paper ran**")[1]
    assert "final test accuracy" in caption and "FedPAC_Muon: muon lr 0.05" in caption
    liu = TABLES["fedmuon_liu:table2"]
    assert "best test accuracy" in reproduce.render(liu, "small", _results(liu, 1.0))[0]
    assert "top accuracy" in liu.reported_why and liu.reported == "best"


def test_spread_interval_and_warning():
    table = TABLES["fedpac:table1"]
    # One seed: no spread, and no interval.
    text, rows = reproduce.render(table, "small", _results(table, 0.0, seeds=(42,)), seeds=[42])
    assert "±" not in text.split("| method |")[1] and "0.00 ±" not in text
    assert "no interval: one seed per method" in text and {r[5] for r in rows[1:]} == {""}
    # Two seeds, spread well below the gaps (5 points): an interval, no warning.
    text, _ = reproduce.render(table, "small", _results(table, 1.0))
    # (resampling seeds never changes the order: the interval is the point)
    rhos = re.findall(
        r"correlation (\S+) over 10 methods, 95% bootstrap interval \[(\S+), (\S+)\]", text
    )
    assert len(rhos) == 2 and all(len(set(r)) == 1 for r in rhos), rhos
    assert "Warning" not in text
    # Spread as large as the gaps: the ordering is flagged.
    text, _ = reproduce.render(table, "small", _results(table, 12.0))
    assert text.count("Warning: the standard deviation over seeds reaches 8.49 points") == 2


def test_diverged_replicas_are_marked_not_tabulated():
    table = TABLES["fedpac:table1"]
    text, rows = reproduce.render(table, "small", _results(table, 2.0, diverged=("FedCM", 43)))
    fedcm = next(line for line in text.splitlines() if line.startswith("| FedCM |"))
    assert fedcm.count("61.00 †") == 2, fedcm  # seed 42 alone: 50 + 5 * 2 + 1
    assert "seed 43 diverged at round 12 (train_loss is nan)" in text
    assert [r[7] for r in rows[1:] if r[0] == "FedCM"] == ["43", "43"]


def test_final_or_best_read_from_the_replica_folder(tmp_path):
    replica = tmp_path / "seed=42"
    replica.mkdir()
    rows = [{"round": r, "test_accuracy": a} for r, a in ((0, 0.1), (10, 0.8), (20, 0.7))]
    (replica / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert reproduce._replica(tmp_path, 42, TABLES["fedpac:table1"])["value"] == 0.7
    assert reproduce._replica(tmp_path, 42, TABLES["fedmuon_liu:table2"])["value"] == 0.8
    (replica / "diverged.json").write_text('{"round": 25, "quantity": "train_loss is nan"}\n')
    assert reproduce._replica(tmp_path, 42, TABLES["fedpac:table1"])["diverged"]["round"] == 25


def test_figure_draws_ours_and_the_papers_on_separate_axes():
    table = TABLES["fedpac:table1"]
    _, rows = reproduce.render(table, "small", _results(table, 1.0))
    fig = reproduce.figure(table, "small", rows)
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels == ["ours: final test accuracy (%)", "paper: test accuracy (%)"] * 2
    for ours, paper in zip(fig.axes[::2], fig.axes[1::2], strict=True):
        assert len(ours.patches) == len(paper.patches) == len(table.methods)
        assert (
            ours.get_title().startswith("ours (small scale)") and "CIFAR-100" in paper.get_title()
        )
        # each bar labelled with its rank in its panel: 1 over the best
        ranks = [int(text.get_text()) for text in paper.texts]
        assert sorted(ranks) == list(range(1, len(table.methods) + 1))


class _Command:
    """``python -m experiments.reproduce ARGS`` as a real process; its stderr read as it comes."""

    def __init__(self, args, cache: pathlib.Path):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "experiments.reproduce", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": str(REPO),
                "JAX_COMPILATION_CACHE_DIR": str(cache),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            },
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stderr:
            self.lines.append(line)

    def wait_for(self, path: pathlib.Path, timeout: float = 300):
        """Until ``path`` exists (the process still running)."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert self.process.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.05)

    def wait_for_line(self, text: str, timeout: float = 300):
        """Until a line of stderr holds ``text`` (the process still running)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.lines)):
            assert self.process.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.05)

    def finish(self, timeout: float = 600) -> tuple[int, str, str]:
        out = self.process.stdout.read()
        code = self.process.wait(timeout)
        self._reader.join(10)
        return code, out, "".join(self.lines)


def test_small_table_signals_resume_and_a_reduced_run_keeps_the_full_command(tmp_path):
    """A reduced fedpac:table1 --scale small (two methods, two seeds, 3 rounds: SGD-based
    methods compile fastest) stopped by Ctrl-C, then run again to its table; then the
    documented full command (one method) in the same --workdir runs its own sweeps until
    SIGTERM stops it. Each stop: one line, no traceback, 128 + the signal."""
    workdir, cache = tmp_path / "table", tmp_path / "compilation_cache"
    reduced = ["fedpac:table1", "--scale=small", f"--workdir={workdir}",
               "--methods=FedAvg,SCAFFOLD", "--seeds=42,43", "--rounds=3"]  # fmt: skip
    column = reproduce._slug(reproduce._small_name(TABLES["fedpac:table1"].columns[0]))
    run = _Command(reduced, cache)
    run.wait_for(workdir / "reduced_rounds=3" / "FedAvg" / column / "seed=42" / "metrics.jsonl")
    # Signalled while the first sweep runs its rounds (it prints round 1 there).
    run.wait_for_line("round 1/3")
    run.process.send_signal(signal.SIGINT)
    code, _, err = run.finish()
    assert code == 130 and "Traceback" not in err, err
    assert "SIGINT: stopped;" in err and "the same command resumes the table" in err, err

    code, out, err = _Command(reduced, cache).finish()
    assert code == 0, err
    folder = workdir / "reduced_rounds=3"
    text = (folder / "table.md").read_text()
    assert text == out.split("table: ")[0]
    assert "Table 1: Test accuracy of each method on CIFAR-100" in text
    assert "rounds 3" in text and "seeds 42, 43" in text
    fedavg = next(line for line in text.splitlines() if line.startswith("| FedAvg |"))
    # The paper's numbers of the columns the two small columns stand for: 60.17 and 56.75.
    assert "(60.17)" in fedavg and "(56.75)" in fedavg, fedavg
    assert text.count("Spearman rank correlation") == 2
    rows = list(csv.DictReader((folder / "table.csv").open()))
    assert len(rows) == 4 and {r["seeds"] for r in rows} == {"2"}
    scaffold = [r for r in rows if r["method"] == "SCAFFOLD"]
    assert [r["paper"] for r in scaffold] == ["60.69", "56.43"]
    assert all(0.0 < float(r["ours_mean"]) <= 100.0 for r in rows)
    assert (folder / "table.png").stat().st_size > 0
    # Each cell is a sweep: ordinary run folders, one per seed, each row written once.
    metrics = list(folder.rglob("metrics.jsonl"))
    assert len(metrics) == 8
    for path in metrics:
        rounds = [json.loads(line)["round"] for line in path.read_text().splitlines()]
        assert rounds == [0, 1, 2, 3], (path, rounds)

    full = _Command(["fedpac:table1", "--scale=small", f"--workdir={workdir}",
                     "--methods=FedAvg"], cache)  # fmt: skip
    full.wait_for(workdir / "FedAvg" / column / "seed=42" / "metrics.jsonl")
    full.process.send_signal(signal.SIGTERM)
    code, _, err = full.finish()
    assert code == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert "SIGTERM: stopped;" in err, err
    assert (workdir / "FedAvg").is_dir() and not (workdir / "table.md").exists()


def test_only_a_reduced_run_gets_its_own_folder(tmp_path):
    table = TABLES["fedpac:table1"]
    assert reproduce.run_folder(table, "small", tmp_path, [42, 43], 30) == tmp_path
    assert reproduce.run_folder(table, "small", tmp_path, [42], None).name == "reduced_seeds=42"
    paper = reproduce.run_folder(table, "paper", tmp_path, None, 30)
    assert paper.name == "reduced_rounds=30"


def test_a_workdir_of_another_setting_is_refused_in_one_line_keeping_its_runs(tmp_path, capsys):
    workdir = tmp_path / "table"
    column = reproduce._slug(reproduce._small_name(TABLES["fedpac:table1"].columns[0]))
    sweep = workdir / "reduced_seeds=42,rounds=1" / "FedAvg" / column
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text('{"config": {}, "grid": {}}')
    args = ["fedpac:table1", f"--workdir={workdir}", "--methods=FedAvg", "--seeds=42", "--rounds=1"]
    assert reproduce.main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {workdir / 'reduced_seeds=42,rounds=1'} holds runs of another")
    assert "--overwrite" not in err and "another --workdir" in err
    assert (sweep / "sweep.json").read_text() == '{"config": {}, "grid": {}}'
    documented = err.replace(str(workdir / "reduced_seeds=42,rounds=1"), "$WORKDIR")
    assert f"| {documented} |" in (REPO / "docs" / "ERRORS.md").read_text()
    # A label the table lacks: refused before anything runs.
    assert reproduce.main(["fedpac:table1", f"--workdir={workdir}", "--methods=FedAvg,Nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --methods: ['Nope'] not in fedpac:table1; valid: ['FedAvg',")
    assert f"| {err} |" in (REPO / "docs" / "ERRORS.md").read_text()


def test_no_message_suggests_an_overwrite():
    """--overwrite discards a run, and experiments.reproduce has none: no message of the
    commands or the library names it (each says which --workdir keeps the data)."""
    import ast

    found = []
    for path in [*REPO.glob("experiments/**/*.py"), *REPO.glob("fedorth/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if "--overwrite" in node.value and not node.value.startswith("Discard"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found
