"""Sweeps over several devices (fedorth.sweep.placement): each replica on a group of devices,
equal to its single run, and no collective between groups in the compiled round."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from test_sweep import GRID, compare, replica_rows, run, run_sweep_in, tiny

from fedorth.fed import RoundOutOfMemoryError
from fedorth.sweep import Grid, ReplicaRound, SweepError, strategy
from fedorth.sweep import placement as placement_lib
from fedorth.sweep.grid import parse_devices_per_replica


def placed(devices_per_replica: int, replica_strategy="vmap", seeds=(42, 43, 44), **kwargs):
    grid = Grid(tiny("fedavg", **kwargs), {**GRID, "seed": list(seeds)})
    round_ = ReplicaRound.from_grid(
        grid, strategy=replica_strategy, devices_per_replica=devices_per_replica
    )
    return grid.replicas(), *run(round_)


@pytest.mark.cpu_devices
@pytest.mark.parametrize("devices_per_replica", [1, 2])
def test_placed_replicas_are_their_single_runs_and_share_no_collective(devices_per_replica):
    replicas, round_, states, metrics = placed(devices_per_replica)
    compare(replicas, round_, states, metrics, exact=False)
    placement = round_.placement
    assert placement.devices_per_replica == devices_per_replica
    assert placement.groups == 8 // devices_per_replica
    unit = round_.units[0]
    text = (
        round_._step.lower(states[0], round_._unit_data(unit), round_._unit_values(unit))
        .compile()
        .as_text()
    )
    found = placement_lib.collectives(text)
    assert placement_lib.cross_replica_collectives(text, placement) == [], found
    if devices_per_replica == 1:
        assert found == []
    else:  # the clients' all-reduces, within each replica's pair of devices
        assert found and all(len(g) == 2 for _, groups in found for g in groups), found


ERRORS = (pathlib.Path(__file__).parent.parent / "docs" / "ERRORS.md").read_text()


@pytest.mark.parametrize(
    "devices_per_replica, message",
    [
        (
            16,
            "--sweep.devices_per_replica=16: the run has 8 devices (every process's); give at "
            "most 8, or start more processes or devices.",
        ),
        (
            3,
            "--sweep.devices_per_replica=3 does not divide the run's 8 devices into groups: give "
            "one of [1, 2, 4, 8].",
        ),
    ],
)
def test_devices_per_replica_beyond_or_not_dividing_the_devices_is_one_line(
    devices_per_replica, message
):
    with pytest.raises(SweepError) as raised:
        placement_lib.place(5, devices_per_replica=devices_per_replica, devices=list(range(8)))
    assert str(raised.value) == message
    assert f"error: {message} |" in ERRORS


def test_a_bad_devices_per_replica_is_one_line():
    with pytest.raises(SweepError) as raised:
        parse_devices_per_replica("two")
    assert f"error: {raised.value} |" in ERRORS


class _Device:
    def __init__(self, process_index):
        self.process_index = process_index


def test_a_grid_that_does_not_divide_runs_in_padded_calls_and_says_how():
    """5 replicas on 2 processes x 2 devices: 4 groups, replica r on group r % 4, 2 calls of one
    replica per group; the second call's empty slots copy a replica, dropped."""
    devices = [_Device(p) for p in (0, 0, 1, 1)]
    placement = placement_lib.place(5, chunk_size=1, devices=devices)
    assert placement.units == [[0, 1, 2, 3], [4, 4, 4, 4]]
    assert placement.positions == {0: (0, 0), 1: (0, 1), 2: (0, 2), 3: (0, 3), 4: (1, 0)}
    assert [placement.owner(r) for r in range(5)] == [0, 0, 1, 1, 0]
    assert placement.describe() == (
        "Placed 5 replicas on 4 devices of 2 processes: 4 groups of 1 device "
        "(--sweep.devices_per_replica) with 1 to 2 replicas each, 1 at once "
        "(--replica_chunk_size, per group); 3 empty slots of the 2 calls run a copy whose "
        "results are dropped."
    )
    # All of a group's replicas at once: one call, its group 0 running replicas 0 and 4.
    whole = placement_lib.place(5, devices=devices, devices_per_replica=2)
    assert whole.groups == 2 and whole.chunk == 3
    assert whole.units == [[0, 2, 4, 1, 3, 0]]
    assert [whole.owner(r) for r in range(5)] == [0, 1, 0, 1, 0]


def test_out_of_memory_names_the_per_device_chunk(monkeypatch):
    _, round_, states, _ = placed(1, replica_strategy="vmap", seeds=(42, 43))

    def out_of_memory(*args):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."
        )

    monkeypatch.setattr(round_, "_step", out_of_memory)
    with pytest.raises(RoundOutOfMemoryError) as raised:
        round_(states)
    # 2 replicas on 8 devices: one at a time on each; the fix is more devices per replica.
    assert "raise --sweep.devices_per_replica" in str(raised.value)
    placement = placement_lib.place(32, chunk_size=4, devices=list(jax.devices()))
    message = strategy.out_of_memory_message("vmap", 4, placement)
    assert message == (
        "A sweep round ran out of device memory: lower --replica_chunk_size (the per-device "
        "chunk: 4 replicas at once on each device; 1 runs one at a time)."
    )
    assert f"error: {message} |" in ERRORS


@pytest.mark.slow
@pytest.mark.cpu_devices
def test_a_resume_reads_the_checkpoint_whatever_the_placement(tmp_path):
    """Two rounds of seed 42 on 8 groups of one device; then seed 43 added on 4 groups of two
    devices (the new replica catches up on its own group); then the finished sweep again on one
    device. The rows are those of the sweep run without a stop on one device, to float32
    rounding (vmapped per group there, one at a time here)."""
    grid = {"seed": [42, 43], "optim.learning_rate": [0.1]}
    run_sweep_in(tmp_path / "reference", grid, 4)
    workdir = tmp_path / "s"
    out = run_sweep_in(workdir, {**grid, "seed": [42]}, 2, devices_per_replica=1)
    assert "Placed 1 replicas on 8 devices of 1 process: 8 groups of 1 device" in out, out
    out = run_sweep_in(workdir, grid, 4, devices_per_replica=2)
    assert "Resumed the sweep from round 2" in out, out
    assert "New in the grid, run from round 0 up to round 2 first" in out, out
    out = run_sweep_in(workdir, grid, 4)
    assert "Resumed the sweep from round 4" in out, out
    rows, reference = replica_rows(workdir), replica_rows(tmp_path / "reference")
    assert sorted(rows) == sorted(reference) and len(rows) == 2
    for name, theirs in reference.items():
        assert [row["round"] for row in rows[name]] == list(range(5)), name
        for a, b in zip(rows[name], theirs, strict=True):
            assert a.keys() == b.keys(), name
            for key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize(
    "line, crossing",
    [
        ("%ar = f32[] all-reduce(f32[] %x), channel_id=1, replica_groups={{0,1},{2,3}}", False),
        ("%ar = f32[] all-reduce(f32[] %x), channel_id=1, replica_groups={{0,2},{1,3}}", True),
        ("%ar = f32[] all-reduce(f32[] %x), channel_id=1, replica_groups={}", True),
        ("%ag = f32[4] all-gather-start(f32[2] %x), replica_groups=[2,2]<=[4]", False),
        ("%ag = f32[4] all-gather(f32[2] %x), replica_groups=[2,2]<=[2,2]T(1,0)", True),
        ("%cp = f32[] collective-permute(f32[] %x), source_target_pairs={{0,1},{1,0}}", False),
        ("%cp = f32[] collective-permute(f32[] %x), source_target_pairs={{1,2}}", True),
    ],
)
def test_collectives_across_replicas_are_read_from_the_programs_text(line, crossing):
    """Groups of 2 devices (4 devices, devices_per_replica=2): a group of devices 0 and 1 stays
    within replica group 0; {} is every device."""
    placement = placement_lib.place(2, devices_per_replica=2, devices=jax.devices()[:4])
    assert bool(placement_lib.cross_replica_collectives(line, placement)) == crossing
