"""Sweeps (fedorth.sweep, experiments.sweep): each replica is its single run.

The reference of a replica is its single run built the way ``fedorth.train.run`` builds it
(``builders.build`` + ``builders.init_server`` of the replica's config, its round function
called round after round). With the sequential replica strategy the replica equals it bit for
bit; vmapped over replicas, to float32 rounding (batched products may sum in another order).
"""

from __future__ import annotations

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

from configs import fedavg, fedcm, fedmuon, fedpac_soap, scaffold
from fedorth.sweep import Grid, ReplicaRound, SweepError
from fedorth.sweep.grid import get_key, parse_sweep_argv
from fedorth.train import builders

REPO = pathlib.Path(__file__).resolve().parents[1]
ROUNDS = 3
CONFIGS = {"fedavg": fedavg, "fedpac_soap": fedpac_soap, "fedmuon": fedmuon, "scaffold": scaffold}
# A traced learning rate (one value, so still an array in the round) and two seeds: the seeds
# change the model init, the Dirichlet partition, client sampling and mini-batches.
GRID = {"seed": [42, 43], "optim.learning_rate": [0.07]}


def tiny(name: str, client_strategy: str = "sequential"):
    config = {**CONFIGS, "fedcm": fedcm}[name].get_config()
    config.model.hidden_sizes = (16,)
    config.data.num_clients = 4
    config.fed.clients_per_round = 2
    config.fed.local_steps = 2
    config.fed.batch_size = 8
    config.fed.rounds = ROUNDS
    config.fed.strategy = client_strategy
    config.fed.chunk_size = 1 if client_strategy == "chunked" else 0
    return config


def single_run(config):
    """The replica's single run: its server state and metrics after ROUNDS rounds."""
    experiment = builders.build(config)
    server = builders.init_server(experiment)
    for _ in range(ROUNDS):
        server, metrics = experiment.round_fn(server, experiment.data)
    return server, metrics


def sweep(config, grid_values, replica_strategy):
    grid = Grid(config, grid_values)
    round_ = ReplicaRound.from_grid(grid, strategy=replica_strategy)
    states = round_.initial_states()
    for _ in range(ROUNDS):
        states, metrics = round_(states)
    return grid, round_, states, metrics


def compare(grid, round_, states, metrics, exact: bool):
    for index, values in enumerate(grid.replicas()):
        server, single_metrics = single_run(grid.replica_config(values))
        replica = round_.replica_state(states, index)
        pairs = [
            (replica.params, server.params),
            (replica.model_state, server.model_state),
            (replica.opt_state, server.opt_state),
            (replica.clients, server.clients),  # SCAFFOLD's c_i of every client
            (replica.control, server.control),
            (metrics[index]["train_loss"], single_metrics["train_loss"]),
        ]
        for ours, theirs in pairs:
            for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
                a, b = np.asarray(a), np.asarray(b)
                if exact:
                    np.testing.assert_array_equal(a, b, err_msg=f"replica {values}")
                else:
                    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=f"{values}")


@pytest.mark.slow
@pytest.mark.parametrize("client_strategy", ["vmap", "chunked", "sequential", "sharded"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sequential_replicas_are_their_single_runs_bit_for_bit(name, client_strategy):
    config = tiny(name, client_strategy)
    grid_values = GRID
    if client_strategy == "sharded":
        # A traced learning rate is an operand of the sharded call where the single run has a
        # constant: XLA compiles the partitioned round differently (1 ulp in a few weights after
        # 3 rounds; test_sharded_rounds_with_a_traced_learning_rate... bounds it). The seeds,
        # which change no code, are exact.
        grid_values = {"seed": GRID["seed"]}
    grid, round_, states, metrics = sweep(config, grid_values, "sequential")
    assert round_.client_strategy == client_strategy
    if client_strategy == "sharded":
        assert len(round_.replicas[0].experiment.round_fn.devices) == 2  # S = 2 over 2 devices
    compare(grid, round_, states, metrics, exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("client_strategy", ["vmap", "sequential"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_vmapped_replicas_are_their_single_runs_to_float32_rounding(name, client_strategy):
    config = tiny(name, client_strategy)
    grid, round_, states, metrics = sweep(config, GRID, "vmap")
    assert round_.strategy == "vmap" and round_.units == [[0, 1]]
    compare(grid, round_, states, metrics, exact=False)


@pytest.mark.parametrize("replica_strategy", ["sequential", "vmap"])
def test_sharded_rounds_with_a_traced_learning_rate_agree_to_float32_rounding(replica_strategy):
    """SCAFFOLD's per-client control variates, clients sharded over 2 devices, lr traced."""
    config = tiny("scaffold", "sharded")
    grid, round_, states, metrics = sweep(config, GRID, replica_strategy)
    compare(grid, round_, states, metrics, exact=False)


def test_vmap_chunks_pad_the_last_chunk_and_keep_each_replica():
    """Three replicas in chunks of two: the last chunk repeats replica 2 (one compiled round)."""
    config = tiny("fedavg", "vmap")
    grid = Grid(config, {"seed": [42, 43, 44]})
    round_ = ReplicaRound.from_grid(grid, strategy="vmap", chunk_size=2)
    assert round_.units == [[0, 1], [2, 2]]
    states = round_.initial_states()
    for _ in range(ROUNDS):
        states, metrics = round_(states)
    assert round_._step._cache_size() == 1, "every chunk runs the same compiled round"
    compare(grid, round_, states, metrics, exact=False)


def test_traced_hyperparameters_compile_one_round_for_all_values():
    """Muon's beta, the learning rate and the seed vary; one compiled round serves them all,
    and each replica is its single run."""
    config = tiny("fedmuon")
    values = {"seed": [42, 43], "optim.beta": [0.95, 0.9], "optim.learning_rate": [0.02, 0.01]}
    grid, round_, states, metrics = sweep(config, values, "sequential")
    assert len(grid.replicas()) == 8
    assert round_._step._cache_size() == 1
    compare(grid, round_, states, metrics, exact=True)


# Keys fedorth branches on when they are concrete numbers (a nonzero weight decay or momentum adds
# its transform, beta = 0 skips the mixing), traced as arrays in a sweep. The values are
# exact in float32 and their complements too (1 - 0.25), so the maths is the single run's.
# A traced weight decay or local momentum of 0 computes g + 0 x and 0 m + g: the same numbers.
# A server momentum or alpha/beta of 0 would keep state the single run has not (a zero trace,
# the global direction), so those grids hold nonzero values.
TRACED_BRANCH_KEYS = [
    ("fedavg", "optim.weight_decay", [0.0, 1e-3]),
    ("fedavg", "optim.momentum", [0.0, 0.5]),
    ("fedavg", "fed.options.server_momentum", [0.5, 0.25]),
    ("fedmuon", "fed.options.alpha", [0.5, 0.25]),
    ("fedpac_soap", "fed.options.beta", [0.5, 0.25]),
    ("fedcm", "fed.options.alpha", [0.5, 0.25]),  # mixes with beta = 1 - alpha, in the round
]


@pytest.mark.parametrize("name, key, values", TRACED_BRANCH_KEYS)
def test_keys_fedorth_branches_on_are_traced_and_each_replica_is_its_single_run(name, key, values):
    config = tiny(name)
    section, _, leaf = key.rpartition(".")
    if leaf not in get_key(config, section):  # SGD's momentum, FedAvg's server momentum
        get_key(config, section)[leaf] = values[0]
    grid, round_, states, metrics = sweep(config, {key: values}, "sequential")
    assert grid.kinds[key] == "traced" and round_._step._cache_size() == 1
    compare(grid, round_, states, metrics, exact=True)


@pytest.mark.parametrize("replica_strategy", ["sequential", "vmap"])
def test_stack_and_unstack_are_inverse(replica_strategy):
    config = tiny("scaffold", "vmap")
    grid = Grid(config, {"seed": [42, 43, 44]})
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

TINY_ARGS = [
    "--config=fedavg",
    "--config.model.hidden_sizes=(16,)",
    "--config.data.num_clients=4",
    "--config.fed.clients_per_round=2",
    "--config.fed.local_steps=2",
    "--config.fed.batch_size=8",
    "--config.eval_every=2",
    "--config.checkpoint_every=2",
]
SWEEP_ARGS = ["--sweep.seed=42,43", "--sweep.optim.learning_rate=0.1,0.05"]


def _command(module: str, workdir: pathlib.Path, *args: str) -> list[str]:
    return [sys.executable, "-m", module, f"--workdir={workdir}", *TINY_ARGS, *args]


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, env=_env(), timeout=600
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


def test_sigkill_resume_equals_uninterrupted_sweep_and_single_runs(tmp_path):
    """A sweep killed (SIGKILL) after its second checkpoint and started again by the same
    command ends with the metrics of an uninterrupted sweep; each replica's metrics equal those
    of ``experiments.main`` with the replica's values (seed 43, lr 0.05 here), and
    ``experiments.report`` reads the sweep as four runs in two groups of two seeds."""
    rounds = ["--config.fed.rounds=30"]
    whole = tmp_path / "whole"
    first = _run(_command("experiments.sweep", whole, *rounds, *SWEEP_ARGS))
    assert first.returncode == 0, first.stderr
    killed = tmp_path / "killed"
    command = _command("experiments.sweep", killed, *rounds, *SWEEP_ARGS)
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=log, env=_env())
        deadline = time.monotonic() + 300
        while len(_steps(killed)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()
    assert max(_steps(killed)) < 30, "killed mid-sweep"
    again = _run(command)
    assert again.returncode == 0, again.stderr
    assert "Resumed the sweep from round" in again.stderr
    assert "Sweep of 4 replicas x 30 rounds" in again.stderr
    names = sorted(p.name for p in whole.iterdir() if (p / "config.json").exists())
    assert names == sorted(
        f"seed={s},optim.learning_rate={lr}" for s in (42, 43) for lr in (0.1, 0.05)
    )
    for name in names:
        assert _rows(killed / name) == _rows(whole / name), name
        assert (whole / name / "curves.png").exists() and (whole / name / "tensorboard").is_dir()

    single = tmp_path / "single"
    args = [*rounds, "--config.seed=43", "--config.optim.learning_rate=0.05"]
    alone = _run(_command("experiments.main", single, *args))
    assert alone.returncode == 0, alone.stderr
    replica = whole / "seed=43,optim.learning_rate=0.05"
    assert _rows(replica) == _rows(single)
    assert json.loads((replica / "config.json").read_text()) == json.loads(
        (single / "config.json").read_text()
    )

    from experiments import report

    groups = report.group_runs(report.find_runs([whole]))
    assert sorted(len(g.runs) for g in groups) == [2, 2]
