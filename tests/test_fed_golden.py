"""Golden rounds: every registered algorithm, bit for bit, under the strategies that compile it.

For each case of :data:`CASES` (every name of ``fed.ALGORITHMS``, plus a few options that take
another engine path), three rounds on a tiny problem under the strategies below; the
SHA-256 of the bytes of each part of the final server state (parameters, model state, optimizer
state, ``g_G``, control variates, server optimizer state, the clients' kept state, ``extra``) and
of the last round's metrics must equal ``tests/fixtures/fed_golden.json``: a tolerance of zero.
The engine's code can then move (modules, per-axis specs) only if every algorithm computes
exactly what it computed before.

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
  the order of floating-point operations; find the part named in the message and fix the code;
* after a deliberate change of an algorithm's behaviour (a fidelity fix): re-record with
  ``FEDORTH_RECORD_GOLDEN=1 python -m pytest -q -n 0 tests/test_fed_golden.py`` and say in
  the commit which cases changed and why;
* after a JAX upgrade or on another CPU (XLA may order a reduction differently): check first
  that the strategies still agree (the assertion before the golden one, a tolerance of float32
  rounding), then re-record as above.

The cases run on the CPU backend with the 8 fake devices only (``cpu_devices``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

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
    for _ in range(ROUNDS):
        server, metrics = round_fn(server, data)
    return server, metrics


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


def _record(case: str, results: dict) -> None:
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    golden[case] = results
    GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")


@pytest.mark.cpu_devices
@pytest.mark.parametrize("case", sorted(CASES))
def test_rounds_match_the_golden_fingerprints(case):
    runs = {strategy: _run(case, strategy) for strategy in strategies(case)}
    got = {
        strategy: {part: _fingerprint(tree) for part, tree in _parts(*run).items()}
        for strategy, run in runs.items()
    }
    if os.environ.get("FEDORTH_RECORD_GOLDEN") == "1":
        _record(case, got)
    for strategy, run in runs.items():  # equal bytes could be NaNs recorded as they came
        for path, leaf in jax.tree_util.tree_leaves_with_path(_parts(*run)):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert np.isfinite(leaf).all(), f"{case} {strategy}: {jax.tree_util.keystr(path)}"
    # The strategies agree up to float reassociation (a check that needs no golden file). atol:
    # SOAP's eigenbases move with their eigen-gaps (1.3e-5 on entries of order 0.1 between
    # fedpac_soap_light's chunked and vmap rounds here); the golden bytes are the exact check.
    reference = jax.tree.leaves(_parts(*runs["vmap"]))
    for strategy in list(runs)[1:]:
        other = jax.tree.leaves(_parts(*runs[strategy]))
        assert len(other) == len(reference), strategy
        for a, b in zip(reference, other, strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-4, err_msg=strategy)
            else:
                np.testing.assert_array_equal(a, b, err_msg=strategy)
    golden = json.loads(GOLDEN.read_text())
    assert case in golden, f"no golden for {case!r}: record it (module docstring)"
    changed = [
        f"{strategy}.{part}"
        for strategy in runs
        for part in got[strategy]
        if got[strategy][part] != golden[case][strategy][part]
    ]
    assert not changed, (
        f"{case}: the bytes of {changed} differ from tests/fixtures/fed_golden.json; a refactoring "
        "must leave them equal, a deliberate behaviour change re-records them (module docstring)"
    )
