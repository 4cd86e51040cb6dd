"""Golden rounds: every registered algorithm, checked against recorded results on every CPU.

For each case of :data:`CASES` (every name of ``fed.ALGORITHMS``, plus a few options that take
another engine path), three rounds on a tiny problem under the strategies below; every part of
the final server state (parameters, model state, optimizer state, ``g_G``, control variates,
server optimizer state, the clients' kept state, ``extra``) and the last round's metrics are
compared with ``tests/fixtures/fed_golden.json`` in two ways:

* **bytes, where the fixture was recorded on the same platform** (:func:`platform`): the
  SHA-256 of each part's bytes must be equal, a tolerance of zero. The engine's code can then
  move (modules, per-axis specs) only if every algorithm computes exactly what it computed
  before. A platform is what decides the bits of a float32 program on XLA:CPU: the jaxlib
  version, the CPU (XLA compiles for the host's vector ISA: the same program rounds
  differently with 512-bit and 256-bit vectors, e.g. FedAvg's three rounds differ in their last
  bits between an AVX-512 and an AVX2 machine) and the ``--xla_cpu_*`` flags; for the cases whose
  rounds call LAPACK (:func:`calls_lapack`), also the BLAS kernels OpenBLAS picked
  (``OPENBLAS_CORETYPE`` changes them: its float32 ``eigh``/``qr``/SVD then differ in their last
  bits, and the rounds after them too). So the bytes of the cases that run XLA alone depend on
  no BLAS kernel, and the bytes of the LAPACK cases are only ever compared on the kernels that
  made them.
* **values, everywhere**: the vmap round's every leaf is compared with the recorded values at
  :data:`RTOL`/:data:`ATOL`, the spread measured between platforms (their comment says how), for
  every case, so a machine on which no bytes were recorded still checks every algorithm's
  arithmetic to float32 rounding. Integer leaves (counts, keys) must be equal.

Which strategies. An algorithm's own code (local steps, upload, server update) is compiled in
two ways: vmapped over clients (``vmap``; ``chunked`` vmaps chunks of two) and one client at a
time (``sequential``; ``sharded`` over the fake CPU devices of tests/conftest.py runs each
device's clients sequentially). The two trace the same Python code of the algorithm; what
differs is the engine's generic code around it: the vmap or scan over clients, the scan over
chunks and the all-reduce of the clients' summaries (``fed.execution``, ``fed.reduce``).
So every case runs under ``vmap`` (an accelerator's usual strategy), and :data:`EVERY_STRATEGY`,
cases that together take every value of every axis of the algorithm record (how clients
start, corrections, server quantities, reports, the server rule, full participation, minimax,
the local optimizer; :func:`engine_paths`), runs under all four strategies; a test checks that
every value met in :data:`CASES` is covered. Every algorithm's ``sequential`` round (the CPU's
default) is also what the papers' float64 box tests run (tests/test_baselines.py,
test_fed_algorithms.py, test_fedpac.py, test_minimax.py, ...). ``FEDORTH_GOLDEN_ALL=1`` runs
every case under all four strategies (about twice the CPU; before an engine
refactoring), and recording always does, so the strategies' agreement (below) holds for every
case whenever its fingerprints are recorded.

If this test fails:

* after a refactoring that should not change any result: the refactoring changed the maths or
  the order of floating-point operations; find the part named in the message and fix the code.
  Bytes are compared only on a recorded platform: before a refactoring on another machine, add
  your platform's bytes first (``FEDORTH_RECORD_GOLDEN=platform``, below);
* after a deliberate change of an algorithm's behaviour (a fidelity fix): re-record with
  ``FEDORTH_RECORD_GOLDEN=1 python -m pytest -q -n 0 tests/test_fed_golden.py`` (values and
  this platform's bytes; other platforms' bytes are dropped) and say in the commit which cases
  changed and why;
* ``FEDORTH_RECORD_GOLDEN=platform`` adds this platform's bytes to the fixture, after the values
  check passed (a machine whose results are not within the measured spread is not recorded);
* after a JAX upgrade: check first that the strategies still agree (the assertion before the
  golden one, a tolerance of float32 rounding) and the values, then re-record as above.

The cases run on the CPU backend with the 8 fake devices only (``cpu_devices``).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform as platform_lib
import re
import subprocess
import sys

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedorth import fed

GOLDEN = pathlib.Path(__file__).parent / "fixtures" / "fed_golden.json"
STRATEGIES = ("vmap", "chunked", "sequential", "sharded")
ROUNDS, LOCAL_STEPS = 3, 2
NUM_CLIENTS, CLIENTS_PER_ROUND, CHUNK_SIZE = 6, 4, 2

SGD = {"name": "sgd"}
# case -> (registry name, optim config, fed options); the generic algorithms get the local
# optimizer their paper pairs them with, and a few extra cases cover other engine paths.
CASES: dict[str, tuple[str, dict, dict]] = {
    "adam_biclip": ("adam_biclip", SGD, {}),
    "f_sagda": ("f_sagda", SGD, {}),
    "fafed": ("fafed", SGD, {}),
    "fed_nsgda_m": ("fed_nsgda_m", SGD, {}),
    "fed_sophia": ("fed_sophia", {"name": "sophia"}, {}),
    "fedadam": ("fedadam", SGD, {}),
    "fedavg": ("fedavg", SGD, {}),
    "fedavg_m": ("fedavg_m", SGD, {}),
    "fedavg_vr": ("fedavg_vr", SGD, {}),
    "fedavgm": ("fedavgm", SGD, {}),
    "fedcm": ("fedcm", SGD, {}),
    "feddyn": ("feddyn", SGD, {"alpha": 0.1}),
    "fednova": ("fednova", {"name": "sgd", "momentum": 0.5}, {"min_local_steps": 1}),
    "fedadamw": ("fedadamw", {"name": "adamw"}, {}),
    "fedlada": ("fedlada", {"name": "adamw"}, {}),
    "fedmuon": ("fedmuon", {"name": "muon"}, {}),
    "fedmuon_bc": ("fedmuon_bc", {"name": "lmo", "ns_steps": 5}, {}),
    "fedmuon_da": ("fedmuon_da", {"name": "muon"}, {}),
    "fedmuon_svd": ("fedmuon_svd", {"name": "muon"}, {}),
    "fedmuon_zg": ("fedmuon_zg", {"name": "muon"}, {}),
    "fedpac": ("fedpac", {"name": "adamw"}, {"beta": 0.3}),
    "fedpac_muon": ("fedpac_muon", {"name": "muon"}, {}),
    "fedpac_muon_light": ("fedpac_muon_light", {"name": "muon"}, {}),
    "fedpac_soap": ("fedpac_soap", {"name": "soap"}, {}),
    "fedpac_soap_light": ("fedpac_soap_light", {"name": "soap"}, {}),
    "fedpac_sophia": ("fedpac_sophia", {"name": "sophia"}, {}),
    "fedpac_sophia_light": ("fedpac_sophia_light", {"name": "sophia"}, {}),
    "fedpm": ("fedpm", {"name": "sophia"}, {}),
    "fedprox": ("fedprox", SGD, {"mu": 0.1}),
    "fedsgda_clip": ("fedsgda_clip", SGD, {}),
    "fedsgda_m": ("fedsgda_m", SGD, {}),
    "fess_gda": ("fess_gda", SGD, {}),
    "local_adamw": ("local_adamw", {"name": "adamw"}, {}),
    "local_lmo": ("local_lmo", {"name": "lmo"}, {}),
    "local_muon": ("local_muon", {"name": "muon"}, {}),
    "local_sgd": ("local_sgd", SGD, {}),
    "local_sgda": ("local_sgda", SGD, {}),
    "local_sgdam": ("local_sgdam", SGD, {}),
    "local_soap": ("local_soap", {"name": "soap"}, {}),
    "local_sophia": ("local_sophia", {"name": "sophia"}, {}),
    "padamfed": ("padamfed", SGD, {}),
    "padamfed_vr": ("padamfed_vr", SGD, {}),
    "scaffold": ("scaffold", SGD, {}),
    "scaffold_m": ("scaffold_m", SGD, {}),
    "scaffold_vr": ("scaffold_vr", SGD, {}),
    # Whole-state FedPAC with the global server step (x <- x - gamma g_G), a path no default
    # options take.
    "fedpac[state,server_lr]": ("fedpac", {"name": "muon"}, {"aligned": "state", "server_lr": 0.5}),
}


# Cases run under all four strategies (the others under "vmap"): together they take every value of
# engine_paths(case) met in CASES (test_every_engine_path_runs_under_every_strategy). SCAFFOLD,
# FedMuon-LMO and FedPAC are also tests/test_fed_engine.py's strategy cases (same programs);
# of the minimax cases with a control variate, server quantities and reports, Fed-NSGDA-M
# compiles fastest (FedMuon-DA takes the same paths, with Muon, which other cases cover).
EVERY_STRATEGY = (
    "scaffold",
    "fedmuon_bc",
    "fedpac",
    "fed_nsgda_m",
    "fedpm",
    "fafed",
    "fedpac_soap_light",
    "f_sagda",
    "fedmuon_zg",
    "fedpac[state,server_lr]",
    "feddyn",
)


def _algorithm(case: str):
    name, optim, options = CASES[case]
    return fed.get_algorithm(name, {**optim, "learning_rate": 0.05}, **options)


def engine_paths(case: str) -> set[str]:
    """The values of the algorithm record's axes that a case's round takes: how clients start
    (and which of the start's masks, kept leaves and compression are set), the corrections
    (global direction, control variate, prepass), server quantities, client reports, the server
    rule and combine step, full participation, minimax, and the local optimizer."""
    name, optim, _ = CASES[case]
    alg = _algorithm(case)
    paths = {
        f"start={type(alg.start).__name__}",
        f"rule={type(alg.server.rule).__name__}",
        f"optimizer={optim['name']}",
    }
    paths |= {
        f"start.{attr}"
        for attr in ("mask", "keep", "compression")
        if getattr(alg.start, attr, None) is not None
    }
    corrections = alg.corrections
    if corrections.global_direction:
        paths.add("global_direction")
    if corrections.control is not None:
        paths.add(f"control={type(corrections.control).__name__}")
    if corrections.prepass is not None:
        paths.add(f"prepass(per_client={corrections.prepass.per_client})")
    if alg.quantities is not None:
        paths.add("quantities")
    if alg.report is not None:
        paths.add(f"report(floats={bool(alg.report.floats)})")
    if alg.server.combine is not None:
        paths.add("combine")
    if alg.full_participation_only:
        paths.add("full_participation")
    if _minimax(name):
        paths.add("minimax")
    return paths


def strategies(case: str) -> tuple[str, ...]:
    """The strategies a case runs under (module docstring)."""
    if (
        case in EVERY_STRATEGY
        or os.environ.get("FEDORTH_GOLDEN_ALL") == "1"
        or os.environ.get("FEDORTH_RECORD_GOLDEN") == "1"
    ):
        return STRATEGIES
    return ("vmap",)


def test_every_engine_path_runs_under_every_strategy():
    every = set().union(*(engine_paths(case) for case in CASES))
    covered = set().union(*(engine_paths(case) for case in EVERY_STRATEGY))
    assert every - covered == set(), (
        f"no case of EVERY_STRATEGY takes {sorted(every - covered)}: add one that does, so that "
        "sequential, chunked and sharded rounds run it (module docstring)"
    )
    assert len(every) >= 26, sorted(every)  # what the cases took when this test was written


def test_every_registered_algorithm_has_a_case():
    assert {name for name, _, _ in CASES.values()} == set(fed.ALGORITHMS), (
        "a new algorithm needs a golden case: add it to CASES and re-record (module docstring)"
    )


def _minimax(name: str) -> bool:
    return "minimax" in fed.ALGORITHMS[name].__module__


def _problem(minimax: bool):
    """Parameters, model state and a noisy quadratic loss; with a dual matrix for minimax."""
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    if minimax:
        params["dual"] = jnp.zeros((4, 2))

    def loss_fn(params, model_state, batch, key):
        loss, _ = fp.noisy_loss_fn(params, model_state, batch, key)  # a term read off the key
        if "dual" in params:  # f(x, y) = f(x) + <y, W[:, :2]> - 1/2 ||y||^2, concave in y
            y = params["dual"]
            loss = loss + jnp.sum(y * params["w"][:, :2]) - 0.5 * jnp.sum(y**2)
        # A float model state the server averages (like BatchNorm statistics).
        new_state = {"ema": 0.9 * model_state["ema"] + 0.1 * params["b"]}
        return loss, (new_state, {})

    return params, {"ema": jnp.zeros(3)}, loss_fn


def _run(case: str, strategy: str):
    """(server, metrics) after :data:`ROUNDS` rounds, and whether the round calls LAPACK."""
    name = CASES[case][0]
    alg = _algorithm(case)
    n = CLIENTS_PER_ROUND if alg.full_participation_only else NUM_CLIENTS
    params, model_state, loss_fn = _problem(_minimax(name))
    config = fed.RoundConfig(
        num_clients=n,
        clients_per_round=CLIENTS_PER_ROUND,
        local_steps=LOCAL_STEPS,
        learning_rate=0.05,
        strategy=strategy,
        chunk_size=CHUNK_SIZE if strategy == "chunked" else None,
    )
    data = jax.tree.map(jnp.asarray, fp.quadratic_clients(n, seed=5))
    server = fed.init_server(alg, params, model_state, num_clients=n, key=jax.random.key(1))
    round_fn = fed.make_round_fn(alg, loss_fn, fp.batch_fn, config)
    # The call below reuses this lowering (jit's caches), so knowing costs no second trace.
    lapack = calls_lapack(round_fn.lower(server, data).as_text()) if strategy == "vmap" else None
    for _ in range(ROUNDS):
        server, metrics = round_fn(server, data)
    return server, metrics, lapack


def calls_lapack(program_text: str) -> bool:
    """Whether a lowered round calls LAPACK: on XLA:CPU ``fedorth.optim.linalg`` runs SciPy's
    LAPACK in a host callback, and ``jnp.linalg`` lowers to jaxlib's LAPACK custom calls (which
    call SciPy's OpenBLAS too). Either way its results depend on OpenBLAS's kernels."""
    targets = set(re.findall(r"custom_call @(\w+)", program_text))
    return any("callback" in target or "lapack" in target for target in targets)


def _parts(server, metrics) -> dict:
    return {
        "params": server.params,
        "model_state": server.model_state,
        "opt_state": server.opt_state,
        "global_direction": server.global_direction,
        "control": server.control,
        "server_opt_state": server.server_opt_state,
        "clients": server.clients,
        "extra": server.extra,
        "metrics": metrics,
    }


def _fingerprint(tree) -> str:
    """SHA-256 over each leaf's path, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}|{array.dtype}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _values(tree) -> dict:
    """Each leaf's dtype, shape and values (float32 values are exact as Python floats)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        array = np.asarray(leaf)
        out[jax.tree_util.keystr(path)] = {
            "dtype": str(array.dtype),
            "shape": list(array.shape),
            "values": array.ravel().tolist(),
        }
    return out


# The values check's tolerance between platforms: the strategies' agreement tolerance below (the
# same sums reassociated: SOAP's eigenbases move with their eigen-gaps, 1.3e-5 on entries of
# order 0.1 between fedpac_soap_light's chunked and vmap rounds). Other kernels reassociate the
# same way. Measured on this file's vmap rounds (python -m pytest ... in an environment with each
# setting, every case, every leaf, an AMD EPYC with AVX2): XLA compiled for SSE4.2 instead of
# AVX2 (XLA_FLAGS=--xla_cpu_max_isa=SSE4_2) moves every case, by at most 7.2e-6 (fedpac_soap_light's
# Q, an entry of 0.053; 3.1e-5 on a precond_drift of 189); OpenBLAS's Sandybridge or Prescott
# kernels instead of Haswell (OPENBLAS_CORETYPE) move the five LAPACK cases, by at most 4.4e-6
# (the same Q). The largest is 7% of |a - b| <= ATOL + RTOL |b|: a 14x margin.
RTOL, ATOL = 2e-5, 1e-4


@functools.cache
def _cpu() -> str:
    """The CPU as XLA:CPU compiles for it: vendor, family, model and its vector ISA."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        pass
    if not fields:
        return f"{platform_lib.machine()} {platform_lib.processor()}"
    isa = (
        "sse4_2 avx avx2 fma f16c avx512f avx512bw avx512dq avx512vl avx512_vnni avx512_bf16 "
        "avx512_fp16 avx_vnni amx_tile amx_bf16"
    ).split()
    flags = set(fields.get("flags", "").split())
    return (
        f"{platform_lib.machine()} {fields.get('vendor_id', '?')} family "
        f"{fields.get('cpu family', '?')} model {fields.get('model', '?')} "
        f"({' '.join(name for name in isa if name in flags)})"
    )


@functools.cache
def openblas_core() -> str | None:
    """The kernels OpenBLAS picked for this CPU (``OPENBLAS_CORETYPE`` overrides its choice), as
    SciPy's bundled OpenBLAS reports them; None where it cannot be asked."""
    import scipy

    folders = [os.path.dirname(scipy.__file__) + ".libs", os.path.dirname(scipy.__file__)]
    for path in sorted(p for folder in folders for p in glob.glob(f"{folder}/*openblas*.so*")):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in ("scipy_openblas_get_corename", "openblas_get_corename"):
            function = getattr(library, symbol, None)
            if function is not None:
                function.restype = ctypes.c_char_p
                return function().decode()
    return None


def platform(lapack: bool) -> str | None:
    """What decides the bytes of a case's rounds (module docstring); None where the BLAS
    kernels of a LAPACK case cannot be told (its bytes are then never compared)."""
    xla_flags = sorted(
        flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag.startswith("--xla_cpu")
    )
    parts = [
        f"jaxlib {importlib.metadata.version('jaxlib')}",
        _cpu(),
        f"XLA_FLAGS {' '.join(xla_flags) or '-'}",
    ]
    if lapack:
        core = openblas_core()
        if core is None:
            return None
        parts.append(f"OpenBLAS {core}")
        threads = os.environ.get("FEDORTH_LAPACK_THREADS", "auto")
        if threads != "1":  # tests/conftest.py's value, the one recorded so far
            parts.append(f"LAPACK threads {threads}")
    return " | ".join(parts)


def _record(case: str, values: dict, fingerprints: dict, where: str, mode: str) -> None:
    """Writes a case's values and this platform's bytes (``mode == "1"``: the values and this
    platform alone), or adds this platform's bytes (``mode == "platform"``)."""
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if mode == "platform" and case in golden:
        golden[case]["bytes"][where] = fingerprints
    else:
        golden[case] = {"values": values, "bytes": {where: fingerprints}}
    GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")


def _compare_values(case: str, got: dict, want: dict) -> list[str]:
    """The leaves of the vmap round that differ from the recorded values (module docstring)."""
    problems = []
    for part in want:
        for path, leaf in want[part].items():
            mine = got[part].get(path)
            name = f"{part}{path}"
            if mine is None or (mine["dtype"], mine["shape"]) != (leaf["dtype"], leaf["shape"]):
                problems.append(
                    f"{name}: {mine and (mine['dtype'], mine['shape'])} recorded as "
                    f"{(leaf['dtype'], leaf['shape'])}"
                )
                continue
            a, b = np.asarray(mine["values"]), np.asarray(leaf["values"])
            if np.issubdtype(np.dtype(leaf["dtype"]), np.floating):
                bad = ~(np.abs(a - b) <= ATOL + RTOL * np.abs(b))
            else:
                bad = a != b
            if bad.any():
                worst = int(np.argmax(np.abs(a - b)))
                problems.append(f"{name}[{worst}]: {a[worst]!r} recorded as {b[worst]!r}")
        extra = set(got[part]) - set(want[part])
        problems += [f"{part}{path}: not recorded" for path in sorted(extra)]
    return problems


@pytest.mark.cpu_devices
@pytest.mark.parametrize("case", sorted(CASES))
def test_rounds_match_the_golden_fingerprints(case):
    check_case(case)


def check_case(case: str) -> dict:
    """The golden test of one case; returns the platform, whether bytes were compared, and the
    vmap round's fingerprints."""
    runs = {strategy: _run(case, strategy) for strategy in strategies(case)}
    lapack = runs["vmap"][2]
    got = {
        strategy: {part: _fingerprint(tree) for part, tree in _parts(*run[:2]).items()}
        for strategy, run in runs.items()
    }
    values = {part: _values(tree) for part, tree in _parts(*runs["vmap"][:2]).items()}
    for strategy, run in runs.items():  # equal bytes could be NaNs recorded as they came
        for path, leaf in jax.tree_util.tree_leaves_with_path(_parts(*run[:2])):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert np.isfinite(leaf).all(), f"{case} {strategy}: {jax.tree_util.keystr(path)}"
    # The strategies agree up to float reassociation (a check that needs no golden file). atol:
    # SOAP's eigenbases move with their eigen-gaps (1.3e-5 on entries of order 0.1 between
    # fedpac_soap_light's chunked and vmap rounds here); the golden bytes are the exact check.
    reference = jax.tree.leaves(_parts(*runs["vmap"][:2]))
    for strategy in list(runs)[1:]:
        other = jax.tree.leaves(_parts(*runs[strategy][:2]))
        assert len(other) == len(reference), strategy
        for a, b in zip(reference, other, strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=strategy)
            else:
                np.testing.assert_array_equal(a, b, err_msg=strategy)
    where = platform(lapack)
    mode = os.environ.get("FEDORTH_RECORD_GOLDEN")
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if mode == "1":
        assert where is not None, "OpenBLAS's kernels cannot be told here: record elsewhere"
        _record(case, values, got, where, mode)
        golden = json.loads(GOLDEN.read_text())
    assert case in golden, f"no golden for {case!r}: record it (module docstring)"
    # The recorded record says whether the case called LAPACK: a case that starts or stops
    # calling it changes which platforms its bytes belong to, so it must be re-recorded.
    recorded_platforms = list(golden[case]["bytes"])
    assert all(("| OpenBLAS " in p) == lapack for p in recorded_platforms), (
        f"{case}: its round {'calls' if lapack else 'no longer calls'} LAPACK, unlike when it was "
        "recorded: re-record it (module docstring)"
    )
    wrong = _compare_values(case, values, golden[case]["values"])
    assert not wrong, (
        f"{case}: the vmap round's {wrong[:5]} differ from tests/fixtures/fed_golden.json by more "
        f"than float32 rounding between platforms (rtol {RTOL}, atol {ATOL}); a refactoring "
        "must leave them equal, a deliberate behaviour change re-records them (module docstring)"
    )
    if mode == "platform" and where is not None:
        _record(case, values, got, where, mode)
        golden = json.loads(GOLDEN.read_text())
    recorded = golden[case]["bytes"].get(where)
    outcome = {"platform": where, "bytes_compared": recorded is not None, "vmap": got["vmap"]}
    if recorded is None:
        return outcome  # no bytes of this platform: the values above are the check
    changed = [
        f"{strategy}.{part}"
        for strategy in runs
        for part in got[strategy]
        if strategy in recorded and got[strategy][part] != recorded[strategy][part]
    ]
    assert not changed, (
        f"{case}: the bytes of {changed} differ from tests/fixtures/fed_golden.json's, recorded on "
        f"this platform ({where}); a refactoring must leave them equal, a deliberate behaviour "
        "change re-records them (module docstring)"
    )
    return outcome


# What another machine computes, simulated here: XLA compiled for SSE4.2 (every case's bytes move)
# and OpenBLAS's generic Prescott kernels (the LAPACK cases' bytes move), in a fresh process.
_ELSEWHERE = {"OPENBLAS_CORETYPE": "Prescott", "XLA_CPU_MAX_ISA": "SSE4_2"}


@pytest.mark.cpu_devices
@pytest.mark.skipif(
    platform_lib.machine() not in ("x86_64", "AMD64"),
    reason="simulates another x86-64 CPU (an x86 vector ISA, OpenBLAS's x86 kernels)",
)
def test_the_golden_cases_pass_on_other_kernels():
    """On a platform whose bytes the fixture does not hold (other vector ISA, other BLAS
    kernels), the rounds' bytes differ and the values check passes: the fixture holds no
    byte that a machine must reproduce. One XLA-only case and one LAPACK case."""
    cases = ["fedavg", "local_soap"]
    env = dict(os.environ, OPENBLAS_CORETYPE=_ELSEWHERE["OPENBLAS_CORETYPE"])
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_cpu_max_isa={_ELSEWHERE['XLA_CPU_MAX_ISA']}"
    ).strip()
    env.pop("FEDORTH_RECORD_GOLDEN", None)
    script = (
        "import json, sys; import test_fed_golden as g; "
        "print(json.dumps({c: g.check_case(c) for c in sys.argv[1:]}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *cases],
        cwd=pathlib.Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    golden = json.loads(GOLDEN.read_text())
    for case in cases:
        outcome = outcomes[case]
        assert not outcome["bytes_compared"], (case, outcome["platform"])
        # The LAPACK case's platform names the kernels OpenBLAS ran (Prescott's report as
        # "Katmai" in SciPy's OpenBLAS 0.3.30), the XLA-only case's names none.
        assert ("| OpenBLAS " in outcome["platform"]) == (case == "local_soap"), outcome
        recorded = [bytes_["vmap"] for bytes_ in golden[case]["bytes"].values()]
        assert all(outcome["vmap"]["params"] != r["params"] for r in recorded), (
            f"{case}: the simulated platform computed a recorded platform's bytes, so this test "
            "shows nothing: pick settings that change them"
        )
