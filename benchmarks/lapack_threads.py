"""Host LAPACK threads: SOAP's factorizations with one OpenBLAS thread and with the cores
(docs/PERFORMANCE.md, "Host LAPACK threads").

    python benchmarks/lapack_threads.py [--sizes 1024,4096] [--repeats 3]

Times, interleaved repeat by repeat (the machine may be shared), ``fedorth.optim.linalg``'s
float32 ``eigh`` of an ``n × n`` factor and economic QR of an ``n × n`` matrix, each inside a
jitted program on one CPU device (as a ``sequential`` round calls them), lowered once with
``FEDORTH_LAPACK_THREADS=1`` and once with ``auto`` (the cores divided by the program's devices),
plus ``torch.linalg.eigh``/``qr`` with ``torch.set_num_threads(cores)`` where torch is installed
(the round benchmark's peer, with ``OMP_WAIT_POLICY=PASSIVE`` as there). Prints the medians,
the ratios, whether the two fedorth settings give the same bytes, and the largest difference
between them (eigenvalues relative to the largest; ``Q R`` against the input).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # what experiments/__init__.py sets
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch, as the round benchmark sets it

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedorth.optim import linalg  # noqa: E402


def lowered(fn, x, threads: str):
    """``jax.jit(fn)`` compiled for ``x`` under ``FEDORTH_LAPACK_THREADS=threads``."""
    before = os.environ.get(linalg.THREADS_ENV)
    os.environ[linalg.THREADS_ENV] = threads
    try:
        return jax.jit(lambda m: fn(m)).lower(x).compile()
    finally:
        if before is None:
            del os.environ[linalg.THREADS_ENV]
        else:
            os.environ[linalg.THREADS_ENV] = before


def timed(fn, x) -> tuple[float, tuple]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(x))
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"# cores {cores}, load {os.getloadavg()}, auto = {linalg.host_threads(1)} threads")
    try:
        import torch

        torch.set_num_threads(cores)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    for n in (int(s) for s in args.sizes.split(",")):
        g = rng.standard_normal((n, n // 2)).astype(np.float32)
        factor = jax.numpy.asarray(g @ g.T / (n // 2))
        square = jax.numpy.asarray(rng.standard_normal((n, n)).astype(np.float32))
        for name, fn, x in (("eigh", linalg.eigh, factor), ("qr", linalg.qr, square)):
            sides = {t: lowered(fn, x, t) for t in ("1", "auto")}
            times = {t: [] for t in (*sides, "torch")}
            outs = {}
            for _ in range(args.repeats):
                for t, f in sides.items():
                    seconds, outs[t] = timed(f, x)
                    times[t].append(seconds)
                if torch is not None:
                    tx = torch.from_numpy(np.array(x))
                    op = torch.linalg.eigh if name == "eigh" else torch.linalg.qr
                    start = time.perf_counter()
                    op(tx)
                    times["torch"].append(time.perf_counter() - start)
            med = {t: statistics.median(v) for t, v in times.items() if v}
            same = all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(outs["1"], outs["auto"], strict=True)
            )
            if name == "eigh":
                w1, wa = (np.asarray(outs[t][0]) for t in ("1", "auto"))
                diff = float(np.max(np.abs(w1 - wa)) / np.max(np.abs(w1)))
            else:
                q, r = (np.asarray(o) for o in outs["auto"])
                diff = float(np.max(np.abs(q @ r - np.asarray(x))))
            line = (
                f"{name} n={n}: 1 thread {med['1']:.2f} s, auto {med['auto']:.2f} s "
                f"(x{med['1'] / med['auto']:.2f})"
            )
            if "torch" in med:
                line += f", torch {med['torch']:.2f} s (auto x{med['torch'] / med['auto']:.2f})"
            print(f"{line}; same bytes: {same}; max diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
