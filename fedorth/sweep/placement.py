"""Where a sweep's replicas run: a ``("replica", "clients")`` mesh over every device of every
process (``python -m experiments.sweep --distributed``, or ``--sweep.devices_per_replica``).

The devices of ``jax.devices()`` (every process's, in process order) form ``groups`` groups of
``devices_per_replica`` consecutive devices: the mesh's ``"replica"`` axis has one entry per
group, its ``"clients"`` axis the devices of a group. Replica ``r`` runs on group ``r % groups``;
a group runs ``chunk`` of its replicas at a time, vmapped, and a replica's clients run on its
group's devices (sharded over ``"clients"`` when the group has more than one device, with
``fed.strategy="sharded"``'s all-reduces within the group). A call of the round (a unit) runs
``chunk`` replicas of every group; a grid that does not divide over the groups leaves slots of
the last call empty, and they run a copy of a replica whose results are dropped. Replicas
share nothing: the round is a ``jax.shard_map`` over
``"replica"``, so its compiled program has no collective whose devices cross groups
(:func:`cross_replica_collectives` reads that from the compiled program's text).

The process that holds a replica's group's first device owns the replica: it evaluates it and
writes its folder.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedorth.sweep.grid import SweepError

REPLICA_AXIS = "replica"
CLIENTS_AXIS = "clients"  # fedorth.fed.execution's sharded clients run over this axis


@dataclasses.dataclass(frozen=True)
class Placement:
    """The replicas' places on a ``("replica", "clients")`` mesh (see the module docstring).

    Attributes:
      mesh: ``groups x devices_per_replica`` devices.
      assignment: each replica's group.
      chunk: replicas a group runs at once (vmapped).
    """

    mesh: Mesh
    assignment: tuple[int, ...]
    chunk: int

    @property
    def replicas(self) -> int:
        return len(self.assignment)

    @property
    def groups(self) -> int:
        return self.mesh.shape[REPLICA_AXIS]

    @property
    def devices_per_replica(self) -> int:
        return self.mesh.shape[CLIENTS_AXIS]

    @property
    def unit_size(self) -> int:
        """Replicas a call of the round runs: ``groups * chunk``."""
        return self.groups * self.chunk

    @functools.cached_property
    def units(self) -> list[list[int]]:
        """The replicas of each call, group after group (``chunk`` slots each); a slot no
        replica fills holds a copy of the call's first replica."""
        members = [
            [r for r, g in enumerate(self.assignment) if g == group] for group in range(self.groups)
        ]
        calls = math.ceil(max(len(m) for m in members) / self.chunk)
        out = []
        for call in range(calls):
            slots = [
                m[i] if i < len(m) else None
                for m in members
                for i in range(call * self.chunk, (call + 1) * self.chunk)
            ]
            fill = next(r for r in slots if r is not None)
            out.append([fill if r is None else r for r in slots])
        return out

    @functools.cached_property
    def positions(self) -> dict[int, tuple[int, int]]:
        """Each replica's call and slot in it (its own group's slot, never a copy's)."""
        out = {}
        for call, unit in enumerate(self.units):
            for slot, r in enumerate(unit):
                if slot // self.chunk == self.assignment[r]:
                    out.setdefault(r, (call, slot))
        return out

    @property
    def sharding(self) -> NamedSharding:
        """A stacked replica array's: its leading axis over the groups."""
        return NamedSharding(self.mesh, PartitionSpec(REPLICA_AXIS))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def owner(self, replica: int) -> int:
        """The process that evaluates replica ``replica`` and writes its folder."""
        return self.mesh.devices[self.assignment[replica], 0].process_index

    def owned(self) -> list[int]:
        """The replicas this process owns."""
        me = jax.process_index()
        return [r for r in range(self.replicas) if self.owner(r) == me]

    def describe(self) -> str:
        """One line: how the replicas were placed."""
        devices = self.mesh.devices.size
        processes = len({d.process_index for d in self.mesh.devices.flat})
        padded = len(self.units) * self.unit_size - self.replicas
        per_group = [self.assignment.count(g) for g in range(self.groups)]
        k = self.devices_per_replica
        return (
            f"Placed {self.replicas} replicas on {devices} device{'s' if devices > 1 else ''} of "
            f"{processes} process{'es' if processes > 1 else ''}: {self.groups} group"
            f"{'s' if self.groups > 1 else ''} of {k} device{'s' if k > 1 else ''} "
            f"(--sweep.devices_per_replica) with {min(per_group)}"
            + (f" to {max(per_group)}" if max(per_group) > min(per_group) else "")
            + f" replicas each, {self.chunk} at once (--replica_chunk_size, per group)"
            + (
                f"; {padded} empty slot{'s' if padded > 1 else ''} of the "
                f"{len(self.units)} call{'s' if len(self.units) > 1 else ''} run a copy "
                "whose results are dropped"
                if padded
                else ""
            )
            + "."
        )


def place(
    replicas: int,
    *,
    devices_per_replica: int = 0,
    chunk_size: int = 0,
    sequential: bool = False,
    assignment: list[int] | None = None,
    devices=None,
) -> Placement:
    """The placement of ``replicas`` replicas over ``devices`` (default ``jax.devices()``).

    Args:
      replicas: the grid's replica count.
      devices_per_replica: devices that run one replica's clients (0: 1).
      chunk_size: replicas a group runs at once (0: all of its replicas); ``sequential``: 1.
      assignment: each replica's group (default: replica ``r`` on group ``r % groups``, so
        that which process owns a replica does not depend on the chunk).

    Raises:
      SweepError: ``devices_per_replica`` is more than the devices, or does not divide them.
    """
    devices = list(jax.devices() if devices is None else devices)
    k = devices_per_replica or 1
    if k < 1 or k > len(devices):
        raise SweepError(
            f"--sweep.devices_per_replica={devices_per_replica}: the run has {len(devices)} "
            f"device{'s' if len(devices) > 1 else ''} (every process's); give at most "
            f"{len(devices)}, or start more processes or devices."
        )
    if len(devices) % k:
        dividing = [d for d in range(1, len(devices) + 1) if len(devices) % d == 0]
        raise SweepError(
            f"--sweep.devices_per_replica={k} does not divide the run's {len(devices)} devices "
            f"into groups: give one of {dividing}."
        )
    if chunk_size < 0:
        raise SweepError(f"--replica_chunk_size={chunk_size} must be >= 0 (0: all at once).")
    groups = len(devices) // k
    if assignment is None:
        assignment = [r % groups for r in range(replicas)]
    most = max(assignment.count(g) for g in range(groups))
    chunk = 1 if sequential else min(chunk_size or most, most)
    mesh = Mesh(np.array(devices).reshape(groups, k), (REPLICA_AXIS, CLIENTS_AXIS))
    return Placement(mesh, tuple(assignment), chunk)


def check_same_in_every_process(text: str) -> None:
    """Refuses, in one line in every process, a run whose processes were given other configs or
    grids (``text``: this process's description of them); a collective."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], dtype=np.int64)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    others = [i for i, d in enumerate(digests) if d != digests[0]]
    if others:
        raise SweepError(
            f"process{'es' if len(others) > 1 else ''} {', '.join(map(str, others))} of the "
            f"run's {jax.process_count()} got another config or grid than process 0 (another "
            "--config, --config.*, --sweep.* or --replica_* flag, or another config file): "
            "start every process with the same command."
        )


_COLLECTIVE = re.compile(
    r"=\s*\S+\s+(all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)"
    r"(?:-start)?\((.*)$",
    re.MULTILINE,
)
_GROUPS = re.compile(r"replica_groups=(\{[^=]*\}|\[[^\]]*\]<=\[[^\]]*\](?:T\([^)]*\))?)")
_PAIRS = re.compile(r"source_target_pairs=\{([^=]*)\}")


def _iota_groups(text: str) -> list[list[int]]:
    """``[G,S]<=[dims]T(perm)``: XLA's iota replica groups."""
    shape, _, rest = text.partition("<=")
    groups, size = (int(n) for n in shape.strip("[]").split(","))
    dims_text, _, perm_text = rest.partition("T")
    dims = [int(n) for n in dims_text.strip("[]").split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if perm_text:
        ids = ids.transpose([int(n) for n in perm_text.strip("()").split(",")])
    return ids.reshape(groups, size).tolist()


def collectives(hlo_text: str) -> list[tuple[str, list[list[int]]]]:
    """Each collective of a compiled program's text: its op and its groups of device
    positions (in the program's device assignment: the mesh's devices, flattened)."""
    found = []
    for match in _COLLECTIVE.finditer(hlo_text):
        op, rest = match.groups()
        groups: list[list[int]] = []
        if (pairs := _PAIRS.search(rest)) is not None:
            groups = [
                [int(n) for n in pair.split(",")] for pair in re.findall(r"\{(\d+,\d+)\}", pairs[1])
            ]
        elif (given := _GROUPS.search(rest)) is not None:
            text = given[1]
            if text.startswith("{"):
                groups = [
                    [int(n) for n in g.split(",") if n] for g in re.findall(r"\{([\d,]*)\}", text)
                ]
            else:
                groups = _iota_groups(text)
        found.append((op, [g for g in groups if g]))  # "{}": one group of every device
    return found


def cross_replica_collectives(hlo_text: str, placement: Placement) -> list[str]:
    """The collectives of a compiled sweep round whose devices span more than one group of
    ``placement`` (an empty group list: every device, so it crosses whenever there are several
    groups)."""
    k = placement.devices_per_replica
    crossing = []
    for op, groups in collectives(hlo_text):
        spans = [g for g in groups if len({position // k for position in g}) > 1]
        if spans or (not groups and placement.groups > 1):
            crossing.append(f"{op} over {spans[0] if spans else 'every device'}")
    return crossing
