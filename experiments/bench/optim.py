"""``optim`` subcommand of experiments.bench: one optimizer update, and Newton–Schulz alone.

    python -m experiments.bench optim [--shapes 256x256,1024x1024,768x3072,3x3x64x64]
                                      [--repeats 10] [--warmup 2] [--ns-steps 5] [--json out.json]

`optim`: time per update (median of `--repeats` calls after `--warmup`, each synchronized with
`block_until_ready`, optimizer state threaded through so schedule counters advance) of fedorth's
muon, soap, sophia against optax.contrib.muon, optax.contrib.sophia and optax.adamw, one
parameter leaf of each shape; then Newton–Schulz alone: fedorth's `newton_schulz` against
optax.contrib's `orthogonalize_via_newton_schulz` (same coefficients, steps and eps), with the
achieved GFLOP/s (FLOPs counted analytically by `newton_schulz_flops`) next to a plain
2048×2048 float32 matmul's GFLOP/s measured in the same run. Optimizers that are not importable
are skipped with a printed note. SOAP and Sophia refresh their preconditioner every 10 steps:
the median reports the common (non-refresh) step.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
import optax.contrib
from optax.contrib import _muon as optax_muon

from experiments.bench.measure import bench_matmul, median_seconds
from fedorth.optim.newton_schulz import NS_PRESETS, newton_schulz, newton_schulz_flops

DEFAULT_SHAPES = "256x256,1024x1024,768x3072,3x3x64x64"
LEARNING_RATE = 1e-3


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """ "256x256,3x3x64x64" -> [(256, 256), (3, 3, 64, 64)]; each shape needs rank >= 2."""
    shapes = []
    for item in text.split(","):
        shape = tuple(int(d) for d in item.strip().lower().split("x"))
        if len(shape) < 2 or min(shape) < 1:
            raise ValueError(f"shape {item!r} must be like 256x256 (rank >= 2, positive dims)")
        shapes.append(shape)
    return shapes


def _quadratic(params):
    return 0.5 * sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))


def _optax_muon(shape):
    # optax.contrib.muon sends non-2-D leaves to Adam unless told how to view them: give conv
    # kernels the same (kh·kw·in, out) view fedorth uses.
    if len(shape) == 2:
        return optax.contrib.muon(LEARNING_RATE)
    dims = optax.contrib.MuonDimensionNumbers(tuple(range(len(shape) - 1)), len(shape) - 1)
    return optax.contrib.muon(LEARNING_RATE, muon_weight_dimension_numbers={"w": dims})


def _fedorth(name: str):
    def make(shape):
        del shape
        module = importlib.import_module(f"fedorth.optim.{name}")
        return getattr(module, name)(LEARNING_RATE)

    return make


# name -> (factory(shape) -> transform, extra keyword arguments of update)
OPTIMIZERS: dict[str, tuple[Callable, dict]] = {
    "fedorth.muon": (_fedorth("muon"), {}),
    "fedorth.soap": (_fedorth("soap"), {}),
    "fedorth.sophia": (_fedorth("sophia"), {"obj_fn": _quadratic}),
    "optax.contrib.muon": (_optax_muon, {}),
    "optax.contrib.sophia": (lambda s: optax.contrib.sophia(LEARNING_RATE), {"obj_fn": _quadratic}),
    "optax.adamw": (lambda s: optax.adamw(LEARNING_RATE), {}),
}


def time_update(make, extra, shape, *, repeats, warmup) -> float:
    """Median seconds of one jitted `update` (+ apply) on a single leaf of `shape`."""
    key_p, key_g = jax.random.split(jax.random.key(0))
    params = {"w": jax.random.normal(key_p, shape)}
    grads = {"w": jax.random.normal(key_g, shape)}
    tx = make(shape)

    # The gradients are an argument, not a closed-over constant: XLA would constant-fold work
    # on them at compile time (minutes for SOAP's GGᵀ at 1024²) and time less than an update.
    @jax.jit
    def step(grads, state, params):
        updates, state = tx.update(grads, state, params, **extra)
        return state, optax.apply_updates(params, updates)

    carry = [tx.init(params), params]

    def call():
        carry[0], carry[1] = step(grads, carry[0], carry[1])
        return carry[1]

    return median_seconds(call, repeats=repeats, warmup=warmup)


def _matrix(shape):
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


def bench_newton_schulz(shape, *, steps, repeats, warmup) -> dict:
    """fedorth vs optax.contrib NS on the (prod(shape[:-1]), shape[-1]) matrix of `shape`."""
    x = jax.random.normal(jax.random.key(1), _matrix(shape))
    coeffs = NS_PRESETS["jordan"][0]
    ours = jax.jit(lambda x: newton_schulz(x, steps, "jordan", eps=1e-8))
    theirs = jax.jit(
        lambda x: optax_muon.orthogonalize_via_newton_schulz(
            x, jnp.asarray(coeffs), steps, eps=1e-8
        )
    )
    t_ours = median_seconds(lambda: ours(x), repeats=repeats, warmup=warmup)
    t_theirs = median_seconds(lambda: theirs(x), repeats=repeats, warmup=warmup)
    flops = newton_schulz_flops(x.shape, steps)
    return {
        "matrix": list(x.shape),
        "fedorth_ms": 1e3 * t_ours,
        "optax_ms": 1e3 * t_theirs,
        "fedorth_gflops": flops / t_ours / 1e9,
        "ratio_fedorth_over_optax": t_ours / t_theirs,
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``python -m experiments.bench optim``; ``optimizers`` and ``shapes`` parsed
    into a list of names and a list of shapes."""
    parser = argparse.ArgumentParser(prog="python -m experiments.bench optim")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated, e.g. 256x256")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls (compile + warm)")
    parser.add_argument("--ns-steps", type=int, default=5, help="Newton–Schulz steps")
    parser.add_argument(
        "--optimizers",
        default=",".join(OPTIMIZERS),
        help=f"comma-separated subset of {','.join(OPTIMIZERS)} (empty: Newton–Schulz only)",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    args.optimizers = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = sorted(set(args.optimizers) - set(OPTIMIZERS))
    if unknown:
        parser.error(f"unknown --optimizers {unknown}; valid: {list(OPTIMIZERS)}")
    args.shapes = parse_shapes(args.shapes)
    return args


def main(argv: list[str]) -> int:
    """Entry point of ``python -m experiments.bench optim``."""
    args = parse_args(argv)
    chosen, shapes = args.optimizers, args.shapes
    timing = dict(repeats=args.repeats, warmup=args.warmup)
    device = jax.devices()[0]
    versions = f"jax {jax.__version__}, optax {optax.__version__}"
    print(f"# {device.platform}: {device.device_kind}; {versions}")
    print(f"# median of {args.repeats} after {args.warmup} warm-up calls; times in ms per update")

    available, skipped = {}, {}
    for name in chosen:
        make, extra = OPTIMIZERS[name]
        try:
            make((4, 4))
            available[name] = (make, extra)
        except Exception as err:  # noqa: BLE001 (report any import/construction failure)
            skipped[name] = f"{type(err).__name__}: {err}"
    for name, why in skipped.items():
        print(f"# skipped {name}: {why}")

    names = list(available)
    width = max([14, *(len(n) + 2 for n in names)])
    if names:
        print("shape".ljust(16) + "".join(n.rjust(width) for n in names))
    update_ms: dict[str, dict[str, float]] = {}
    for shape in shapes if names else ():
        label = "x".join(map(str, shape))
        update_ms[label] = {}
        for name, (make, extra) in available.items():
            update_ms[label][name] = 1e3 * time_update(make, extra, shape, **timing)
        print(
            label.ljust(16) + "".join(f"{update_ms[label][n]:{width}.3f}" for n in names),
            flush=True,
        )

    # The reference matmul is measured before and after the NS table (shared machines drift);
    # the printed "% matmul" uses the first, the JSON's fraction_of_matmul the faster one.
    matmul_before = bench_matmul(**timing)
    print(f"\nplain 2048x2048 float32 matmul (HIGHEST): {matmul_before:.1f} GFLOP/s", flush=True)
    print(f"Newton–Schulz, {args.ns_steps} steps, jordan coefficients, float32:")
    header = ["shape", "matrix", "fedorth ms", "GFLOP/s", "% matmul", "optax ms", "fedorth/optax"]
    print("".join(h.rjust(14) for h in header))
    ns_results = {}
    for shape in shapes:
        label = "x".join(map(str, shape))
        r = bench_newton_schulz(shape, steps=args.ns_steps, **timing)
        ns_results[label] = r
        row = [
            label,
            "x".join(map(str, r["matrix"])),
            f"{r['fedorth_ms']:.3f}",
            f"{r['fedorth_gflops']:.1f}",
            f"{100 * r['fedorth_gflops'] / matmul_before:.0f}%",
            f"{r['optax_ms']:.3f}",
            f"{r['ratio_fedorth_over_optax']:.2f}",
        ]
        print("".join(c.rjust(14) for c in row), flush=True)

    matmul_after = bench_matmul(**timing)
    matmul_gflops = max(matmul_before, matmul_after)
    print(f"plain 2048x2048 matmul again, after the NS table: {matmul_after:.1f} GFLOP/s")
    for r in ns_results.values():
        r["fraction_of_matmul"] = r["fedorth_gflops"] / matmul_gflops

    if args.json:
        result = {
            "device": f"{device.platform}: {device.device_kind}",
            "jax": jax.__version__,
            "optax": optax.__version__,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "update_ms": update_ms,
            "skipped": skipped,
            "matmul_2048_gflops": [matmul_before, matmul_after],
            "newton_schulz": ns_results,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0
