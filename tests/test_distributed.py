"""Several processes: the command users run, ``python -m experiments.main --distributed``, as two
localhost processes (one CPU device each, gloo collectives).

The round's mesh spans both processes, so every all-reduce of the clients' summaries crosses
them; their metrics equal one process's over two devices. A process that is killed stops the
other within seconds with one line naming it.
"""

import ast
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import process_lines
from test_reliability import apply

from configs import fedavg
from fedorth import train
from fedorth.train import distributed

ROOT = pathlib.Path(__file__).parent.parent
# The tiny FedAvg MLP on the embedded digits, S = 2 clients per round: one per device.
TINY = [
    "--config=configs/fedavg.py",
    "--config.data.num_clients=4",
    "--config.fed.clients_per_round=2",
    "--config.fed.local_steps=3",
    "--config.model.hidden_sizes=(16,)",
    "--config.fed.strategy=sharded",
    "--config.eval_every=1",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory) -> pathlib.Path:
    """XLA's persistent compilation cache for this file's processes: every two-process run here
    compiles the same programs, so process 0 of the first run compiles them and process 0 of
    each later run loads them (in a multi-process run JAX reads and writes the cache in process
    0 only: process 1 compiles its own). A folder of this file's own, apart from the test
    session's: a process killed in the middle of writing an entry would leave it half written
    (the lost-process tests kill theirs once their rounds run, after every program is
    compiled)."""
    return tmp_path_factory.mktemp("xla_cache")


def _env(devices: int, xla_cache: pathlib.Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    # The test process's 8 forced fake devices go; any other XLA flags the user set stay, so
    # that every run compiles alike.
    env["XLA_FLAGS"] = " ".join(
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    )
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    env["JAX_PLATFORMS"] = "cpu"
    if xla_cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(xla_cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        # A size limit turns on the file lock: the processes of a run write the same entries.
        env["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2**36)
    # The repository first on the path: a clone that is not pip-installed imports its fedorth.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _cli(
    argv: list[str], devices: int, log: pathlib.Path, xla_cache: pathlib.Path
) -> subprocess.Popen:
    """``python -m experiments.main *argv`` on ``devices`` CPU devices, its output in ``log``."""
    with log.open("w") as out:  # stdout and stderr, read once the process ends
        return subprocess.Popen(
            [sys.executable, "-m", "experiments.main", *argv],
            cwd=ROOT,
            env=_env(devices, xla_cache),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _two_processes(
    argv: list[str], devices: int, logs: pathlib.Path, xla_cache: pathlib.Path
) -> list[subprocess.Popen]:
    """``argv`` as the two processes of one ``--distributed`` run on localhost, ``devices`` CPU
    devices each; process i's output in ``logs/process_i.log``."""
    port = _free_port()
    return [
        _cli(
            [
                *argv,
                "--distributed",
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
            ],
            devices=devices,
            log=logs / f"process_{i}.log",
            xla_cache=xla_cache,
        )
        for i in range(2)
    ]


def _distributed(
    workdir, rounds: int, tmp_path, xla_cache: pathlib.Path, *extra: str
) -> list[subprocess.Popen]:
    argv = [*TINY, f"--workdir={workdir}", f"--config.fed.rounds={rounds}", *extra]
    return _two_processes(argv, 1, tmp_path, xla_cache)


def _stop(processes):
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()


def _rows(path: pathlib.Path) -> list[dict]:
    """metrics.jsonl without the wall-clock times."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


def test_no_module_of_fedorth_starts_a_jax_backend_at_import():
    """jax.distributed.initialize must come before any backend starts: `--distributed` imports
    fedorth first. Every module, in a fresh process; then initialize still works."""
    script = """
import importlib, pkgutil
import jax
from jax._src import xla_bridge
import fedorth
started = []
for module in pkgutil.walk_packages(fedorth.__path__, "fedorth."):
    importlib.import_module(module.name)
    if xla_bridge._backends and not started:
        started.append(module.name)
assert not started, f"importing {started[0]} started a JAX backend"
jax.distributed.initialize("127.0.0.1:PORT", 1, 0, initialization_timeout=30)
print(len(jax.devices()), "modules imported, backend started after initialize")
""".replace("PORT", str(_free_port()))
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _tiny_config(rounds: int):
    """The config that TINY's flags and ``--config.fed.rounds=rounds`` make, in this process."""
    overrides = {}
    for flag in [*TINY[1:], f"--config.fed.rounds={rounds}"]:
        dotted, _, text = flag.removeprefix("--config.").partition("=")
        try:
            overrides[dotted] = ast.literal_eval(text)
        except ValueError:  # a string, as the command line passes it
            overrides[dotted] = text
    return apply(fedavg.get_config(), overrides)


@pytest.mark.slow
@pytest.mark.cpu_devices
def test_two_processes_of_the_cli_equal_one_process_over_two_devices(tmp_path, xla_cache):
    """The README's recipe on localhost: two `experiments.main --distributed` processes, one
    device each, against one process over two devices (this test's own: the round's mesh takes
    as many of its 8 devices as divide S = 2); the same round, program and numbers."""
    processes = _distributed(tmp_path / "two", 3, tmp_path, xla_cache)
    try:
        train.run(_tiny_config(rounds=3), tmp_path / "one")  # while the two processes run
        for p in processes:
            p.wait(timeout=300)
    finally:
        _stop(processes)
    for i, p in enumerate(processes):
        assert p.returncode == 0, (tmp_path / f"process_{i}.log").read_text()[-3000:]
    one = _rows(tmp_path / "one" / "metrics.jsonl")
    assert [row["round"] for row in one] == [0, 1, 2, 3]
    # Process 0 writes the run's files, process 1 its copy; both read the replicated metrics.
    assert _rows(tmp_path / "two" / "metrics.jsonl") == one
    assert _rows(tmp_path / "two" / "process_1" / "metrics.jsonl") == one
    for run in ("one", "two"):
        info = json.loads((tmp_path / run / "run_info.json").read_text())
        assert len(info["round_devices"]) == 2, info["round_devices"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "victim, how",
    [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)],
    ids=["process_1_killed", "coordinator_killed", "process_1_silent"],
)
def test_a_lost_process_stops_the_other_in_seconds_with_one_line(tmp_path, xla_cache, victim, how):
    """A killed process (its connections reset) is named about 2 s after the others' next
    collective fails; a silent one (SIGSTOP: a frozen or unplugged host) after the heartbeat
    timeout (3 s here). The survivor prints one line naming it, not JAX's abort and stack."""
    processes = _distributed(
        tmp_path / "run", 10_000, tmp_path, xla_cache, "--heartbeat_timeout_s=3"
    )
    survivor = 1 - victim
    log = tmp_path / f"process_{survivor}.log"
    try:
        deadline = time.monotonic() + 240
        # Both joined and running rounds; round 2 is the first that compiles nothing (rounds 0
        # and 1 compile the evaluation and the round), so no cache entry is left half written.
        while "round 2/" not in log.read_text():
            assert time.monotonic() < deadline and processes[survivor].poll() is None, (
                log.read_text()[-3000:]
            )
            time.sleep(0.2)
        os.kill(processes[victim].pid, how)
        start = time.monotonic()
        processes[survivor].wait(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        _stop(processes)
    output = log.read_text()
    # What is left after the progress lines ("[###...] round r/R ...", gloo's "[Gloo] Rank ...").
    lines = process_lines(output)
    assert processes[survivor].returncode == 1, output[-3000:]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith(
        f"error: process {victim} (pid {processes[victim].pid} on {socket.gethostname()}"
    ), lines[0]
    assert f"so process {survivor} stops too" in lines[0]
    assert "the run resumes from its last checkpoint" in lines[0]
    if how == signal.SIGKILL:  # docs/ERRORS.md shows both, with the pid, host and address named
        coordinator = next(a for a in processes[0].args if a.startswith("--coordinator_address="))
        line = lines[0].replace(
            f"pid {processes[victim].pid} on {socket.gethostname()}", "pid $PID on $HOST"
        )
        line = line.replace(coordinator.partition("=")[2], "$COORDINATOR")
        assert line == distributed.lost_message(
            {
                victim: "pid $PID on $HOST"
                + (", the coordinator at $COORDINATOR" if victim == 0 else "")
            },
            survivor,
            2,
        )
        assert line in (ROOT / "docs" / "ERRORS.md").read_text(), line
    assert elapsed < 20, f"process {survivor} took {elapsed:.0f} s to stop"


# JAX 0.10's fatal records, as its coordination client logs them before it aborts (the stacks cut).
_TERMINATING = (
    "F1126 10:31:22.940790   28791 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. This most likely indicates that another task died; see the "
    "other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to "
    "see all the previous output. absl::Status: "
)
_STACK = "*** Check failure stack trace: ***\n    @     0x7f1ac4440634  absl::LogMessage::Flush()\n"


@pytest.mark.parametrize(
    "status, me, lost",
    [
        (  # the coordinator's view of two silent processes
            "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n2\n"
            "The tasks have crashed. Check the task logs for an earlier error, or scheduler events "
            "(e.g. preemption, eviction) to debug further.\n\nRPC: /xla.coordination."
            "CoordinationService/PollForError [type.googleapis.com/tensorflow."
            "CoordinationServiceError='']\n",
            0,
            [1, 2],
        ),
        (  # a process whose heartbeat the silent coordinator no longer answers
            "DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/"
            "Heartbeat\n",
            1,
            [0],
        ),
        (  # another error: the polling RPC failed, naming nobody
            "UNAVAILABLE: Socket closed\n\nRPC: /xla.coordination.CoordinationService/"
            "PollForError\n",
            1,
            [],
        ),
    ],
    ids=["unhealthy_tasks", "coordinator_silent", "names_nobody"],
)
def test_the_processes_jax_fatal_record_names_lost(status, me, lost):
    """The abort handler's second witness, beside the stamped counters: JAX's heartbeat can abort
    before a silent process's counter has stood still for long enough. If JAX rewords these
    records, the silent-process case of the lost-process test fails too (exit 134)."""
    assert distributed.lost_in_record(_TERMINATING + status + _STACK, me) == lost


@pytest.mark.slow
def test_process_i_writes_its_files_apart_and_shares_the_checkpoints(tmp_path, monkeypatch):
    """As process 1 of several: config.json, run_info.json and metrics.jsonl go to
    workdir/process_1 (two processes writing workdir/config.json raced: FileNotFoundError), and
    the checkpoints, written by all processes together, to workdir/checkpoints."""
    import types

    from fedorth.train import loop

    as_process_1 = types.SimpleNamespace(**{**vars(jax), "process_index": lambda: 1})
    monkeypatch.setattr(loop, "jax", as_process_1)
    # The round of the two-process test's reference run (compiled once per worker).
    config = _tiny_config(rounds=1)
    config.eval_every = config.checkpoint_every = 0
    train.run(config, tmp_path)
    own = tmp_path / "process_1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "process_1"]
    for name in ("config.json", "run_info.json", "metrics.jsonl"):
        assert (own / name).is_file(), name
    assert [json.loads(line)["round"] for line in (own / "metrics.jsonl").open()] == [1]
    assert (tmp_path / "checkpoints" / "1").is_dir()


def _wait_for_line(log: pathlib.Path, text: str, processes, deadline: float) -> None:
    while text not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        assert all(p.poll() is None for p in processes), log.read_text()[-3000:]
        time.sleep(0.2)


def _stopped(processes, tmp_path, how: str) -> list[tuple[int, str]]:
    """Each process's exit code and output after the signal(s), within 60 s."""
    start = time.monotonic()
    for p in processes:
        p.wait(timeout=60)
    assert time.monotonic() - start < 30, f"{how}: the processes took too long to stop"
    return [
        (p.returncode, (tmp_path / f"process_{i}.log").read_text()) for i, p in enumerate(processes)
    ]


@pytest.mark.slow
def test_sigterm_and_ctrl_c_stop_every_process_at_one_saved_round(tmp_path, xla_cache):
    """SIGTERM to process 1 alone (a scheduler's notice): both processes save the same round and
    stop with its message and exit code 143. The same command resumes from it; Ctrl-C in both
    (a terminal's): both save the round and stop, exit code 130. No traceback, no C++ stack."""
    workdir = tmp_path / "run"
    for how, victims, signum in (
        ("SIGTERM", [1], signal.SIGTERM),
        ("SIGINT", [0, 1], signal.SIGINT),
    ):
        before = sorted(int(p.name) for p in (workdir / "checkpoints").glob("[0-9]*"))
        processes = _distributed(workdir, 10_000, tmp_path, xla_cache)
        try:
            deadline = time.monotonic() + 240
            for i in range(2):
                _wait_for_line(tmp_path / f"process_{i}.log", "round 2", processes, deadline)
            if before:  # the second run resumed from the first one's stop
                log = (tmp_path / "process_0.log").read_text()
                assert f"Resumed from round {before[-1]} in {workdir}." in log, log[-3000:]
            for i in victims:
                os.kill(processes[i].pid, signum)
            results = _stopped(processes, tmp_path, how)
        finally:
            _stop(processes)
        rounds = []
        for i, (code, output) in enumerate(results):
            assert code == 128 + signum, output[-3000:]
            for unwanted in ("Traceback", "Check failure", "stopped (killed, crashed"):
                assert unwanted not in output, output[-3000:]
            found = re.findall(
                rf"interrupted \({how}\) at round (\d+); the same command resumes "
                rf"from round \1 \((\S+)\)\.",
                output,
            )
            assert len(found) == 1, output[-3000:]
            assert found[0][1] == str(workdir if i == 0 else workdir / "process_1")
            rounds.append(int(found[0][0]))
        assert rounds[0] == rounds[1], f"{how}: the processes stopped at rounds {rounds}"
        if how == "SIGTERM":  # docs/ERRORS.md's row, with the round and the folder as placeholders
            line = next(x for x in results[0][1].splitlines() if x.startswith("interrupted"))
            line = line.replace(str(workdir), "$WORKDIR").replace(str(rounds[0]), "$ROUND")
            row = (
                "| `--distributed`, 2 processes: SIGTERM to process 1 (both processes; exit code "
                f"143) | {line} |"
            )
            assert row in (ROOT / "docs" / "ERRORS.md").read_text(), row
        steps = sorted(int(p.name) for p in (workdir / "checkpoints").glob("[0-9]*"))
        assert steps[-1] == rounds[0], f"{how}: round {rounds[0]} is saved ({steps})"
        metrics = [json.loads(line)["round"] for line in (workdir / "metrics.jsonl").open()]
        assert metrics == list(range(rounds[0] + 1)), metrics


# ---------------------------------------------------------- every config, several layouts

# configs/fedavg.py as it ships: N = 20 clients, S = 5 per round, which divide over one device.
SHIPPED_FEDAVG = [
    "--config=configs/fedavg.py",
    "--config.fed.rounds=3",
    "--config.eval_every=3",
    "--config.fed.strategy=sharded",
]
# The papers' shape scaled down: N = 100 clients, S = 10 per round, K = 2 local steps.
CLIENTS_100 = [
    "--config.data.num_clients=100",
    "--config.fed.clients_per_round=10",
    "--config.fed.local_steps=2",
    "--config.model.hidden_sizes=(32,)",
    "--config.fed.strategy=sharded",
]


def _run_both(
    argv: list[str], devices: int, tmp_path: pathlib.Path, xla_cache: pathlib.Path
) -> None:
    """``argv`` as two processes of ``devices`` CPU devices each (workdir ``tmp_path/two``) and,
    at the same time, as one process over all their devices (``tmp_path/one``)."""
    processes = _two_processes(
        [*argv, f"--workdir={tmp_path / 'two'}"], devices, tmp_path, xla_cache
    )
    one = _cli(
        [*argv, f"--workdir={tmp_path / 'one'}"], 2 * devices, tmp_path / "one.log", xla_cache
    )
    try:
        for p in [*processes, one]:
            p.wait(timeout=600)
    finally:
        _stop([*processes, one])
    logs = [tmp_path / "process_0.log", tmp_path / "process_1.log", tmp_path / "one.log"]
    for p, log in zip([*processes, one], logs, strict=True):
        assert p.returncode == 0, log.read_text()[-3000:]


def _assert_same_rows(two: list[dict], one: list[dict], rtol: float) -> None:
    if rtol == 0:
        assert two == one
        return
    assert [sorted(row) for row in two] == [sorted(row) for row in one]
    for a, b in zip(two, one, strict=True):
        np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(b)], rtol=rtol)


def _assert_both_equal_one(tmp_path: pathlib.Path, rounds: list[int], rtol: float = 0.0) -> None:
    """Process 0's metrics.jsonl and process 1's copy equal the single process's; every device of
    both processes ran the round."""
    one = _rows(tmp_path / "one" / "metrics.jsonl")
    assert [row["round"] for row in one] == rounds
    _assert_same_rows(_rows(tmp_path / "two" / "metrics.jsonl"), one, rtol)
    _assert_same_rows(_rows(tmp_path / "two" / "process_1" / "metrics.jsonl"), one, rtol)
    info = json.loads((tmp_path / "two" / "run_info.json").read_text())
    assert len(info["round_devices"]) == len(info["devices"]), info


@pytest.mark.slow
def test_the_shipped_fedavg_config_runs_on_both_processes(tmp_path, xla_cache):
    """configs/fedavg.py as it ships (S = 5), two processes of one device each: 3 rounds,
    evaluated at rounds 0 and 3, equal to one process over two devices (which runs S = 5 on one
    of them). Both processes run the round, the same clients on each device
    (``fedorth.train.distributed.round_mesh``): a round on process 0's device alone ran in
    process 0 without process 1, which failed reading the round counter it did not hold."""
    _run_both(SHIPPED_FEDAVG, 1, tmp_path, xla_cache)
    _assert_both_equal_one(tmp_path, [0, 3])


# config, devices per process, flags, rtol. Together with the shipped FedAvg above (2 x 1,
# eval_every 3) and the SCAFFOLD resume below (2 x 2, per-client state, eval_every 1): each
# config of the papers' kinds, both layouts (2 processes x 1 and x 2 devices), evaluation every
# round and every 2 or 3 rounds, and the clients split over 2 or over all 4 devices.
MATRIX = {
    # SOAP's QR/eigh as host LAPACK calls inside the sharded round; evaluated every 2 rounds.
    "fedpac_soap": (1, [*CLIENTS_100, "--config.fed.rounds=2", "--config.eval_every=2"], 0.0),
    "fedmuon": (1, [*CLIENTS_100, "--config.fed.rounds=2", "--config.eval_every=1"], 0.0),
    # Minimax (AUC on the embedded Zipf sentiment task): N = S = 8; test_auc from the scores.
    "local_sgda": (
        1,
        ["--config.fed.rounds=2", "--config.eval_every=1", "--config.fed.strategy=sharded"],
        0.0,
    ),
    # S = 8 over all 4 devices: the 4 devices' sums are added across the processes by gloo in
    # another order than by one process's all-reduce, so they agree to float32 rounding (with
    # the clients over 2 devices, as in the other cases, a sum of two is the same either way).
    "fedpac_muon": (
        2,
        [
            *(f for f in CLIENTS_100 if not f.startswith("--config.fed.clients_per_round")),
            "--config.fed.clients_per_round=8",
            "--config.fed.rounds=2",
            "--config.eval_every=1",
        ],
        1e-5,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_every_kind_of_config_on_two_processes_equals_one_process(tmp_path, xla_cache, name):
    """Each config as two processes against one process over the same device count.

    The matrix, with the shipped FedAvg and the SCAFFOLD resume: configs fedavg, scaffold (a
    state per client), fedpac_soap (host LAPACK in the sharded round), fedpac_muon, fedmuon and
    local_sgda (minimax, AUC); layouts 2 processes x 1 device (fedavg, fedpac_soap, fedmuon,
    local_sgda) and x 2 devices (scaffold, fedpac_muon); eval_every 1, 2 and 3; N = 100, S = 10
    (S = 8 over all 4 devices for fedpac_muon; N = S = 8 for local_sgda; the shipped N = 20,
    S = 5 for fedavg); a process killed and the run resumed (scaffold). Not the full product:
    each axis at least once, a few rounds each, the three processes of a case at once."""
    devices, flags, rtol = MATRIX[name]
    _run_both([f"--config=configs/{name}.py", *flags], devices, tmp_path, xla_cache)
    _assert_both_equal_one(
        tmp_path, [0, 2] if "--config.eval_every=2" in flags else [0, 1, 2], rtol
    )


@pytest.mark.slow
def test_scaffold_on_2_x_2_devices_resumes_after_a_process_is_killed(tmp_path, xla_cache):
    """SCAFFOLD (a control variate per client, N = 100, in the server state), two processes of
    two devices each, a checkpoint every round: process 1 killed once the rounds run, the same
    command on both processes resumes the run, whose metrics then equal one process's over four
    devices, uninterrupted."""
    argv = [
        "--config=configs/scaffold.py",
        *CLIENTS_100,
        "--config.fed.rounds=8",
        "--config.eval_every=1",
        "--config.checkpoint_every=1",
    ]
    (tmp_path / "again").mkdir()
    again: list[subprocess.Popen] = []
    processes = _two_processes([*argv, f"--workdir={tmp_path / 'two'}"], 2, tmp_path, xla_cache)
    one = _cli([*argv, f"--workdir={tmp_path / 'one'}"], 4, tmp_path / "one.log", xla_cache)
    try:
        deadline = time.monotonic() + 480
        # Round 3 runs once round 2 is saved (the progress line of round r comes before its save).
        _wait_for_line(tmp_path / "process_0.log", "round 3/", processes, deadline)
        os.kill(processes[1].pid, signal.SIGKILL)
        assert processes[0].wait(timeout=60) == 1, (tmp_path / "process_0.log").read_text()[-3000:]
        again = _two_processes(
            [*argv, f"--workdir={tmp_path / 'two'}"], 2, tmp_path / "again", xla_cache
        )
        for p in [*again, one]:
            p.wait(timeout=600)
    finally:
        _stop([*processes, one, *again])
    logs = [tmp_path / "again" / "process_0.log", tmp_path / "again" / "process_1.log"]
    for p, log in zip([*again, one], [*logs, tmp_path / "one.log"], strict=True):
        assert p.returncode == 0, log.read_text()[-3000:]
    resumed = re.findall(r"Resumed from round (\d+) in ", logs[0].read_text())
    assert resumed and 2 <= int(resumed[0]) < 8, logs[0].read_text()[-3000:]
    _assert_both_equal_one(tmp_path, list(range(9)))


@pytest.mark.slow
def test_a_strategy_of_one_device_is_refused_on_two_processes_in_one_line(tmp_path):
    """fed.strategy='sequential' runs a round on one device, which two processes cannot share:
    each process says so in one line, exit code 2, before anything is loaded or compiled."""
    argv = [*TINY[:-2], "--config.fed.strategy=sequential", f"--workdir={tmp_path / 'run'}"]
    processes = _two_processes(argv, 1, tmp_path, None)
    try:
        for p in processes:
            p.wait(timeout=120)
    finally:
        _stop(processes)
    for i, p in enumerate(processes):
        output = (tmp_path / f"process_{i}.log").read_text()
        lines = process_lines(output)
        assert p.returncode == 2, output[-3000:]
        assert lines == [
            "error: Invalid config:",
            "  fed.strategy='sequential' runs a round on one device, and this run has 2 "
            "processes, whose devices a round spans together: use "
            "--config.fed.strategy=sharded (or auto).",
        ], output[-3000:]
    row = (
        "| `fed.strategy='sequential'` with `--distributed`, 2 processes (each process; exit "
        "code 2) | error: Invalid config:<br>  " + lines[1].strip() + " |"
    )
    assert row in (ROOT / "docs" / "ERRORS.md").read_text(), row


def test_round_mesh_of_several_processes_holds_every_device(monkeypatch):
    """S clients over every device: gcd(S, devices) groups of devices, each group's devices
    running the same clients; a single process keeps fed.client_mesh's choice (None)."""
    assert distributed.round_mesh(10) is None
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for clients, shape in ((10, (2, 4)), (8, (8, 1)), (5, (1, 8))):
        mesh = distributed.round_mesh(clients)
        assert dict(mesh.shape) == {"clients": shape[0], "copies": shape[1]}, clients
        assert list(mesh.devices.flat) == jax.devices()


@pytest.mark.cpu_devices
def test_a_round_on_some_devices_of_several_processes_is_refused_in_one_line(monkeypatch):
    """The compiled round's devices, not the config, decide: a round compiled for 2 of the 8
    devices (as fed.client_mesh lays S = 2 clients) of a run of 2 processes is refused."""
    from fedorth.train import builders, loop

    experiment = builders.build(_tiny_config(rounds=1))
    server = builders.init_server(experiment)
    loop.check_round_spans_processes(experiment.round_fn, server, experiment.data)  # 1 process
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(loop.RoundPlacementError) as error:
        loop.check_round_spans_processes(experiment.round_fn, server, experiment.data)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "The round is compiled for 2 of the 8 devices of the run's 2 processes (on processes [0])"
    ), message
    row = (
        "| a multi-process round compiled for some of the devices (a `fedorth.fed.RoundConfig` "
        f"mesh of 2 of the 8 devices of 2 processes; exit code 1) | error: {message} |"
    )
    assert row in (ROOT / "docs" / "ERRORS.md").read_text(), row
