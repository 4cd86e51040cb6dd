"""Where a sweep's replicas run: a ``("replica", "clients")`` mesh over every device of every
process (``python -m experiments.sweep --distributed``, or ``--sweep.devices_per_replica``).

The devices of ``jax.devices()`` (every process's, in process order) form ``groups`` groups of
``devices_per_replica`` consecutive devices: the mesh's ``"replica"`` axis has one entry per
group, its ``"clients"`` axis the devices of a group. A group runs ``chunk`` replicas at a time,
vmapped; a replica's clients run on its group's devices (sharded over ``"clients"`` when the
group has more than one device, ``fed.strategy="sharded"``'s all-reduces within the group). A
call of the round runs ``groups * chunk`` replicas (a unit); the sweep's replicas fill the units
in order (replica ``r`` in unit ``r // (groups * chunk)``, group ``(r % (groups * chunk)) //
chunk``), and a grid that does not fill its last unit is padded with copies of its last replica,
whose results are dropped. Replicas share nothing: the round is a ``jax.shard_map`` over
``"replica"``, so its compiled program has no collective whose devices cross groups
(:func:`cross_replica_collectives` reads that from the compiled program's text).

The process that holds a replica's group's first device owns the replica: it evaluates it and
writes its folder.
"""

from __future__ import annotations

import dataclasses
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
      replicas: the sweep's replica count.
      chunk: replicas a group runs at once (vmapped).
    """

    mesh: Mesh
    replicas: int
    chunk: int

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

    @property
    def units(self) -> list[list[int]]:
        """The replicas of each call, padded with copies of the last replica."""
        size, out = self.unit_size, []
        for start in range(0, self.replicas, size):
            unit = list(range(start, min(start + size, self.replicas)))
            out.append(unit + [unit[-1]] * (size - len(unit)))
        return out

    @property
    def sharding(self) -> NamedSharding:
        """A stacked replica array's: its leading axis over the groups."""
        return NamedSharding(self.mesh, PartitionSpec(REPLICA_AXIS))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def group(self, replica: int) -> int:
        return (replica % self.unit_size) // self.chunk

    def owner(self, replica: int) -> int:
        """The process that evaluates replica ``replica`` and writes its folder."""
        return self.mesh.devices[self.group(replica), 0].process_index

    def owned(self) -> list[int]:
        """The replicas this process owns."""
        me = jax.process_index()
        return [r for r in range(self.replicas) if self.owner(r) == me]

    def describe(self) -> str:
        """One line: how the replicas were placed."""
        devices = self.mesh.devices.size
        processes = len({d.process_index for d in self.mesh.devices.flat})
        padded = len(self.units) * self.unit_size - self.replicas
        per_group = math.ceil(self.replicas / self.groups)
        return (
            f"Placed {self.replicas} replicas on {devices} devices of {processes} process"
            f"{'es' if processes > 1 else ''}: {self.groups} groups of "
            f"{self.devices_per_replica} device{'s' if self.devices_per_replica > 1 else ''} "
            f"(--sweep.devices_per_replica), up to {per_group} replicas per group, {self.chunk} "
            f"at once (the per-device chunk, --replica_chunk_size)"
            + (
                f"; {padded} padding replica{'s' if padded > 1 else ''} (copies, results dropped) "
                f"fill the last call, as {self.replicas} does not divide over "
                f"{self.groups} groups x {self.chunk}"
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
    devices=None,
) -> Placement:
    """The placement of ``replicas`` replicas over ``devices`` (default ``jax.devices()``).

    Args:
      replicas: the grid's replica count.
      devices_per_replica: devices that run one replica's clients (0: 1).
      chunk_size: replicas a group runs at once (0: all of its replicas); ``sequential``: 1.

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
    per_group = math.ceil(replicas / groups)
    chunk = 1 if sequential else min(chunk_size or per_group, per_group)
    mesh = Mesh(np.array(devices).reshape(groups, k), (REPLICA_AXIS, CLIENTS_AXIS))
    return Placement(mesh, replicas, chunk)


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
        found.append((op, groups))
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
