"""Sweeps (fedorth.sweep, experiments.sweep): each replica is its single run.

The reference of a replica is its single run built the way ``fedorth.train.run`` builds it
(``builders.build`` + ``builders.init_server`` of the replica's config, its round function
called round after round). With the sequential replica strategy the replica equals it bit for
bit; vmapped over replicas, to float32 rounding (batched products may sum in another order).

Compiling the rounds is most of these tests' time, so they share programs: the single runs are
cached by their resolved config (the sequential and the vmapped replicas of a test compare with
the same runs), the tiny config's clients all hold as many examples (``dirichlet_client_mix``)
so every seed's round has the same shapes, and the model is linear (``hidden_sizes=()``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from reliability_helpers import compilation_cache_env

from configs import fedavg, fedcm, fedmuon, fedpac_soap, scaffold
from fedorth.sweep import Grid, ReplicaRound, SweepError
from fedorth.sweep.grid import get_key, parse_sweep_argv, set_key
from fedorth.train import builders

REPO = pathlib.Path(__file__).resolve().parents[1]
ROUNDS = 3
CONFIGS = {"fedavg": fedavg, "fedpac_soap": fedpac_soap, "fedmuon": fedmuon, "scaffold": scaffold}
CLIENT_STRATEGIES = ["vmap", "chunked", "sequential", "sharded"]
SEEDS = [42, 43]
LEARNING_RATE = 0.07
# A traced learning rate (one value, the base config's: still an array in the round) and two
# seeds: the seeds change the model init, the Dirichlet class mixes, client sampling and
# mini-batches.
GRID = {"seed": SEEDS, "optim.learning_rate": [LEARNING_RATE]}


def tiny(
    name: str,
    client_strategy: str = "sequential",
    partition: str = "dirichlet_client_mix",
    hidden_sizes: tuple[int, ...] = (),  # one dense layer: a kernel (Muon's, SOAP's) and a bias
    learning_rate: float | None = LEARNING_RATE,  # None: the config's
):
    config = {**CONFIGS, "fedcm": fedcm}[name].get_config()
    config.model.hidden_sizes = hidden_sizes
    config.data.num_clients = 4
    # Equal client sizes (Hsu et al.'s Dirichlet class mixes): every seed's data has the same
    # shapes, so the single runs of all seeds share one compiled round.
    config.data.partition = partition
    if learning_rate is not None:
        config.optim.learning_rate = learning_rate
    config.fed.clients_per_round = 2
    config.fed.local_steps = 2
    config.fed.batch_size = 8
    config.fed.rounds = ROUNDS
    config.fed.strategy = client_strategy
    config.fed.chunk_size = 1 if client_strategy == "chunked" else 0
    return config


_SINGLE_RUNS: dict[str, dict] = {}
_ROUND_FNS: dict[str, object] = {}


def _key(config, *leave_out: str) -> str:
    tree = config.to_dict()
    for name in leave_out:
        tree.pop(name)
    return json.dumps(tree, sort_keys=True, default=str)


def single_run(config) -> dict:
    """The replica's single run: its server state (the key as its data) and metrics after ROUNDS
    rounds, on the host; cached by the resolved config.

    ``builders.build``'s round function is its config's, not its seed's (the seed sets the
    round's arguments: the data, the initial state and its key), so the single runs of the seeds
    of one config call the first one's: one compilation, also where XLA's persistent cache
    serves none (a program with host callbacks, SOAP's eigendecompositions)."""
    if _key(config) not in _SINGLE_RUNS:
        experiment = builders.build(config)
        round_fn = _ROUND_FNS.setdefault(_key(config, "seed"), experiment.round_fn)
        server = builders.init_server(experiment)
        for _ in range(ROUNDS):
            server, metrics = round_fn(server, experiment.data)
        _SINGLE_RUNS[_key(config)] = _host(server, metrics)
    return _SINGLE_RUNS[_key(config)]


def _host(server, metrics) -> dict:
    """Every part of the server state (its key as the key's data) and the train loss."""
    return jax.device_get(
        {
            "state": server.replace(key=jax.random.key_data(server.key)),
            "train_loss": metrics["train_loss"],
        }
    )


def sweep(config, grid_values, replica_strategy, **kwargs):
    grid = Grid(config, grid_values)
    round_ = ReplicaRound.from_grid(grid, strategy=replica_strategy, **kwargs)
    return (grid.replicas(), *run(round_))


def run(round_: ReplicaRound):
    states = round_.initial_states()
    for _ in range(ROUNDS):
        states, metrics = round_(states)
    return round_, states, metrics


def compare(replicas, round_, states, metrics, exact: bool):
    for index, replica in enumerate(round_.replicas):
        assert replica.values == replicas[index]
        theirs = single_run(replica.config)
        ours = _host(round_.replica_state(states, index), metrics[index])
        assert jax.tree.structure(ours) == jax.tree.structure(theirs), replica.name
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            if exact:
                np.testing.assert_array_equal(a, b, err_msg=f"replica {replica.name}")
            else:
                np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=replica.name)


# Each algorithm under one client strategy, each client strategy under one algorithm, and each
# pair under both replica strategies: every (algorithm, replica strategy) and every (client
# strategy, replica strategy) pair is tested once. The single rounds of the algorithms under the
# client strategies are tests/test_fed_golden.py's, bit for bit. The pairs share programs
# with the tests below: FedAvg over vmapped clients with test_auto_on_an_accelerator_..., the
# FedPAC_SOAP single runs (host callbacks: never served by XLA's persistent cache) with the
# FedPAC_SOAP group of test_traced_hyperparameters_..., SCAFFOLD's sharded rounds with
# test_sharded_sequential_... and test_stack_and_unstack_are_inverse.
REPLICA_CASES = [
    ("fedavg", "vmap"),
    ("fedpac_soap", "sequential"),
    ("fedmuon", "chunked"),
    ("scaffold", "sharded"),  # SCAFFOLD's per-client control variates, vmapped over replicas
]


@pytest.mark.slow
@pytest.mark.parametrize("name, client_strategy", REPLICA_CASES)
def test_each_replica_is_its_single_run(name, client_strategy):
    """Sequential replicas are their single runs bit for bit, vmapped replicas to float32
    rounding (the same single runs serve both)."""
    config = tiny(name, client_strategy)
    grid_values = GRID
    if client_strategy == "sharded":
        # A traced learning rate is an operand of the sharded call where the single run has a
        # constant: XLA compiles the partitioned round differently (1 ulp in a few weights after
        # 3 rounds; the vmapped replicas below and
        # test_sharded_sequential_replicas_with_a_traced_learning_rate... bound it). The seeds,
        # which change no code, are exact.
        grid_values = {"seed": SEEDS}
    replicas, round_, states, metrics = sweep(config, grid_values, "sequential")
    assert round_.client_strategy == client_strategy
    if client_strategy == "sharded":
        assert len(round_.replicas[0].experiment.round_fn.devices) == 2  # S = 2 over 2 devices
    compare(replicas, round_, states, metrics, exact=True)

    replicas, round_, states, metrics = sweep(config, GRID, "vmap")
    assert round_.strategy == "vmap" and round_.units == [[0, 1]]
    assert round_.client_strategy == client_strategy
    compare(replicas, round_, states, metrics, exact=False)


def test_sharded_sequential_replicas_with_a_traced_learning_rate_agree_to_float32_rounding():
    """SCAFFOLD's per-client control variates, clients sharded over 2 devices, lr traced, one
    replica at a time (vmapped: test_each_replica_is_its_single_run[scaffold-sharded])."""
    config = tiny("scaffold", "sharded")
    compare(*sweep(config, GRID, "sequential"), exact=False)


def test_vmap_chunks_pad_the_last_chunk_and_keep_each_replica():
    """Three replicas in chunks of two: the last chunk repeats replica 2 (one compiled round).
    The clients' sizes differ (``dirichlet_label_split``) and differ between seeds: the index
    rows are padded to the longest client of all replicas and stacked over replicas."""
    config = tiny("fedavg", "vmap", partition="dirichlet_label_split")
    replicas, round_, states, metrics = sweep(config, {"seed": [42, 43, 44]}, "vmap", chunk_size=2)
    own = [builders.build(r.config).data.client_index.shape[1] for r in round_.replicas]
    padded = {r.experiment.data.client_index.shape[1] for r in round_.replicas}
    assert len(set(own)) > 1 and padded == {max(own)}, "the seeds' widths differ: padded"
    assert round_.units == [[0, 1], [2, 2]]
    assert round_._step._cache_size() == 1, "every chunk runs the same compiled round"
    compare(replicas, round_, states, metrics, exact=False)


def fake_clock(unit_s: dict[str, float]):
    """A timer returning, per candidate (vmap's, then sequential's): start, start + 1 s of
    compilation, + ``unit_s[name]`` for its first unit."""
    ticks, now = [], 100.0
    for name in ("vmap", "sequential"):
        ticks += [now, now + 1.0, now + 1.0 + unit_s[name]]
        now += 1000.0
    return iter(ticks).__next__


@pytest.mark.parametrize(
    "unit_s, chosen",
    [
        ({"vmap": 0.75, "sequential": 0.25}, "sequential"),  # 0.75 s > 2 replicas x 0.25 s
        ({"vmap": 0.25, "sequential": 0.25}, "vmap"),  # 0.25 s < 2 x 0.25 s
        ({"vmap": 0.5, "sequential": 0.25}, "vmap"),  # a tie goes to vmap
    ],
)
def test_auto_on_an_accelerator_runs_the_replica_strategy_measured_faster(
    monkeypatch, unit_s, chosen
):
    """On an accelerator (pretended: ``fed.execution._backend``), ``"auto"`` times one unit of
    each replica strategy (one replica; one chunk of both) with the clock given and runs the
    faster sweep round: its rounds are then those of that strategy fixed, each replica its
    single run (bit for bit sequentially, to float32 rounding vmapped)."""
    from fedorth.fed import execution

    config = tiny("fedavg", "vmap")
    with monkeypatch.context() as patch:
        patch.setattr(execution, "_backend", lambda: "gpu")
        grid = Grid(config, GRID)
        round_ = ReplicaRound.from_grid(grid, strategy="auto", timer=fake_clock(unit_s))
    assert round_.strategy == chosen
    selection = round_.replica_selection
    assert selection["strategy"] == chosen and selection["backend"] == "gpu"
    for name, units in (("vmap", 1), ("sequential", 2)):
        timing = selection["candidates"][name]
        assert timing["units"] == units and timing["compile_s"] == 1.0
        assert timing["round_s"] == units * unit_s[name]
    compare(grid.replicas(), *run(round_), exact=chosen == "sequential")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's rule")
def test_auto_on_cpu_runs_replicas_one_at_a_time():
    """On CPU ``"auto"`` is sequential without timing anything."""
    round_ = ReplicaRound.from_grid(Grid(tiny("fedavg"), {"seed": SEEDS}), strategy="auto")
    assert round_.strategy == "sequential" and round_.replica_selection is None


# Keys fedorth branches on when they are concrete numbers (a nonzero weight decay or momentum adds
# its transform, beta = 0 skips the mixing), traced as arrays in a sweep, with the learning rate,
# Muon's beta and the seed. Each group's replicas are a centre (the base config) and one
# replica per key with another value: one compiled round serves them all. The values are exact
# in float32 and their complements too (1 - 0.25), so the maths is the single run's. A traced
# weight decay or local momentum of 0 computes g + 0 x and 0 m + g: the same numbers. A server
# momentum or alpha/beta of 0 would keep state the single run has not (a zero trace, the global
# direction), so those keys vary between nonzero values.
TRACED_KEYS = [
    (
        "fedavg",
        {
            "optim.weight_decay": (1e-3, 0.0),
            "optim.momentum": (0.5, 0.0),
            "fed.options.server_momentum": (0.5, 0.25),
        },
        {},
    ),
    (
        "fedmuon",
        {"seed": (42, 43), "optim.learning_rate": (LEARNING_RATE, 0.02), "optim.beta": (0.95, 0.9)},
        {},
    ),
    # Alone, on a hidden layer of 16 at lr 0.02: on the linear model at lr 0.07, traced alpha left
    # 2 of the 640 weights a few ulps off the single run's after 3 rounds, alone or with the
    # learning rate and Muon's beta (XLA simplifies products with constants that it cannot
    # with traced operands); docs/SWEEPS.md.
    (
        "fedmuon",
        {"fed.options.alpha": (0.5, 0.25)},
        {"partition": "dirichlet_label_split", "hidden_sizes": (16,), "learning_rate": None},
    ),
    ("fedpac_soap", {"fed.options.beta": (0.5, 0.25)}, {}),
    ("fedcm", {"fed.options.alpha": (0.5, 0.25)}, {}),  # mixes with beta = 1 - alpha, in the round
]


def star_round(name: str, keys: dict, tiny_kwargs: dict, replica_strategy: str) -> ReplicaRound:
    """The centre replica and one per key of ``keys`` with its other value."""
    config = tiny(name, **tiny_kwargs)
    for key, (centre, _) in keys.items():
        set_key(config, key, centre)  # also SGD's momentum, FedAvg's server momentum
    grid = Grid(config, {key: list(pair) for key, pair in keys.items()})
    centre = {key: pair[0] for key, pair in keys.items()}
    replicas = [centre] + [{**centre, key: pair[1]} for key, pair in keys.items()]
    return ReplicaRound.from_grid(grid, replicas=replicas, strategy=replica_strategy)


@pytest.mark.parametrize(
    "name, keys, tiny_kwargs", TRACED_KEYS, ids=[f"{n}-{','.join(k)}" for n, k, _ in TRACED_KEYS]
)
def test_traced_hyperparameters_compile_one_round_and_each_replica_is_its_single_run(
    name, keys, tiny_kwargs
):
    """Sequential replicas bit for bit; either way one compiled round for all values.

    Vmapped replicas (to float32 rounding) for FedAvg's keys, which switch transforms on and off
    as concrete numbers: vmapping a traced value is the same for every key, and
    test_each_replica_is_its_single_run vmaps FedMuon's, FedPAC_SOAP's and SCAFFOLD's replicas
    with a traced learning rate."""
    vmapped = [("vmap", False)] if name == "fedavg" else []
    for replica_strategy, exact in [("sequential", True), *vmapped]:
        round_, states, metrics = run(star_round(name, keys, tiny_kwargs, replica_strategy))
        replicas = [r.values for r in round_.replicas]
        assert len(replicas) == len(keys) + 1
        assert set(round_.traced_keys) == set(keys) - {"seed"}
        assert round_._step._cache_size() == 1
        compare(replicas, round_, states, metrics, exact=exact)


@pytest.mark.parametrize("replica_strategy", ["sequential", "vmap"])
def test_stack_and_unstack_are_inverse(replica_strategy):
    config = tiny("scaffold", "sharded")  # the programs of test_each_replica_is_its_single_run
    grid = Grid(config, {"seed": [42, 43, 44], "optim.learning_rate": [LEARNING_RATE]})
    round_ = ReplicaRound.from_grid(grid, strategy=replica_strategy, chunk_size=2)
    states, _ = round_(round_.initial_states())
    again = round_.unstack(round_.stack(states))  # what a resumed sweep runs from
    # Both go on (the round donates its input: each replica must own its buffers).
    states, _ = round_(states)
    again, _ = round_(again)
    for index in range(3):
        a = round_.replica_state(states, index).replace(key=None)
        b = round_.replica_state(again, index).replace(key=None)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the key and the fix.


@pytest.mark.parametrize(
    "values, message",
    [
        ({}, r"no grid: pass --sweep\.KEY=v1,v2"),
        ({"seed": ""}, r"sweep\.seed is empty: give at least one value"),
        ({"seed": "42,4x"}, r"sweep\.seed: '4x' is not an int; .*--sweep\.seed=42,43"),
        ({"optim.learning_rate": "0.1,fast"}, r"sweep\.optim\.learning_rate: 'fast' is not a"),
        ({"optim.learning_rate": [0.1, True]}, r"True is not a number"),
        ({"fed.local_steps": "2,3"}, r"sweep\.fed\.local_steps changes the shapes .*"),
        ({"fed.clients_per_round": "2,3"}, r"sweep\.fed\.clients_per_round changes the shapes"),
        ({"model.hidden_sizes": "16,32"}, r"sweep\.model\.hidden_sizes changes the shapes"),
        ({"fed.rounds": "2,3"}, r"sweep\.fed\.rounds is not sweepable .*--config\.fed\.rounds"),
        ({"optim.nope": "1,2"}, r"the config has no key 'optim\.nope'; sweepable keys"),
        ({"seed": "42,42"}, r"sweep\.seed repeats a value"),
    ],
)
def test_bad_grids_get_one_line_naming_the_key(values, message):
    with pytest.raises(SweepError, match=message) as info:
        Grid(tiny("fedavg"), values)
    assert "\n" not in str(info.value)


def test_a_key_the_algorithm_reads_as_a_number_is_refused():
    """optim.fallback_lr_ratio: fedorth.fed.local.decay_rates converts Muon's fallback lr ratio
    with float(), so its values cannot share a compiled round."""
    config = tiny("fedmuon")
    grid = Grid(config, {"optim.fallback_lr_ratio": [1.0, 0.5]})
    with pytest.raises(
        SweepError, match=r"sweep\.optim\.fallback_lr_ratio is not sweepable"
    ) as info:
        ReplicaRound.from_grid(grid)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "name, key",
    [
        ("fedpac_soap", "optim.weight_decay"),  # clients start from the server's local state
        ("fedavg", "fed.options.server_momentum"),  # 0: no server trace
        ("fedmuon", "fed.options.alpha"),  # 0: no global direction
    ],
)
def test_a_grid_with_0_is_refused_where_0_changes_the_servers_state(name, key):
    """A concrete 0 leaves out a transform (and its state) the other values keep."""
    config = tiny(name)
    section, _, leaf = key.rpartition(".")
    get_key(config, section)[leaf] = 0.0
    grid = Grid(config, {key: [0.0, 0.5]})
    with pytest.raises(SweepError, match=rf"sweep\.{key}: a value 0 .*run 0 alone") as info:
        ReplicaRound.from_grid(grid)
    assert "\n" not in str(info.value)


def test_a_config_file_sweep_section_is_the_grid():
    import ml_collections

    from fedorth.sweep.grid import config_section

    config = tiny("fedavg")
    config.sweep = ml_collections.ConfigDict(
        {"seed": (42, 43), "optim": {"learning_rate": (0.1, 0.03)}}
    )
    values = config_section(config)
    assert values == {"seed": (42, 43), "optim.learning_rate": (0.1, 0.03)}
    del config["sweep"]
    grid = Grid(config, values)
    assert grid.kinds == {"seed": "built", "optim.learning_rate": "traced"}
    # A ConfigDict lists its keys sorted: optim.learning_rate varies slowest.
    assert grid.replicas()[1] == {"optim.learning_rate": 0.1, "seed": 43}
    assert grid.replica_config(grid.replicas()[2]).optim.learning_rate == 0.03


def test_parse_sweep_argv():
    rest, grid = parse_sweep_argv(["--config=x", "--sweep.seed=1,2", "--sweep.optim.b1=0.9"])
    assert rest == ["--config=x"] and grid == {"seed": "1,2", "optim.b1": "0.9"}
    with pytest.raises(SweepError, match=r"--sweep\.seed: give the values after '='"):
        parse_sweep_argv(["--sweep.seed"])


# ---------------------------------------------------------------------------------------------
# The command: run folders, resume after SIGKILL, the single run's metrics.

# The default partition (dirichlet_label_split): the seeds' clients differ in size, so the
# sweep pads its replicas' index rows, and a replica still equals its single run.
TINY_ARGS = [
    "--config=fedavg",
    "--config.model.hidden_sizes=()",
    "--config.data.num_clients=4",
    "--config.fed.clients_per_round=2",
    "--config.fed.local_steps=2",
    "--config.fed.batch_size=8",
    "--config.eval_every=4",
    "--config.checkpoint_every=4",
]
SWEEP_ARGS = ["--sweep.seed=42,43", "--sweep.optim.learning_rate=0.1,0.05"]


def _command(module: str, workdir: pathlib.Path, *args: str) -> list[str]:
    return [sys.executable, "-m", module, f"--workdir={workdir}", *TINY_ARGS, *args]


def _env(cache: pathlib.Path | None = None) -> dict[str, str]:
    """The commands' environment; with ``cache``, the test process's compilation cache folder of
    the command-line runs (tests/conftest.py's ``cli_compilation_cache``), every program cached.
    JAX writes an entry non-atomically: a process that may be killed gets the folder only if
    every program it runs is already there (it then only reads); a sweep stopped by SIGTERM ends
    the round in progress, and any write, first."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return env if cache is None else compilation_cache_env(cache, env)


def _run(command: list[str], cache: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, env=_env(cache), timeout=600
    )


def _rows(folder: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


def _steps(workdir: pathlib.Path) -> list[int]:
    folder = workdir / "checkpoints"
    return (
        sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []
    )


def test_bad_sweep_key_on_the_command_line_is_one_line(tmp_path):
    out = _run(_command("experiments.sweep", tmp_path / "w", "--sweep.fed.local_steps=2,4"))
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "sweep.fed.local_steps changes the shapes" in errors[0], out.stderr
    assert "Traceback" not in out.stderr


def test_sigkill_resume_equals_uninterrupted_sweep_and_single_runs(tmp_path, cli_compilation_cache):
    """A sweep killed (SIGKILL) after its second checkpoint (of four) and started again by the
    same command ends with the metrics of an uninterrupted sweep; each replica's metrics equal
    those of ``experiments.main`` with the replica's values (seed 43, lr 0.05 here), and
    ``experiments.report`` reads the sweep as four runs in two groups of two seeds.

    The commands share a compilation cache folder: the uninterrupted sweep, which runs to its
    end, fills it, and the killed sweep runs the same programs (only reads it)."""
    rounds = ["--config.fed.rounds=16"]
    cache = cli_compilation_cache
    whole = tmp_path / "whole"
    first = _run(_command("experiments.sweep", whole, *rounds, *SWEEP_ARGS), cache)
    assert first.returncode == 0, first.stderr
    assert "Sweep of 4 replicas x 16 rounds: replicas sequential" in first.stderr, first.stderr
    assert "ETA" in first.stderr, "the progress line"
    killed = tmp_path / "killed"
    command = _command("experiments.sweep", killed, *rounds, *SWEEP_ARGS)
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=log, env=_env(cache))
        deadline = time.monotonic() + 300
        while len(_steps(killed)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()
    assert max(_steps(killed)) < 16, "killed mid-sweep"
    again = _run(command, cache)
    assert again.returncode == 0, again.stderr
    assert "Resumed the sweep from round" in again.stderr
    assert "Sweep of 4 replicas x 16 rounds" in again.stderr
    names = sorted(p.name for p in whole.iterdir() if (p / "config.json").exists())
    assert names == sorted(
        f"seed={s},optim.learning_rate={lr}" for s in (42, 43) for lr in (0.1, 0.05)
    )
    for name in names:
        assert _rows(killed / name) == _rows(whole / name), name
        assert (whole / name / "curves.png").exists() and (whole / name / "tensorboard").is_dir()
        info = json.loads((whole / name / "run_info.json").read_text())
        assert info["replica_strategy"] == "sequential"  # "auto" on CPU, not timed
        assert info["replica_strategy_selection"] is None

    single = tmp_path / "single"
    args = [*rounds, "--config.seed=43", "--config.optim.learning_rate=0.05"]
    alone = _run(_command("experiments.main", single, *args), cache)
    assert alone.returncode == 0, alone.stderr
    replica = whole / "seed=43,optim.learning_rate=0.05"
    assert _rows(replica) == _rows(single)
    assert json.loads((replica / "config.json").read_text()) == json.loads(
        (single / "config.json").read_text()
    )

    from experiments import report

    groups = report.group_runs(report.find_runs([whole]))
    assert sorted(len(g.runs) for g in groups) == [2, 2]


# ---------------------------------------------------------------------------------------------
# Resume by identity: the flags' order, a changed grid, lost folders (fedorth.sweep.runner).


def sweep_config(rounds: int):
    config = tiny("fedavg")
    config.fed.rounds = rounds
    config.eval_every = 1
    config.checkpoint_every = 0  # at the end (and on a stop): the curves are drawn at each save
    return config


def run_sweep_in(workdir: pathlib.Path, values: dict, rounds: int, **kwargs) -> str:
    """``run_sweep`` of the tiny FedAvg config; returns what it printed."""
    import io

    from fedorth.sweep.runner import run_sweep

    config = sweep_config(rounds)
    stream = io.StringIO()
    run_sweep(
        config,
        Grid(config, values),
        workdir,
        replica_strategy="sequential",
        stream=stream,
        **kwargs,
    )
    return stream.getvalue()


ERRORS_DOC = REPO / "docs" / "ERRORS.md"


def assert_documented(description: str, message: str, workdir: pathlib.Path) -> None:
    """docs/ERRORS.md's "Sweeps" section has the row of ``message`` (``workdir`` as
    $WORKDIR)."""
    cell = message.replace(str(workdir), "$WORKDIR").replace("|", "\\|")
    row = f"| {description} | {cell} |"
    assert row in ERRORS_DOC.read_text(), f"docs/ERRORS.md's Sweeps section lacks:\n{row}"


def replica_rows(workdir: pathlib.Path) -> dict[str, list[dict]]:
    return {p.name: _rows(p) for p in sorted(workdir.iterdir()) if (p / "metrics.jsonl").exists()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, list[dict]]:
    """Four replicas (seeds 42, 43 x two learning rates), 4 rounds, without a stop."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    run_sweep_in(workdir, {"seed": [42, 43], "optim.learning_rate": [0.1, 0.05]}, 4)
    return replica_rows(workdir)


@pytest.mark.slow  # five sweeps: scheduled first
def test_resume_maps_replicas_by_identity_and_a_grid_may_grow_or_shrink(tmp_path, uninterrupted):
    """Two rounds of seed 42 at two learning rates, then the same grid with its flags in the
    other order and 4 rounds: each replica resumes from its own state (the folders keep the first
    order) and ends with the uninterrupted sweep's rows. Adding seed 43 runs only its replicas,
    from round 0; removing the learning rate 0.05 keeps its folders as they are, and says so."""
    workdir = tmp_path / "s"
    run_sweep_in(workdir, {"seed": [42], "optim.learning_rate": [0.1, 0.05]}, 2)
    out = run_sweep_in(workdir, {"optim.learning_rate": [0.05, 0.1], "seed": [42]}, 4)
    assert "Resumed the sweep from round 2" in out, out
    assert "Finished the sweep at round 4: 2 replicas" in out, out
    rows = replica_rows(workdir)
    assert sorted(rows) == [f"seed=42,optim.learning_rate={lr}" for lr in (0.05, 0.1)]
    for name, replica in rows.items():
        assert replica == uninterrupted[name], name

    out = run_sweep_in(workdir, {"seed": [42, 43], "optim.learning_rate": [0.1, 0.05]}, 4)
    assert "Resumed the sweep from round 4" in out, out
    new = "seed=43,optim.learning_rate=0.1, seed=43,optim.learning_rate=0.05"
    assert f"New in the grid, run from round 0 up to round 4 first: {new}." in out, out
    assert replica_rows(workdir) == uninterrupted

    before = {p: p.read_bytes() for p in workdir.glob("*=0.05/*") if p.is_file()}
    out = run_sweep_in(workdir, {"seed": [42, 43], "optim.learning_rate": [0.1]}, 4)
    kept = [line for line in out.splitlines() if line.startswith("Not in the grid any more")]
    assert len(kept) == 1 and f"{workdir}/seed=43,optim.learning_rate=0.05" in kept[0], out
    assert before == {p: p.read_bytes() for p in workdir.glob("*=0.05/*") if p.is_file()}
    assert replica_rows(workdir) == uninterrupted


@pytest.mark.parametrize(
    "values, reason",
    [
        ({"seed": [44, 45], "optim.learning_rate": [0.1]}, r"no replica in common"),
        ({"seed": [42, 43]}, r"keys \['seed', 'optim.learning_rate'\] there, \['seed'\] here"),
    ],
)
def test_another_grid_is_refused_without_sweep_json(tmp_path, values, reason):
    """The checkpoint carries the grid: without ``sweep.json`` a grid of the same size still
    cannot resume another's states (seed 44 would go on from seed 42's)."""
    from fedorth.train import WorkdirConflictError

    workdir = tmp_path / "s"
    run_sweep_in(workdir, {"seed": [42, 43], "optim.learning_rate": [0.1]}, 2)
    (workdir / "sweep.json").unlink()
    with pytest.raises(WorkdirConflictError, match=reason) as info:
        run_sweep_in(workdir, values, 2)
    message = str(info.value)
    assert "\n" not in message and "holds another sweep" in message
    assert "Use another --workdir (this one keeps that sweep)." in message
    described = {
        "no replica in common": "seeds 44, 45 where the checkpoint holds 42, 43",
        "keys": "`--sweep.seed=42,43` alone where the checkpoint holds seeds x learning rates",
    }
    description = described["keys" if "keys" in reason else reason] + ", `sweep.json` deleted"
    assert_documented(f"{description} (exit code 1)", "error: " + message, workdir)


def test_a_deleted_replica_folder_is_computed_again_with_a_warning(tmp_path, caplog):
    workdir = tmp_path / "s"
    values = {"seed": [42, 43], "optim.learning_rate": [0.1]}
    run_sweep_in(workdir, values, 3)
    whole = replica_rows(workdir)
    lost = workdir / "seed=43,optim.learning_rate=0.1"
    import shutil

    shutil.rmtree(lost)
    with caplog.at_level("WARNING"):
        run_sweep_in(workdir, values, 3)
    warnings = [r.getMessage() for r in caplog.records if str(lost) in r.getMessage()]
    assert len(warnings) == 1 and "its folder was deleted" in warnings[0], caplog.text
    assert "computed again from round 0" in warnings[0]
    assert_documented(
        "a replica folder deleted (a warning; the sweep goes on)", warnings[0], workdir
    )
    assert replica_rows(workdir) == whole


def test_a_replica_folder_with_a_single_runs_checkpoints_is_refused(tmp_path):
    """A replica extended by a single run (its own checkpoints): the sweep would cut its rows back
    to the sweep's round, so it refuses in one line and deletes nothing."""
    from fedorth.train import WorkdirConflictError

    workdir = tmp_path / "s"
    values = {"seed": [42, 43], "optim.learning_rate": [0.1]}
    run_sweep_in(workdir, values, 2)
    replica = workdir / "seed=42,optim.learning_rate=0.1"
    import shutil

    shutil.copytree(workdir / "checkpoints", replica / "checkpoints")
    rows = (replica / "metrics.jsonl").read_bytes()
    with pytest.raises(WorkdirConflictError, match="holds checkpoints of a single run") as info:
        run_sweep_in(workdir, values, 4)
    assert "\n" not in str(info.value) and f"move that folder out of {workdir}" in str(info.value)
    assert_documented(
        "a replica folder holding checkpoints of a single run (exit code 1)",
        "error: " + str(info.value),
        workdir,
    )
    assert (replica / "metrics.jsonl").read_bytes() == rows


# ---------------------------------------------------------------------------------------------
# The command: signals, locks shared with single runs, huge grids.

STOP_ARGS = [*TINY_ARGS, "--config.checkpoint_every=0"]  # the last value of a flag wins


def _sweep_command(workdir: pathlib.Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "experiments.sweep", f"--workdir={workdir}", *STOP_ARGS, *args]


@contextlib.contextmanager
def _running(command: list[str], env: dict[str, str]):
    """The command started (its stderr a text pipe), killed on the way out if still running."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for_line(proc, prefix: str, timeout: float = 300) -> list[str]:
    """The stderr lines of ``proc`` up to the first that contains ``prefix``."""
    lines, deadline = [], time.monotonic() + timeout
    for line in proc.stderr:
        lines.append(line)
        if prefix in line or time.monotonic() > deadline:
            break
    assert lines and prefix in lines[-1], "".join(lines)
    return lines


def _terminate(proc) -> str:
    """Sends ``proc`` SIGTERM; its stderr from here on, once it stopped as a single run stops
    (exit code 143, no traceback)."""
    proc.send_signal(signal.SIGTERM)
    stderr = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr, stderr
    return stderr


@pytest.mark.slow  # several processes: scheduled first
def test_sigterm_saves_the_sweeps_round_and_the_rerun_ends_as_an_uninterrupted_sweep(
    tmp_path, cli_compilation_cache
):
    """SIGTERM during the first round: the sweep saves the round it ends, says where the same
    command resumes, exits 143 without a traceback; the rerun says "Resumed" and "Finished" and
    ends with the rows of a sweep never stopped."""
    args = ["--config.fed.rounds=60", "--config.eval_every=20", "--sweep.seed=42,43"]
    cache = cli_compilation_cache
    whole = _run(_sweep_command(tmp_path / "whole", *args), cache)
    assert whole.returncode == 0, whole.stderr
    workdir = tmp_path / "stopped"
    command = _sweep_command(workdir, *args)
    with _running(command, _env(cache)) as proc:
        _wait_for_line(proc, "round 0/60")
        stderr = _terminate(proc)
    stopped_at = _steps(workdir)[-1]
    assert 0 < stopped_at < 60, stderr
    assert stderr.rstrip().endswith(
        f"interrupted (SIGTERM) at round {stopped_at}; the same command resumes the sweep from "
        f"round {stopped_at} ({workdir})."
    ), stderr
    assert_documented(
        "SIGTERM during round r (exit code 143; Ctrl-C: 130)",
        stderr.rstrip().splitlines()[-1].replace(f"round {stopped_at}", "round r"),
        workdir,
    )
    again = _run(command, cache)
    assert again.returncode == 0, again.stderr
    assert f"Resumed the sweep from round {stopped_at} in {workdir}." in again.stderr
    assert "Finished the sweep at round 60: 2 replicas" in again.stderr, again.stderr
    names = ["seed=42", "seed=43"]
    for name in names:
        assert _rows(workdir / name) == _rows(tmp_path / "whole" / name), name


def test_second_ctrl_c_stops_a_sweep_at_once_without_traceback(tmp_path):
    workdir = tmp_path / "w"
    command = _sweep_command(workdir, "--config.fed.rounds=100000", "--sweep.seed=42")
    with _running(command, _env()) as proc:
        _wait_for_line(proc, "round 0/100000")
        proc.send_signal(signal.SIGINT)
        _wait_for_line(proc, "SIGINT: stopping after the round in progress, saved")
        proc.send_signal(signal.SIGINT)
        stderr = proc.stderr.read()
        proc.wait(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    assert "\ninterrupted " in stderr and "the same command resumes the sweep" in stderr, stderr


@pytest.mark.slow  # several processes: scheduled first
def test_a_single_run_in_a_replica_folder_is_refused_while_the_sweep_runs_and_after(
    tmp_path, cli_compilation_cache
):
    """While the sweep runs, its replica folders are locked: a single run there is refused naming
    the sweep's command. Once it stopped, a single run there is still refused (the replica's state
    is in the sweep's checkpoint): its rows stay the sweep's."""
    workdir = tmp_path / "w"
    command = _sweep_command(workdir, "--config.fed.rounds=100000", "--sweep.seed=42,43")
    replica = workdir / "seed=42"
    single = [
        sys.executable,
        "-m",
        "experiments.main",
        f"--workdir={replica}",
        *STOP_ARGS,
        "--config.fed.rounds=100000",
    ]
    with _running(command, _env(cli_compilation_cache)) as proc:  # stopped by SIGTERM
        _wait_for_line(proc, "round 0/100000")
        running = _run(single)
        _terminate(proc)
    assert running.returncode == 1, running.stderr
    errors = [line for line in running.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{replica} is in use by another run" in errors[0], running.stderr
    assert "sweep.py" in errors[0] and "--sweep.seed=42,43" in errors[0], "the sweep's command"
    rows = (replica / "metrics.jsonl").read_bytes()
    stopped = _run(single)
    assert stopped.returncode == 1, stopped.stderr
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stopped.stderr
    assert f"{replica} is a replica folder of the sweep in {workdir}" in errors[0]
    assert_documented(
        "`experiments.main` in a replica folder of a stopped sweep (exit code 1; while the sweep "
        "runs, the folder's lock refuses it)",
        errors[0],
        workdir,
    )
    assert "Traceback" not in stopped.stderr
    assert (replica / "metrics.jsonl").read_bytes() == rows


@pytest.mark.slow  # several processes: scheduled first
def test_a_huge_grid_is_measured_before_any_folder_and_one_that_cannot_fit_is_refused(tmp_path):
    """10,000 replicas: the sweep says so, with their memory and build time, before it makes a
    folder, then shows its progress while it makes them; 100,000,000 replicas are refused in one
    line (about 50 TB of host memory), before any folder."""
    seeds = "--sweep.seed=" + ",".join(str(s) for s in range(10_000))
    workdir = tmp_path / "w"
    with _running(_sweep_command(workdir, "--config.fed.rounds=2", seeds), _env()) as proc:
        started = time.monotonic()
        lines = _wait_for_line(proc, "Grid of 10000 replicas", timeout=120)
        assert time.monotonic() - started < 120
        assert not any("Preparing" in line for line in lines), "the check comes first"
        made = sum(1 for p in workdir.iterdir() if p.is_dir()) if workdir.exists() else 0
        assert made < 10_000, "the grid is checked before its folders are made"
        assert "of host memory" in lines[-1] and "building them takes about" in lines[-1]
        # Where the process may not open 2 x 10,000 files (a lock holds the folder and its
        # run.lock), the grid is refused in one line instead.
        for line in proc.stderr:
            if line.startswith("error:") or "replica folders: 1000/10000" in line:
                break
        if line.startswith("error:"):
            assert "open files for the locks of its replica folders" in line, line
            assert not proc.stderr.read().strip() and proc.wait(timeout=60) == 2
        else:
            _terminate(proc)

    rates = "--sweep.optim.learning_rate=" + ",".join(
        f"{(i + 1) * 1e-5:.5f}" for i in range(10_000)
    )
    huge = tmp_path / "huge"
    started = time.monotonic()
    out = _run(_sweep_command(huge, "--config.fed.rounds=2", seeds, rates))
    assert time.monotonic() - started < 120
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert "the grid of 100000000 replicas needs about" in errors[0], out.stderr
    assert "split it into sweeps of at most" in errors[0]
    import re

    message = re.sub(r"\d+\.\d [kMGT]B", "$SIZE", errors[0])
    message = re.sub(r"at most \d+ replicas", "at most $N replicas", message)
    assert_documented("a grid of 100,000,000 replicas (exit code 2)", message, huge)
    assert "Traceback" not in out.stderr and not huge.exists()


@pytest.mark.slow  # several processes: scheduled first
def test_a_full_disk_stops_a_sweep_with_one_line(tmp_path, small_disk, cli_compilation_cache):
    """A finished 2-round sweep extended to 4 rounds on a disk with room for its rows but not for
    a checkpoint: one line names the file, the space and the intact checkpoint; no row is lost."""
    args = ["--config.eval_every=1", "--config.checkpoint_every=1", "--sweep.seed=42,43"]
    # Neither command is killed: they share a compilation cache, the second only reads it.
    cache = cli_compilation_cache
    first = tmp_path / "first"
    done = _run(_sweep_command(first, "--config.fed.rounds=2", *args), cache)
    assert done.returncode == 0, done.stderr
    workdir = small_disk / "w"
    import shutil

    shutil.copytree(first, workdir)
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(bytes(max(free - 24_000, 0)))
    out = _run(_sweep_command(workdir, "--config.fed.rounds=4", *args), cache)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert errors[0].startswith("error: No space left on the device of "), errors[0]
    assert f"the last intact checkpoint is {workdir / 'checkpoints' / '2'}" in errors[0]
    for name in ("seed=42", "seed=43"):
        rounds = [row["round"] for row in _rows(workdir / name)]
        assert rounds[:3] == [0, 1, 2], rounds
    assert _steps(workdir)[-1] == 2
