"""Helpers shared by test files (the federated toy problems and engine runs: fed_problems.py).

:func:`fast_jit` is ``jax.jit`` with XLA:CPU's LLVM code generation at optimization level 0.
No level enables fast-math, so a program computes the same IEEE operations at every level; the
levels differ in how the machine code combines them (fused multiply-adds, vectorized loops), so
results can move at the last bit. Tests that compare a program's output with a float64 NumPy
reference, or two programs with each other, at tolerances far above one rounding may use it:
level 0 compiles in about half the time (ResNet-18's float64 gradient: 8.0 -> 4.1 CPU-s). Not
for fedorth's own jitted programs (the rounds, the runner: tests run those as users get them),
nor for comparisons with golden values recorded at the default level.
"""

from __future__ import annotations

import functools
import pathlib
import re

import jax

FAST_COMPILE = {"xla_backend_optimization_level": 0}

fast_jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


def equations(jaxpr):
    """Every equation of a (closed) jaxpr, those of its sub-jaxprs (cond branches, scan and
    while bodies, pjit calls) too, depth first."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def rewrite_doc_section(doc: pathlib.Path, section: str, body: str) -> None:
    """Replaces the ``section`` heading's part of ``doc`` (up to the next ``## ``) with
    ``section`` + ``body``, or appends it: the generated sections of docs/ERRORS.md."""
    text = doc.read_text()
    parts = text.split("\n" + section + "\n")
    rest = parts[1].split("\n## ", 1)[1] if len(parts) > 1 and "\n## " in parts[1] else None
    new = section + "\n" + body
    doc.write_text(parts[0].rstrip("\n") + "\n\n" + new + ("\n## " + rest if rest else ""))


def blas_threads_seen(monkeypatch) -> list[int]:
    """The OpenBLAS thread count each host ``eigh`` call of ``fedorth.optim.linalg`` runs with,
    recorded inside the call (appended to the returned list as calls run)."""
    from threadpoolctl import threadpool_info

    from fedorth.optim import linalg

    seen = []
    original = linalg._np_eigh

    def spy(x):
        seen.append(max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"))
        return original(x)

    monkeypatch.setattr(linalg, "_np_eigh", spy)
    return seen


# Gloo's log line when a process of a two-process run connects. Its threads can write two of them
# into one another ("[Gloo] Rank [Gloo] Rank 1 is connected ... : 1" then "1 is connected ...").
_GLOO_CONNECTED = re.compile(
    r"(\[Gloo\] )*(Rank )?\d+ is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : \d+"
)


def process_lines(output: str) -> list[str]:
    """A command's own lines: without the progress bar's lines ("[###...] round r/R ..."), Gloo's
    "[Gloo] Rank ..." log lines, whole or written into one another, and empty lines."""
    output = _GLOO_CONNECTED.sub("", output)
    return [line for line in output.splitlines() if line.strip() and not line.startswith("[")]
