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

import jax

FAST_COMPILE = {"xla_backend_optimization_level": 0}

fast_jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)
