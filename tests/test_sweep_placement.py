"""Sweeps over several devices (fedorth.sweep.placement): each replica on a group of devices,
equal to its single run, and no collective between groups in the compiled round."""

from __future__ import annotations

import pytest
from test_sweep import GRID, compare, run, tiny

from fedorth.sweep import Grid, ReplicaRound
from fedorth.sweep import placement as placement_lib


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
