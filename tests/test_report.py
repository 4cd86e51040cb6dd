"""experiments.report on hand-written run folders: numbers vs NumPy, grouping, markdown, plot."""

import json
import pathlib

import numpy as np
import pytest

from experiments import report


def _config(algorithm="fedavg", seed=42, *, optim="sgd", lr=0.1, dataset="digits", alpha=0.3):
    return {
        "seed": seed,
        "data": {
            "name": dataset,
            "partition": "dirichlet_label_split" if alpha else "iid",
            "alpha": alpha,
            "num_clients": 20,
            "data_dir": None,
        },
        "model": {"name": "mlp", "hidden_sizes": [128, 128]},
        "fed": {"algorithm": algorithm, "rounds": 20, "clients_per_round": 5, "options": {}},
        "optim": {"name": optim, "learning_rate": lr},
        "eval_every": 5,
    }


def _write_run(path: pathlib.Path, config: dict, rows: list[dict]) -> pathlib.Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(acc: list[float], loss: list[float], *, up=0.1, down=0.2, score="test_accuracy"):
    return [
        {
            "round": 5 * (i + 1),
            "train_loss": 1.0,
            "test_loss": l,
            score: a,
            "comm_mb_up": up,
            "comm_mb_down": down,
            "comm_mb_round": (up + down) * 5,
            "wall_s": float(i),
        }
        for i, (a, l) in enumerate(zip(acc, loss, strict=True))
    ]


# Final (round 20) accuracies / losses of three FedAvg seeds and two FedPAC_SOAP seeds.
FEDAVG = {42: (0.90, 0.31), 43: (0.92, 0.27), 44: (0.87, 0.40)}
FEDPAC = {42: (0.95, 0.15), 43: (0.97, 0.11)}


@pytest.fixture()
def runs(tmp_path):
    for seed, (acc, loss) in FEDAVG.items():
        _write_run(
            tmp_path / f"fedavg_s{seed}",
            _config("fedavg", seed),
            _rows([0.5, 0.7, 0.8, acc], [1.0, 0.8, 0.5, loss]),
        )
    for seed, (acc, loss) in FEDPAC.items():
        _write_run(
            tmp_path / "soap" / f"fedpac_soap_s{seed}",
            _config("fedpac_soap", seed, optim="soap", lr=0.003),
            _rows([0.6, 0.8, 0.9, acc], [0.9, 0.5, 0.3, loss], up=0.3, down=0.4),
        )
    return tmp_path


def test_table_numbers_match_numpy(runs):
    """Mean ± sample std (ddof=1) of the final accuracy (%) and loss, as NumPy computes them."""
    text = report.report([runs])
    acc = np.array([v[0] for v in FEDAVG.values()])
    loss = np.array([v[1] for v in FEDAVG.values()])
    expected = (
        f"| fedavg | digits | mlp | per-class Dir-0.3 | 3 (42,43,44) | 20 "
        f"| {100 * acc.mean():.2f} ± {100 * acc.std(ddof=1):.2f} "
        f"| {loss.mean():.4f} ± {loss.std(ddof=1):.4f} | {(0.1 + 0.2) * 5:.3f} |"
    )
    assert expected in text.splitlines(), text
    acc = np.array([v[0] for v in FEDPAC.values()])
    loss = np.array([v[1] for v in FEDPAC.values()])
    expected = (
        f"| fedpac_soap | digits | mlp | per-class Dir-0.3 | 2 (42,43) | 20 "
        f"| {100 * acc.mean():.2f} ± {100 * acc.std(ddof=1):.2f} "
        f"| {loss.mean():.4f} ± {loss.std(ddof=1):.4f} | {(0.3 + 0.4) * 5:.3f} |"
    )
    assert expected in text.splitlines(), text
    # Header, separator, two rows.
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 4
    assert table[0].startswith("| algorithm | dataset | model | partition | seeds | round")


def test_mean_std_against_numpy():
    values = np.array([0.1, 0.4, 0.35, 0.9])
    mean, std = report.mean_std(values)
    np.testing.assert_allclose([mean, std], [values.mean(), values.std(ddof=1)], rtol=1e-15)
    assert report.mean_std(np.array([0.7])) == (0.7, 0.0)  # one run: no spread


def test_curves_mean_and_std_per_round(runs):
    groups = report.group_runs(report.find_runs([runs]))
    fedavg = next(g for g in groups if g.label == "fedavg")
    rounds, mean, std = report.curves(fedavg)
    per_seed = np.array([[0.5, 0.7, 0.8, v[0]] for v in FEDAVG.values()])  # [seeds, rounds]
    np.testing.assert_array_equal(rounds, [5, 10, 15, 20])
    np.testing.assert_allclose(mean, per_seed.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(std, per_seed.std(axis=0, ddof=1), rtol=1e-12, atol=1e-15)


def test_unfinished_run_is_read_at_the_common_round(tmp_path):
    """A run stopped at round 10 makes the group report round 10 for every seed."""
    _write_run(tmp_path / "a", _config(seed=1), _rows([0.5, 0.6, 0.7, 0.8], [4, 3, 2, 1]))
    _write_run(tmp_path / "b", _config(seed=2), _rows([0.3, 0.4], [6, 5]))
    (group,) = report.group_runs(report.find_runs([tmp_path]))
    stats = report.summarize(group)
    assert stats["round"] == 10
    np.testing.assert_allclose(stats["score"], (0.5, np.std([0.6, 0.4], ddof=1)), rtol=1e-12)
    np.testing.assert_allclose(stats["test_loss"], (4.0, np.std([3.0, 5.0], ddof=1)))


def test_failed_diverged_and_stopped_runs_are_named_not_dashes(tmp_path):
    """A run without an evaluated round, one with a non-finite loss and one stopped early are
    reported as such, under the table and in their row's round column; the diverged run's row
    reads "diverged", not the numbers of its last finite round."""
    _write_run(tmp_path / "ok", _config(seed=1), _rows([0.5, 0.6, 0.7, 0.8], [4, 3, 2, 1]))
    _write_run(tmp_path / "stopped", _config(seed=2), _rows([0.3, 0.4], [6, 5]))
    _write_run(tmp_path / "failed", _config("scaffold", seed=1), [])
    diverged = _rows([0.5, 0.1], [2.0, float("inf")])
    _write_run(tmp_path / "diverged", _config("fedcm", seed=1), diverged)
    text = report.report([tmp_path])
    rows = {
        line.split(" | ")[0].strip("| "): line for line in text.splitlines() if "Dir-0.3 |" in line
    }
    assert rows["scaffold"].split(" | ")[5] == "failed", rows["scaffold"]
    assert rows["fedavg"].split(" | ")[5] == "10 (incomplete)", rows["fedavg"]
    assert rows["fedcm"].split(" | ")[5:8] == ["diverged", "diverged (1 of 1 runs)", "—"]
    notes = text.split("Runs that did not reach fed.rounds:\n\n")[1].splitlines()
    assert sorted(notes) == sorted(
        [
            f"* {(tmp_path / 'stopped').resolve()}: incomplete: stopped at round 10 of 20",
            f"* {(tmp_path / 'failed').resolve()}: failed: no evaluated round in metrics.jsonl",
            f"* {(tmp_path / 'diverged').resolve()}: diverged at round 10 (test_loss is inf)",
        ]
    ), notes
    assert "Runs that did not reach" not in report.report([tmp_path / "ok"])


def test_other_config_differences_split_groups_and_are_named(tmp_path):
    for lr in (0.1, 0.05):
        for seed in (1, 2):
            _write_run(
                tmp_path / f"lr{lr}_s{seed}",
                _config(seed=seed, lr=lr),
                _rows([0.5, 0.6], [1.0, 0.9]),
            )
    groups = report.group_runs(report.find_runs([tmp_path]))
    assert sorted(g.label for g in groups) == [
        "fedavg (optim.learning_rate=0.05)",
        "fedavg (optim.learning_rate=0.1)",
    ]
    assert all(len(g.runs) == 2 for g in groups)


def test_settings_and_labels(tmp_path):
    _write_run(tmp_path / "a", _config("fedpac", optim="adamw"), _rows([0.5], [1.0]))
    _write_run(tmp_path / "b", _config("scaffold", optim="adamw"), _rows([0.5], [1.0]))
    _write_run(tmp_path / "c", _config("fedavg", dataset="cifar100", alpha=None), _rows([0.5], [1]))
    groups = report.group_runs(report.find_runs([tmp_path]))
    assert {(g.label, g.setting) for g in groups} == {
        ("fedpac+adamw", ("digits", "mlp", "per-class Dir-0.3")),
        ("scaffold+adamw", ("digits", "mlp", "per-class Dir-0.3")),
        ("fedavg", ("cifar100", "mlp", "iid")),
    }


def test_auc_is_reported_when_logged(tmp_path):
    _write_run(tmp_path / "a", _config(seed=1), _rows([0.7, 0.8], [1, 1], score="test_auc"))
    _write_run(tmp_path / "b", _config(seed=2), _rows([0.6, 0.9], [1, 1], score="test_auc"))
    text = report.report([tmp_path])
    assert "test AUC (%)" in text
    assert f"| {85:.2f} ± {100 * np.std([0.8, 0.9], ddof=1):.2f} |" in text


def test_comm_falls_back_to_up_plus_down_times_clients(tmp_path):
    rows = _rows([0.5], [1.0], up=0.25, down=0.5)
    del rows[0]["comm_mb_round"]
    _write_run(tmp_path / "a", _config(), rows)
    (group,) = report.group_runs(report.find_runs([tmp_path]))
    assert report.summarize(group)["comm"] == pytest.approx((0.25 + 0.5) * 5)


def test_cli_writes_markdown_and_png(runs, tmp_path, capsys):
    out, png = tmp_path / "report.md", tmp_path / "report.png"
    report.main([str(runs / "fedavg_s42"), str(runs / "fedavg_s43"), str(runs / "soap"), "--out",
                 str(out), "--plot", str(png)])  # fmt: skip
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert "| 2 (42,43) |" in text  # two of the three FedAvg seeds were named
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_truncated_last_line_is_ignored(tmp_path):
    path = _write_run(tmp_path / "a", _config(), _rows([0.5, 0.6], [1.0, 0.9]))
    with (path / "metrics.jsonl").open("a") as f:
        f.write('{"round": 15, "test_acc')
    assert [r["round"] for r in report.load_run(path).rows] == [5, 10]


def test_no_runs_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No run folders"):
        report.report([tmp_path])


def test_cli_plots_by_default_beside_the_runs_or_out(runs, tmp_path, monkeypatch, capsys):
    """No --plot: the figure (PNG and PDF) is report.png/.pdf in the folder the DIRs share, or
    beside --out; never in the current folder."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    report.main([str(runs / "soap")])
    assert (runs / "soap" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (runs / "soap" / "report.pdf").read_bytes()[:5] == b"%PDF-"
    report.main([str(runs / "soap"), str(runs / "fedavg_s42")])
    assert (runs / "report.png").exists() and (runs / "report.pdf").exists()
    out = tmp_path / "sub" / "table.md"
    out.parent.mkdir()
    report.main([str(runs / "soap"), "--out", str(out)])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.with_suffix(".pdf").exists()
    report.main([str(runs / "soap"), "--plot", str(tmp_path / "figs" / "fig.svg")])
    assert (tmp_path / "figs" / "fig.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "figs" / "fig.png").exists()
    (runs / "report.png").unlink()
    report.main([str(runs / "soap"), str(runs / "fedavg_s42"), "--no-plot"])
    assert not (runs / "report.png").exists()
    assert list(cwd.iterdir()) == []
    err = capsys.readouterr().err
    assert f"figure: {runs / 'report.png'} and {runs / 'report.pdf'} (--plot PATH" in err, err


def test_duplicate_seed_is_one_run_with_a_warning(runs, tmp_path, capsys):
    """A copy of the seed-42 FedAvg run (fewer rounds) is not a fourth seed: the table keeps three
    seeds, the full-length run, and the NumPy mean/std of FEDAVG; the warning names the copy."""
    copy = _write_run(tmp_path / "copy_s42", _config("fedavg", 42), _rows([0.5, 0.7], [1.0, 0.8]))
    groups = report.group_runs(report.find_runs([runs, copy]))
    fedavg = next(g for g in groups if g.label == "fedavg")
    assert [run.config["seed"] for run in fedavg.runs] == [42, 43, 44]
    assert copy.resolve() not in {run.path.resolve() for run in fedavg.runs}
    acc = np.array([a for a, _ in FEDAVG.values()])
    mean, std = report.summarize(fedavg)["score"]
    assert (mean, std) == pytest.approx((acc.mean(), acc.std(ddof=1)))
    err = capsys.readouterr().err
    assert "warning: fedavg: 2 runs have seed 42" in err and str(copy) in err, err


@pytest.mark.parametrize(
    "algorithm,optimizer,server_opt,label",
    [
        ("fedavg", "sgd", None, "fedavg"),
        ("fedavg", "sgd", "yogi", "fedyogi"),
        ("fedavg", "sgd", "adagrad", "fedadagrad"),
        ("fedavg", "adamw", "nesterov", "diloco"),
        ("fedavg", "muon", "nesterov", "muloco"),
        ("fedmuon", "muon", "nesterov", "fedmuon (nesterov server)"),
        ("fedavg", "adamw", "yogi", "fedavg+adamw (yogi server)"),
    ],
)
def test_a_server_optimizer_gets_its_own_row_label(algorithm, optimizer, server_opt, label):
    """A run whose fed.options.server_opt replaces the server optimizer is not labelled as the
    algorithm without it: FedYogi and DiLoCo rows are not FedAvg's."""
    options = {} if server_opt is None else {"server_opt": server_opt}
    config = {"fed": {"algorithm": algorithm, "options": options}, "optim": {"name": optimizer}}
    assert report.algorithm_label(config) == label
