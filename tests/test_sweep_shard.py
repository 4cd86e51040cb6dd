"""``python -m experiments.sweep ... --sweep.shard=i/n``: a slice of the grid per independent job
(a SLURM job array, machines without a shared coordinator), all jobs in one workdir.

Job i runs replicas i, i + n, ... of the grid with its keys and values sorted (the same slices
whatever the order of the flags); each job keeps its checkpoints, ``sweep.json`` and lock in
``WORKDIR/shard_i_of_n``, and the replica folders are the workdir's, so
``experiments.report WORKDIR`` reads the union. Real processes, the tiny FedAvg of
tests/test_sweep.py.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
from reliability_helpers import compilation_cache_env
from test_sweep import TINY_ARGS

ROOT = pathlib.Path(__file__).parent.parent
ARGS = [*TINY_ARGS, "--sweep.seed=42,43", "--sweep.optim.learning_rate=0.1,0.05,0.02"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


def _sweep(
    workdir: pathlib.Path, *args: str, log: pathlib.Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "experiments.sweep", f"--workdir={workdir}", *ARGS, *args],
            cwd=ROOT,
            env=env or _env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _command(
    module: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m module *args``, to its end."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _finish(processes: list[subprocess.Popen], logs: list[pathlib.Path]) -> None:
    try:
        for p in processes:
            p.wait(timeout=600)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(processes, logs, strict=True):
        assert p.returncode == 0, log.read_text()[-3000:]


def _rows(folder: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


def _replicas(workdir: pathlib.Path) -> list[str]:
    return sorted(p.name for p in workdir.iterdir() if (p / "config.json").exists())


@pytest.mark.slow
def test_two_jobs_share_a_workdir_and_each_resumes_alone(tmp_path, cli_compilation_cache):
    """Jobs 0/2 and 1/2 of a 2 x 3 grid, 8 rounds, at once, beside the whole grid as one sweep
    of 12 rounds: every replica folder is written by one job, equal to the sweep's replica;
    ``experiments.report`` reads all six; job 1 alone, rerun with 12 rounds, resumes from its
    round 8 and ends equal to the sweep of 12 rounds, job 0's replicas untouched.

    Every command here runs to its end: they share the test process's compilation cache
    (tests/reliability_helpers.py's ``compilation_cache_env``, its lock for the three at once)."""
    env = compilation_cache_env(cli_compilation_cache, _env(), at_once=True)
    logs = [tmp_path / "job_0.log", tmp_path / "job_1.log", tmp_path / "whole.log"]
    jobs = [
        _sweep(
            tmp_path / "jobs",
            "--config.fed.rounds=8",
            f"--sweep.shard={i}/2",
            log=logs[i],
            env=env,
        )
        for i in range(2)
    ]
    whole = _sweep(tmp_path / "whole", "--config.fed.rounds=12", log=logs[2], env=env)
    _finish([*jobs, whole], logs)
    names = _replicas(tmp_path / "whole")
    assert len(names) == 6 and _replicas(tmp_path / "jobs") == names
    # Seeds and values sorted, replica i of the six goes to job i % 2: seed 42 to job 0.
    for i in range(2):
        identity = json.loads((tmp_path / "jobs" / f"shard_{i}_of_2" / "sweep.json").read_text())
        assert identity["sweep_shard"] == [i, 2]
        assert "3 replicas" in logs[i].read_text(), logs[i].read_text()[-3000:]
    for name in names:
        whole_rows = _rows(tmp_path / "whole" / name)
        assert [row["round"] for row in whole_rows] == [0, 4, 8, 12]
        assert _rows(tmp_path / "jobs" / name) == whole_rows[:3], name
    report = _command("experiments.report", str(tmp_path / "jobs"), "--no-plot", env=env)
    assert report.returncode == 0, report.stderr[-3000:]
    for rate in ("0.1", "0.05", "0.02"):
        assert re.search(rf"learning_rate={rate}\) \|.*\| 2 \(42,43\) \| 8 \|", report.stdout), (
            report.stdout
        )

    again = _sweep(
        tmp_path / "jobs",
        "--config.fed.rounds=12",
        "--sweep.shard=1/2",
        log=tmp_path / "again.log",
        env=env,
    )
    _finish([again], [tmp_path / "again.log"])
    assert "Resumed the sweep from round 8" in (tmp_path / "again.log").read_text()
    for name in names:
        expected = _rows(tmp_path / "whole" / name)
        held = _rows(tmp_path / "jobs" / name)
        assert held == (expected if "seed=43" in name else expected[:3]), name

    # A single run in a replica folder is refused: the replica's state is in its job's checkpoint.
    single = _command(
        "experiments.main",
        f"--workdir={tmp_path / 'jobs' / names[0]}",
        *(a for a in ARGS if not a.startswith("--sweep.")),
        env=env,
    )
    assert single.returncode == 1, single.stderr[-3000:]
    assert _one_line(single).startswith(
        f"error: {tmp_path / 'jobs' / names[0]} is a replica folder of the sweep in "
    ), single.stderr[-3000:]


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def _refused(tmp_path: pathlib.Path, *args: str) -> str:
    result = _command("experiments.sweep", f"--workdir={tmp_path / 'w'}", *ARGS, *args)
    assert result.returncode == 2, result.stderr[-3000:]
    return _one_line(result)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--sweep.shard=2/2"],
            "error: --sweep.shard=2/2: the slice index is 0 to 1 (--sweep.shard=i/n: job i of n).",
        ),
        (
            ["--sweep.shard=half"],
            "error: --sweep.shard=half: give the job's slice as i/n, job i of n jobs "
            "(0 <= i < n), e.g. --sweep.shard=0/4.",
        ),
        (
            ["--sweep.shard=6/8"],
            "error: --sweep.shard=6/8 lies outside the grid of 6 replicas (job 6 would hold "
            "none): use at most 6 jobs, --sweep.shard=i/6.",
        ),
        (
            ["--sweep.shard=0/2", "--distributed"],
            "error: --sweep.shard with --distributed: a slice of the grid is an independent job "
            "of one process; run the slices as separate jobs without --distributed, or the "
            "whole grid with --distributed.",
        ),
    ],
    ids=["index_out_of_range", "not_a_slice", "outside_the_grid", "with_distributed"],
)
def test_a_bad_slice_is_refused_in_one_line(tmp_path, args, message):
    """Before anything is built: exit code 2, one line, documented in docs/ERRORS.md."""
    assert _refused(tmp_path, *args) == message
    assert message.removeprefix("error: ") in (ROOT / "docs" / "ERRORS.md").read_text()


@pytest.mark.slow
def test_a_second_job_of_the_same_slice_is_refused_in_one_line(tmp_path):
    """Job 0/2 while another job 0/2 runs in the workdir: the slice's lock names the holder.
    Then the job with another grid: refused, naming both grids."""
    first = _sweep(
        tmp_path / "w", "--config.fed.rounds=100000", "--sweep.shard=0/2", log=tmp_path / "a.log"
    )
    try:
        deadline = time.monotonic() + 300
        while "round 4/" not in (tmp_path / "a.log").read_text():  # its first evaluation
            assert time.monotonic() < deadline and first.poll() is None, (
                tmp_path / "a.log"
            ).read_text()[-3000:]
            time.sleep(0.2)
        result = _command(
            "experiments.sweep",
            f"--workdir={tmp_path / 'w'}",
            *ARGS,
            "--config.fed.rounds=100000",
            "--sweep.shard=0/2",
        )
    finally:
        first.kill()
        first.wait()
    # The grid's size line, which every sweep prints first, then the refusal.
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("Grid of 3 replicas"), result.stderr[-3000:]
    line = lines[1]
    assert result.returncode == 1, result.stderr[-3000:]
    assert line.startswith(
        f"error: {tmp_path / 'w' / 'shard_0_of_2'} is in use by another run (pid {first.pid}"
    ), line
    documented = re.sub(
        r"\(pid \d+ on host .*?: .*?\)\. ",
        "(pid $PID on host $HOST, started $STARTED: $COMMAND). ",
        line.replace(str(tmp_path / "w"), "$WORKDIR"),
    )
    documented = documented.replace(f"kill {first.pid};", "kill $PID;")
    assert documented in (ROOT / "docs" / "ERRORS.md").read_text(), documented

    # The slice's job again, with a seed added: the grid deals the replicas to the jobs, so a job
    # keeps its grid.
    grown = [a.replace("--sweep.seed=42,43", "--sweep.seed=42,43,44") for a in ARGS]
    result = _command(
        "experiments.sweep", f"--workdir={tmp_path / 'w'}", *grown, "--sweep.shard=0/2"
    )
    assert result.returncode == 1, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    documented = re.sub(
        r"recorded in (checkpoint \d+|sweep\.json)",
        "recorded in $WHERE",
        line.replace(str(tmp_path / "w"), "$WORKDIR"),
    )
    assert documented in (ROOT / "docs" / "ERRORS.md").read_text(), documented
