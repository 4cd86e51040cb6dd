"""A round, or the server state, that runs out of device memory: one paragraph naming the
remedies, not XLA's dump (on the CPU backend, the host's memory and address-space limit)."""

from __future__ import annotations

import re
import resource

import jax

from fedorth.fed.config import RoundConfig


class RoundOutOfMemoryError(MemoryError):
    """A round needs more device memory than the device has; the message names the remedies."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether XLA failed for want of memory. Its status is RESOURCE_EXHAUSTED, except on the
    CPU backend when an allocation fails while a computation is dispatched: "INTERNAL: Error
    dispatching computation: Out of memory allocating N bytes."."""
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    message = str(error)
    return "RESOURCE_EXHAUSTED" in message or "Out of memory allocating" in message


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _requested_bytes(message: str) -> int | None:
    """The allocation an XLA out-of-memory message names (GPU: "... allocate N bytes",
    "(NB)"; TPU: "Used 20.5G of 15.48G hbm"), or None."""
    # GPU "allocate N bytes"; CPU "Out of memory allocating N bytes"; "(NB)".
    for pattern in (r"allocat(?:e|ing) (\d+) bytes", r"\((\d+)B\)"):
        found = re.search(pattern, message)
        if found:
            return int(found.group(1))
    found = re.search(r"Used ([\d.]+)([KMGT]?)i?B? of", message)
    if found:
        return int(float(found.group(1)) * _UNITS[found.group(2)])
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def out_of_memory_message(error: BaseException, config: RoundConfig, device) -> str:
    """One paragraph for a round that ran out of device memory: how much XLA asked for, what
    the device holds, and the settings that shrink a round's peak memory."""
    s, k = config.clients_per_round, config.local_steps
    asked = _requested_bytes(str(error))
    asked_text = f"XLA asked for {_gib(asked)}" if asked else "XLA's message named no size"
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 -- a backend without memory statistics
        stats = {}
    if "bytes_limit" in stats:
        asked_text += (
            f"; the device has {_gib(stats['bytes_limit'])}, "
            f"{_gib(stats.get('bytes_in_use', 0))} of it in use"
        )
    strategy = config.strategy
    if strategy == "sequential":
        at_once, held = 1, "one client at a time"
    elif strategy == "chunked":
        at_once = min(config.chunk_size, s)
        held = f"{at_once} clients at a time"
    else:
        at_once, held = s, f"all {s} clients at once"
    # Fewer clients at once hold fewer activations; a sequential round has no fewer to offer.
    chunk = max(1, at_once // 2 if strategy == "chunked" else at_once // 4)
    remedies = []
    example = " E.g."
    if at_once > 1:
        remedies += [
            f"fed.strategy=chunked with fed.chunk_size={chunk} (clients vmapped {chunk} at a time)",
            "fed.strategy=sequential (one client at a time)",
        ]
        example += f" --config.fed.strategy=chunked --config.fed.chunk_size={chunk}"
    remedies += [
        "model.dtype=bfloat16 (bfloat16 activations)",
        "a smaller fed.batch_size or fed.clients_per_round",
    ]
    example += " --config.model.dtype=bfloat16."
    return (
        f"A round does not fit in the memory of {device}: {asked_text}. Strategy "
        f"{strategy!r} runs {held} ({s} clients x {k} local steps). Remedies: "
        + "; ".join(remedies)
        + "."
        + example
    )


def available_host_bytes() -> int | None:
    """What the CPU backend can still allocate: the smaller of the address space left under the
    process's limit (``ulimit -v``, ``RLIMIT_AS``) and the host's available memory; None where
    neither is known."""
    limits = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    try:
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/status") as f:
                size = re.search(r"VmSize:\s+(\d+) kB", f.read())
            limits.append(soft - (int(size.group(1)) * 1024 if size else 0))
        with open("/proc/meminfo") as f:
            free = re.search(r"MemAvailable:\s+(\d+) kB", f.read())
        if free:
            limits.append(int(free.group(1)) * 1024)
    except OSError:
        pass
    return min(limits) if limits else None


def state_out_of_memory_message(
    state_bytes: int, client_bytes: int, num_clients: int, device, available: int | None
) -> str:
    """One paragraph for a server state that does not fit at a run's start: its size, the part
    the per-client state takes, what the device has, and the settings that shrink it."""
    has = f"{_gib(available)} can still be allocated" if available is not None else "it has less"
    remedies = ["a smaller model"]
    if client_bytes:
        per_client = _gib(client_bytes // max(num_clients, 1))
        held = f", {_gib(client_bytes)} of it the state each of the {num_clients} clients keeps"
        held += f" ({per_client} per client)"
        remedies.insert(0, "a smaller data.num_clients (the kept state grows with it)")
        example = f" E.g. --config.data.num_clients={max(1, num_clients // 4)}."
    else:
        held, example = "", ""
    return (
        f"The server state does not fit in the memory of {device}: it needs {_gib(state_bytes)}"
        f"{held}; {has}. Remedies: " + "; ".join(remedies) + "." + example
    )
