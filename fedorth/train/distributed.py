"""Several processes (``python -m experiments.main --distributed``): start ``jax.distributed``, and
when a process of the run dies, stop the others within seconds with one line naming it.

Two ways a process is lost, both ending in ``exit_if_peers_lost``'s line and exit code 1:

* Killed or crashed: its connections reset, so the others' next collective fails at once (gloo on
  CPU: "Connection reset by peer", an error that names no process) and ``experiments.main``
  asks; losing the coordinator makes JAX's error-polling thread abort at once.
* Silent (a frozen or unplugged host): JAX's heartbeat finds it after ``heartbeat_timeout_s``
  and aborts every other process.

Ctrl-C and SIGTERM: JAX's ``initialize`` installs its own C-level SIGTERM handler (its
preemption notice), which would leave a scheduler's SIGTERM unanswered; the Python handlers there
were are put back. The loop's processes then agree after every round on whether any of them got
a signal (:func:`agree_on_signal`), and all save that round and stop; :func:`leave` ends each
process after that stop (through JAX's shutdown barrier when all stopped together, else at once:
the others find this one lost).

JAX's abort (a fatal log record, a C++ stack, Python's thread dump: 70-90 lines) is replaced by
a C-level SIGABRT handler, and the fatal record by a filter on file descriptor 2. Which process
is lost: each process stamps a counter in the coordinator's key-value store twice a second and
reads the others'; a process whose counter stood still for ``_SILENT_S`` is dead, and when the
coordinator no longer accepts connections, it is. JAX's heartbeat can abort before a silent
process's counter has stood still that long (a process's heartbeats and stamps are not in step,
and a loaded machine delays either), so the abort handler also takes the processes that JAX's
fatal record names: those that stopped sending heartbeats, or the coordinator when this
process's own heartbeat to it failed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import re
import signal
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax._src import distributed as jax_distributed  # its client: orbax's multihost uses it too
from jax._src.lib import utils as lib_utils
from jax.sharding import Mesh

HEARTBEAT_TIMEOUT_S = 10  # JAX's default, 100 s, leaves the others waiting for minutes
_STAMP_EVERY_S = 0.5
_SILENT_S = 2.0  # four missed stamps: dead, not slow (the stamps come from their own thread)
_PREFIX = "fedorth/"


def initialize(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
) -> None:
    """``jax.distributed.initialize`` with gloo collectives on CPU; a lost process named.

    Arguments left as None are detected from the cluster (SLURM, Open MPI, TPU pods). Must run
    before anything starts a JAX backend (no fedorth module does so at import).
    """
    # CPU processes all-reduce through gloo (accelerators use their own collectives).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        # A process lost during the final barrier is found by the heartbeat; no longer wait.
        shutdown_timeout_seconds=max(2 * heartbeat_timeout_s, 30),
    )
    # The coordination service's errors and warnings about a lost process (a dozen lines): the
    # line naming it replaces them.
    lib_utils.absl_set_min_log_level(3)
    jax.devices()  # every process exchanges its devices now, before one can fail alone
    for signum, handler in handlers.items():  # JAX's C handler replaced them at the C level
        if handler is not None:
            signal.signal(signum, handler)
    _Liveness.start()
    _StderrFilter.start()
    _on_abort.handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_abort)  # kept alive
    ctypes.CDLL(None).signal(signal.SIGABRT, _on_abort.handler)


COPIES_AXIS = "copies"
"""The axis of :func:`round_mesh` whose devices run the same clients (size 1 when the clients
divide over every device)."""


def round_mesh(clients_per_round: int) -> Mesh | None:
    """The mesh that a round of a multi-process run lays its ``clients_per_round`` clients over,
    or None in a single process (``fedorth.fed.client_mesh`` chooses there).

    Every device of every process, as a ``("clients", "copies")`` grid: the clients are split
    over ``g = gcd(clients_per_round, devices)`` groups of devices, and the devices of a group run
    the same clients. A single process lays ``S`` clients over the first ``d`` devices that
    divide them, the others idle; several processes cannot leave one out: a round whose devices
    are all process 0's (``S = 5`` on 2 processes of one device each: ``d = 1``) is a program of
    process 0 alone, which process 0 runs without the others while they cannot read the state it
    holds ("spans non-addressable devices"). The groups take consecutive devices (a process's
    devices share clients before processes do), so with ``g`` equal to a single process's ``d``
    the round's sums are those of one process over the same devices.
    """
    if _REPLICA_ROUNDS or not jax.distributed.is_initialized() or jax.process_count() == 1:
        return None
    devices = np.array(jax.devices())
    groups = math.gcd(clients_per_round, devices.size)
    return Mesh(devices.reshape(groups, devices.size // groups), ("clients", COPIES_AXIS))


_REPLICA_ROUNDS = False


@contextlib.contextmanager
def rounds_of_replicas():
    """Within it :func:`round_mesh` is None: a sweep's replicas each run on their own group of
    devices, placed by ``fedorth.sweep.placement``, not one round over every device."""
    global _REPLICA_ROUNDS
    before, _REPLICA_ROUNDS = _REPLICA_ROUNDS, True
    try:
        yield
    finally:
        _REPLICA_ROUNDS = before


def agree_on_signal(signum: int) -> int:
    """The signal any process of the run received (``signum``: this one's, 0 for none), the
    same in every process; a collective: every process calls it at the same point."""
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(signum))))


def leave(code: int, *, together: bool) -> None:
    """Ends this process with exit code ``code`` after a Ctrl-C or SIGTERM stopped it.

    ``together``: every process stopped at the same round; they leave through JAX's shutdown
    barrier, so that none finds another lost. Otherwise (a second signal, or one before the
    rounds) at once: the others' next collective fails and they name this process."""
    if together and jax_distributed.global_state.client is not None:
        if _Liveness.instance is not None:
            _Liveness.instance.stop.set()
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 -- another process left at once: it is named there
            pass
    _exit("", code)


def exit_if_peers_lost() -> None:
    """After an error: if processes of the run are lost, one line naming them, exit code 1.

    Returns (for the caller to raise its error) when every process is alive. Waits up to
    ``_SILENT_S`` seconds for a lost process's counter to stand still. Exits at once, not through
    JAX's shutdown barrier, which would wait for the lost process and then abort.
    """
    liveness = _Liveness.instance
    if liveness is None:
        return
    dead = liveness.dead_processes(wait=True)
    if dead:
        _exit(liveness.message(dead), 1)


def _on_abort(signum: int) -> None:
    """SIGABRT, raised by JAX's error-polling thread (in it, while gRPC waits on it: no RPC)."""
    liveness = _Liveness.instance
    record = _StderrFilter.held_back()  # JAX's fatal record, written before it aborted
    if liveness is not None:
        named = [i for i in lost_in_record(record, liveness.me) if i in liveness.names]
        dead = sorted({*liveness.dead_processes(wait=False), *named})
        if dead:
            _exit(liveness.message(dead), 1)
    # Another fatal error: the record explains it.
    _exit(record, 134)


# The coordination service's verdict, one task id a line: "... unhealthy (stopped sending
# heartbeats):\n1\n2\nThe tasks have crashed ...".
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\n((?:\d+\n)+)")
# This process's heartbeat to the coordination service got no answer: the coordinator is lost.
_OWN_HEARTBEAT_FAILED = re.compile(r"RPC: /xla\.coordination\.CoordinationService/Heartbeat\b")


def lost_in_record(record: str, me: int) -> list[int]:
    """The processes that JAX's fatal record (the text its coordination client logs before it
    aborts) says are lost: the tasks that stopped sending heartbeats, or the coordinator
    (process 0) when this process ``me`` could not send its own heartbeat to it."""
    lost = [int(i) for found in _UNHEALTHY.findall(record) for i in found.split()]
    if me != 0 and _OWN_HEARTBEAT_FAILED.search(record):
        lost.append(0)
    return sorted(set(lost) - {me})


_EXITING = threading.Lock()


def _exit(text: str, code: int) -> None:
    if not _EXITING.acquire(blocking=False):  # the other thread is saying it
        time.sleep(60)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe: nothing more to say there
            pass
    _StderrFilter.stop()
    os.write(2, text.encode())
    os._exit(code)


class _Liveness:
    """This process's counter in the coordinator's key-value store, and when the others' moved."""

    instance: _Liveness | None = None

    def __init__(self):
        self.client = jax_distributed.global_state.client
        self.coordinator = jax_distributed.global_state.coordinator_address or ""
        self.me, self.count = jax.process_index(), jax.process_count()
        self.stop = threading.Event()
        self.client.key_value_set(
            f"{_PREFIX}name/{self.me}", f"pid {os.getpid()} on {socket.gethostname()}"
        )
        self.names = {
            i: self.client.blocking_key_value_get(f"{_PREFIX}name/{i}", 60_000)
            for i in range(self.count)
        }
        self.names[0] += f", the coordinator at {self.coordinator}"
        now = time.monotonic()
        self.seen = {i: (None, now) for i in range(self.count) if i != self.me}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._beat, name="fedorth-liveness", daemon=True)

    @classmethod
    def start(cls) -> None:
        if jax_distributed.global_state.client is None or cls.instance is not None:
            return
        cls.instance = cls()
        cls.instance.thread.start()
        # atexit runs last-registered first: the thread stops before jax shuts the client down.
        atexit.register(cls.instance.stop.set)

    def _beat(self) -> None:
        beat = 0
        while not self.stop.is_set():
            try:
                self.client.key_value_set(f"{_PREFIX}alive/{self.me}", str(beat), True)
                entries = self.client.key_value_dir_get(f"{_PREFIX}alive/")
            except Exception:  # the coordinator is gone: dead_processes finds it
                return
            now = time.monotonic()
            with self.lock:
                for key, value in entries:
                    i = int(key.rsplit("/", 1)[-1])
                    if i in self.seen and self.seen[i][0] != value:
                        self.seen[i] = (value, now)
            beat += 1
            self.stop.wait(_STAMP_EVERY_S)

    def dead_processes(self, *, wait: bool) -> list[int]:
        """The other processes lost: the coordinator if it refuses connections, else those
        whose counter stood still for ``_SILENT_S`` (waiting for that, with ``wait``)."""
        if self.me != 0 and not self._coordinator_answers():
            return [0]
        deadline = time.monotonic() + (_SILENT_S + 2 * _STAMP_EVERY_S if wait else 0)
        while True:
            now = time.monotonic()
            with self.lock:
                dead = [i for i, (_, moved) in self.seen.items() if now - moved > _SILENT_S]
            if dead or now >= deadline:
                return dead
            time.sleep(_STAMP_EVERY_S / 2)

    def _coordinator_answers(self) -> bool:
        host, _, port = self.coordinator.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=_SILENT_S):
                return True
        except (OSError, ValueError):
            return False

    def message(self, dead: list[int]) -> str:
        return lost_message({i: self.names[i] for i in dead}, self.me, self.count) + "\n"


def lost_message(dead: dict[int, str], me: int, count: int) -> str:
    """The line a process prints when the processes ``dead`` (id: "pid P on HOST") are lost."""
    who = ", ".join(f"process {i} ({name})" for i, name in dead.items())
    return (
        f"error: {who} of the run's {count} stopped (killed, crashed or unreachable: its own "
        f"output says why), so process {me} stops too. Start the same command on every process "
        "again: the run resumes from its last checkpoint."
    )


class _StderrFilter:
    """File descriptor 2 through a pipe, forwarded by a thread up to JAX's first fatal record.

    What the C++ runtime writes once it logs a fatal error (the record, a 10-frame stack) is held
    back: the process is about to end, and the line naming the lost process says why.
    """

    _FATAL = re.compile(rb"(?:^|\n)F\d{4} \d\d:\d\d:\d\d")
    instance: _StderrFilter | None = None

    def __init__(self):
        self.original = os.dup(2)
        self.read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.kept = bytearray()
        self.thread = threading.Thread(target=self._forward, name="fedorth-stderr", daemon=True)

    @classmethod
    def start(cls) -> None:
        if cls.instance is None:
            cls.instance = cls()
            cls.instance.thread.start()
            atexit.register(cls.stop)  # everything written before the exit gets out

    @classmethod
    def stop(cls) -> None:
        """Points fd 2 back at the terminal or file; the thread forwards what is left and ends."""
        if cls.instance is not None:
            os.dup2(cls.instance.original, 2)  # closes the pipe's last writer: end of file
            cls.instance.thread.join(timeout=5)

    @classmethod
    def held_back(cls) -> str:
        cls.stop()
        return cls.instance.kept[:4000].decode(errors="replace") if cls.instance else ""

    def _forward(self) -> None:
        holding = False
        while chunk := os.read(self.read, 65536):
            if not holding and (fatal := self._FATAL.search(chunk)):
                cut = fatal.start() + fatal.group().startswith(b"\n")
                os.write(self.original, chunk[:cut])
                chunk, holding = chunk[cut:], True
            if holding:
                self.kept += chunk[: max(0, 8000 - len(self.kept))]
            else:
                os.write(self.original, chunk)
        os.close(self.read)
