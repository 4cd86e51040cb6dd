"""``python -m experiments.sweep ... --distributed``: a sweep over every device of every process,
as real localhost processes of two CPU devices each (gloo), from docs/SWEEPS.md's recipe.

One run serves the assertions of the main test: the recipe's two processes, one killed after
the first checkpoint, the same command again: the sweep resumes, each replica's folder is written
once (by the process whose devices run it), the checkpoint by both, and every replica equals its
single run to float32 rounding.

Another serves the signals' test: SIGTERM to process 1, Ctrl-C to process 0, two signals to
process 1, each stopping a run of the same command, then the grid grown by a seed; the replicas
end equal to their single runs.
"""

import io
import json
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import process_lines
from test_distributed import _env, _free_port, _stop, _wait_for_line

from configs import fedavg
from fedorth.sweep import Grid
from fedorth.sweep.runner import run_sweep

ROOT = pathlib.Path(__file__).parent.parent
SWEEPS = ROOT / "docs" / "SWEEPS.md"
ERRORS = ROOT / "docs" / "ERRORS.md"


def recipe() -> tuple[dict[str, str], list[str]]:
    """docs/SWEEPS.md's CPU recipe: its environment and its command (one process's)."""
    blocks = re.findall(r"```bash\n(.*?)```", SWEEPS.read_text(), re.S)
    block = next(b for b in blocks if "JAX_NUM_CPU_DEVICES" in b and "experiments.sweep" in b)
    lines = block.replace("\\\n", " ").splitlines()
    line = next(line for line in lines if "experiments.sweep" in line)
    words = shlex.split(line.split("&")[0])  # without the shell's `&`: one process's command
    env = dict(w.split("=", 1) for w in words[: words.index("python")])
    return env, words[words.index("python") :]


def _command(tmp_path: pathlib.Path, port: int, process: int) -> list[str]:
    env, words = recipe()
    out = []
    for word in words:
        flag, _, value = word.partition("=")
        if flag == "--workdir":
            word = f"--workdir={tmp_path / 'sweep'}"
        elif flag == "--coordinator_address":
            word = f"--coordinator_address=127.0.0.1:{port}"
        out.append(word.replace("$i", str(process)))
    assert out[:3] == ["python", "-m", "experiments.sweep"], out
    return [sys.executable, *out[1:]]


def _start(tmp_path, xla_cache, name: str, *extra: str) -> list[subprocess.Popen]:
    env, _ = recipe()
    port = _free_port()
    processes = []
    for i in range(2):
        with (tmp_path / f"{name}_{i}.log").open("w") as out:
            processes.append(
                subprocess.Popen(
                    [*_command(tmp_path, port, i), *extra],
                    cwd=ROOT,
                    env=_env(int(env["JAX_NUM_CPU_DEVICES"]), xla_cache),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    return processes


def _lines(log: pathlib.Path) -> list[str]:
    return _lines_of(log.read_text())


def _lines_of(output: str) -> list[str]:
    """What a process said, without the progress lines and gloo's."""
    return [line for line in output.splitlines() if line and not line.startswith(("[", "W"))]


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, xla_cache):
    """The recipe; process 1 killed once round 3 ran (after checkpoint 2); the recipe again."""
    tmp_path = tmp_path_factory.mktemp("distributed_sweep")
    processes = _start(tmp_path, xla_cache, "first")
    log = tmp_path / "first_0.log"
    try:
        deadline = time.monotonic() + 300
        while "round 3/" not in log.read_text():
            assert time.monotonic() < deadline and processes[0].poll() is None, log.read_text()
            time.sleep(0.2)
        processes[1].send_signal(signal.SIGKILL)
        processes[0].wait(timeout=60)
    finally:
        _stop(processes)
    first = processes[0].returncode, _lines(log), processes[1].pid
    processes = _start(tmp_path, xla_cache, "again")
    try:
        for p in processes:
            p.wait(timeout=300)
    finally:
        _stop(processes)
    codes = [p.returncode for p in processes]
    return tmp_path, first, codes


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Each replica's single run: the recipe's sweep in this process, one replica at a time on
    one device, bit for bit (tests/test_sweep.py)."""
    return _reference(tmp_path_factory.mktemp("single_runs"))


def _reference(tmp_path: pathlib.Path) -> dict[str, list[dict]]:
    """The recipe's sweep in this process, one replica at a time on one device."""
    _, words = recipe()
    config = fedavg.get_config()
    grid = {}
    for word in words:
        flag, _, value = word.partition("=")
        if flag.startswith("--config."):
            *path, key = flag.removeprefix("--config.").split(".")
            node = config
            for part in path:
                node = node[part]
            node[key] = type(node[key])(value)
        elif flag.startswith("--sweep."):
            grid[flag.removeprefix("--sweep.")] = value
    run_sweep(config, Grid(config, grid), tmp_path / "reference", stream=io.StringIO())
    return {
        folder.name: _rows(folder)
        for folder in (tmp_path / "reference").iterdir()
        if (folder / "metrics.jsonl").exists()
    }


def _assert_equal_to_single_runs(sweep: pathlib.Path, single_runs: dict[str, list[dict]]) -> None:
    """Each replica of ``sweep`` has one row of each of the recipe's rounds 0..6, equal to its
    single run's to float32 rounding (its round runs vmapped)."""
    for name, theirs in single_runs.items():
        ours = _rows(sweep / name)
        assert [row["round"] for row in ours] == list(range(7)), name
        for a, b in zip(ours, theirs, strict=True):
            assert a.keys() == b.keys(), name
            for key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=2e-5, atol=2e-6, err_msg=name)


def _rows(folder: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


@pytest.mark.slow
def test_the_recipe_resumes_after_a_process_is_killed_and_equals_the_single_runs(
    killed_and_resumed, single_runs
):
    workdir, (code, lines, victim), codes = killed_and_resumed
    # The survivor names the killed process in one line, exit code 1.
    assert code == 1, lines
    assert len(lines) == 1 or lines[-1].startswith("error: process 1"), lines
    assert lines[-1].startswith(f"error: process 1 (pid {victim} on "), lines
    assert "Start the same command on every process again" in lines[-1]
    assert codes == [0, 0], [(workdir / f"again_{i}.log").read_text()[-3000:] for i in range(2)]
    said = (workdir / "again_0.log").read_text()
    assert "Resumed the sweep from round 2" in said, said
    # 3 replicas over 4 devices: one slot of the round runs a copy.
    assert (
        "Placed 3 replicas on 4 devices of 2 processes: 4 groups of 1 device "
        "(--sweep.devices_per_replica) with 0 to 1 replicas each" in said
    ), said
    assert "Finished the sweep at round 6: 3 replicas" in said
    # Process 1 prints nothing of the sweep's: process 0 speaks for it.
    assert "Finished the sweep" not in (workdir / "again_1.log").read_text()
    sweep = workdir / "sweep"
    folders = sorted(f.name for f in sweep.iterdir() if f.is_dir())
    assert folders == ["checkpoints", "seed=42", "seed=43", "seed=44"], folders
    assert (
        sorted(int(p.name) for p in (sweep / "checkpoints").iterdir() if p.name.isdigit())[-1] == 6
    )
    assert sorted(single_runs) == ["seed=42", "seed=43", "seed=44"]
    # Each round's row once: written by one process, cut back to the checkpoint and written
    # again after the kill.
    _assert_equal_to_single_runs(sweep, single_runs)
    for name in single_runs:
        info = json.loads((sweep / name / "run_info.json").read_text())
        assert len(info["round_devices"]) == 4, info["round_devices"]
        # The compiled round, read in each process: one replica per device, no collective.
        assert info["replica_collectives"] == {"count": 0, "across_replicas": []}, info


@pytest.mark.slow
def test_processes_given_other_grids_are_refused_in_one_line(tmp_path, xla_cache):
    """Every process compares a digest of its config and grid with the others' at the start."""
    env, _ = recipe()
    port = _free_port()
    processes = []
    for i, seeds in enumerate(["42,43", "42,44"]):
        command = [
            *[w for w in _command(tmp_path, port, i) if not w.startswith("--sweep.seed=")],
            f"--sweep.seed={seeds}",
        ]
        processes.append(
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=_env(int(env["JAX_NUM_CPU_DEVICES"]), xla_cache),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=120)[0] for p in processes]
    finally:
        _stop(processes)
    message = (
        "error: process 1 of the run's 2 got another config or grid than process 0 (another "
        "--config, --config.*, --sweep.* or --replica_* flag, or another config file): start "
        "every process with the same command."
    )
    for p, output in zip(processes, outputs, strict=True):
        lines = process_lines(output)
        assert p.returncode == 2, output[-3000:]
        assert lines == [message], output[-3000:]
    assert message in (ROOT / "docs" / "ERRORS.md").read_text()
    assert not (tmp_path / "sweep").exists()


# -------------------------------------------------------- signals to one process; a grid grown

TWO_SEEDS = "--sweep.seed=42,43"  # the recipe's grid without seed 44, added by the last run


def _steps(sweep: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (sweep / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def signalled(tmp_path_factory, xla_cache):
    """Seeds 42, 43 of the recipe, run four times in one workdir: SIGTERM to process 1 once the
    rounds run; the same command, Ctrl-C to process 0 once it resumed; the same command, two
    signals to process 1 before its next round ends; the recipe's grid (seed 44 added), to the
    end. Each run's exit codes and outputs, the newest checkpoint after it, process 1's pid."""
    tmp_path = tmp_path_factory.mktemp("signalled_sweep")
    sweep = tmp_path / "sweep"
    ran = {}

    def run(name, extra, when=None, act=None):
        processes = _start(tmp_path, xla_cache, name, *extra)
        try:
            if when is not None:
                deadline = time.monotonic() + 300
                _wait_for_line(tmp_path / f"{name}_0.log", when, processes, deadline)
                act(processes)
            for p in processes:  # a stop takes seconds; the last run, its rounds
                p.wait(timeout=60 if when else 300)
        finally:
            _stop(processes)
        outputs = [(tmp_path / f"{name}_{i}.log").read_text() for i in range(2)]
        results = [(p.returncode, out) for p, out in zip(processes, outputs, strict=True)]
        written = {r: [row["round"] for row in _rows(sweep / r)] for r in ("seed=42", "seed=43")}
        ran[name] = results, _steps(sweep), processes[1].pid, written

    def twice(processes):
        # Process 0 held (SIGSTOP): process 1 cannot end a round, its stop agreed with process
        # 0's, before both of its signals are in; the second stops it at once.
        processes[0].send_signal(signal.SIGSTOP)
        try:
            time.sleep(1)
            processes[1].send_signal(signal.SIGTERM)
            time.sleep(0.5)
            processes[1].send_signal(signal.SIGINT)
            time.sleep(0.5)
        finally:
            processes[0].send_signal(signal.SIGCONT)

    run("sigterm", [TWO_SEEDS], "round 0/", lambda ps: ps[1].send_signal(signal.SIGTERM))
    run("sigint", [TWO_SEEDS], "Resumed the sweep", lambda ps: ps[0].send_signal(signal.SIGINT))
    run("twice", [TWO_SEEDS], "Resumed the sweep", twice)
    run("grown", [])
    return sweep, ran


def _stop_round(output: str, how: str, sweep: pathlib.Path) -> int:
    """The round of the one stop message in ``output``."""
    found = re.findall(
        rf"interrupted \({how}\) at round (\d+); the same command resumes the sweep from round "
        rf"\1 \(({re.escape(str(sweep))})\)\.",
        output,
    )
    assert len(found) == 1, output[-3000:]
    return int(found[0][0])


@pytest.mark.slow
def test_a_signal_to_one_process_stops_every_process_at_one_saved_round_and_a_grown_grid_catches_up(
    signalled, single_runs
):
    sweep, ran = signalled
    # SIGTERM to process 1 (a scheduler's notice): both save the same round and stop, 143.
    # Ctrl-C to process 0 (a terminal's), after the same command resumed: the same, 130.
    resumed = 0
    for name, how, code in (("sigterm", "SIGTERM", 143), ("sigint", "SIGINT", 130)):
        results, steps, _, written = ran[name]
        rounds = []
        for i, (returncode, output) in enumerate(results):
            assert returncode == code, (name, i, output[-3000:])
            for unwanted in ("Traceback", "Check failure", "stopped (killed, crashed"):
                assert unwanted not in output, (name, i, output[-3000:])
            rounds.append(_stop_round(output, how, sweep))
        assert rounds[0] == rounds[1], f"{name}: the processes stopped at rounds {rounds}"
        assert resumed < rounds[0] < 6, (name, rounds)
        assert steps[-1] == rounds[0], f"{name}: round {rounds[0]} is saved ({steps})"
        if resumed:
            assert f"Resumed the sweep from round {resumed} in {sweep}." in results[0][1]
        if how == "SIGTERM":  # docs/ERRORS.md's row, the round and the folder as placeholders
            line = next(x for x in results[0][1].splitlines() if x.startswith("interrupted"))
            line = line.replace(str(sweep), "$WORKDIR").replace(str(rounds[0]), "$ROUND")
            assert (
                "| `experiments.sweep --distributed`, 2 processes: SIGTERM to process 1 (both "
                f"processes; exit code 143) | {line} |"
            ) in ERRORS.read_text(), line
        for replica, rows in written.items():  # each saved round's row, once
            assert rows == list(range(rounds[0] + 1)), (name, replica, rows)
        resumed = rounds[0]
    # Two signals to process 1: it stops at once (no save); process 0 names it lost, exit 1.
    (code_0, output_0), (first, output_1) = ran["twice"][0]
    _, steps, victim, _ = ran["twice"]
    assert steps[-1] == resumed, steps
    # SIGTERM, then Ctrl-C: the signal handled second stops it, with its exit code (130 for the
    # Ctrl-C; both pending while a collective holds the main thread, Python handles SIGINT first).
    notices = re.findall(r"\n(SIGTERM|SIGINT): stopping after the round in progress", output_1)
    assert len(notices) == 1, output_1[-3000:]
    second = signal.SIGINT if notices[0] == "SIGTERM" else signal.SIGTERM
    assert first == 128 + second, output_1[-3000:]
    line = f"the same command resumes the sweep from round {resumed} ({sweep})."
    found = re.findall(rf"\ninterrupted at round (\d+); {re.escape(line)}\n", output_1)
    assert len(found) == 1 and int(found[0]) >= resumed, output_1[-3000:]
    assert (
        "| `experiments.sweep --distributed`, 2 processes: SIGTERM, then Ctrl-C, to process 1 "
        "(process 1, exit code 130; process 0 names it as lost, exit code 1) | interrupted at "
        "round $ROUND; the same command resumes the sweep from round $SAVED ($WORKDIR). |"
    ) in ERRORS.read_text()
    assert "Traceback" not in output_1, output_1[-3000:]
    lines = _lines_of(output_0)
    assert code_0 == 1, output_0[-3000:]
    assert lines[-1].startswith(f"error: process 1 (pid {victim} on "), lines
    # The grid grown by seed 44 on both processes: seed 44 runs from round 0 to the saved round,
    # the others resume from it, and every replica ends equal to its single run.
    results, steps, _, _ = ran["grown"]
    assert [code for code, _ in results] == [0, 0], [o[-3000:] for _, o in results]
    said = results[0][1]
    assert f"Resumed the sweep from round {resumed} in {sweep}." in said, said[-3000:]
    assert f"New in the grid, run from round 0 up to round {resumed} first: seed=44." in said
    assert "Finished the sweep at round 6: 3 replicas" in said, said[-3000:]
    assert steps[-1] == 6, steps
    _assert_equal_to_single_runs(sweep, single_runs)
