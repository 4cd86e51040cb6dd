"""The round engine: strategies agree, one compilation, metrics and errors."""

import dataclasses
import functools

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_fed_golden as golden
from jax.sharding import Mesh

from fedorth import fed, models
from fedorth.fed import metrics as fed_metrics


def _server_after(
    alg, strategy, *, rounds=3, n=8, s=8, k=3, chunk_size=None, data=None, spectral_drift=False
):
    server, history = fp.run_rounds(
        alg,
        data if data is not None else fp.quadratic_clients(n, seed=5),
        rounds=rounds,
        num_clients=n,
        clients_per_round=s,
        local_steps=k,
        learning_rate=0.05,
        strategy=strategy,
        chunk_size=chunk_size,
        key=1,
        loss_fn=fp.noisy_loss_fn,
        spectral_drift=spectral_drift,
    )
    return server, history[-1]


# Cases of tests/test_fed_golden.py whose clients take other engine paths: SCAFFOLD's control
# variates, clients that keep their own state (FedMuon-LMO), FedPAC over AdamW (precond_drift).
STRATEGY_CASES = ("scaffold", "fedmuon_bc", "fedpac")


def golden_round(alg, strategy, chunk_size=None, timer=None):
    """(round_fn, server, data) of `alg` on the golden test's problem with its settings
    (tests/test_fed_golden.py ``_run``): S = 4 of N = 6 clients, K = 2, lr 0.05, server key 1.
    The golden cases' rounds are then the golden test's own programs, compiled once for both
    tests (the suite's persistent compilation cache keys on the program). `timer`: the clock
    of a measured strategy."""
    params, model_state, loss_fn = golden._problem(minimax=False)
    n = golden.NUM_CLIENTS
    server, round_fn, _ = fp.start_rounds(
        alg,
        num_clients=n,
        clients_per_round=golden.CLIENTS_PER_ROUND,
        local_steps=golden.LOCAL_STEPS,
        learning_rate=0.05,
        params=params,
        model_state=model_state,
        strategy=strategy,
        chunk_size=chunk_size,
        key=1,
        loss_fn=loss_fn,
        timer=timer,
    )
    return round_fn, server, jax.tree.map(jnp.asarray, fp.quadratic_clients(n, seed=5))


def _golden_rounds(alg, strategy, chunk_size=None):
    """(server, metrics) after the golden test's three rounds (`golden_round`)."""
    round_fn, server, data = golden_round(alg, strategy, chunk_size)
    for _ in range(golden.ROUNDS):
        server, metrics = round_fn(server, data)
    return server, metrics


@pytest.mark.cpu_devices
@pytest.mark.parametrize("case", STRATEGY_CASES)
def test_strategies_give_the_same_server_state(case):
    """A remainder chunk (S = 4 in chunks of 3: a scanned chunk of 3, then a vmapped one of 1),
    and "sharded" over the 4 of the 8 fake CPU devices that divide S, one client each, whose
    summaries are combined by all-reduces (fed.reduce.psum), agree with vmap to float32
    rounding: parameters, the clients' kept state and every metric (client_drift,
    client_cosine, train_loss, precond_drift for FedPAC over AdamW).

    tests/test_fed_golden.py runs every registered algorithm under vmap, and cases covering
    every engine path under all four strategies (chunks of 2, no remainder), on this problem,
    and checks that they agree (atol 1e-4) and equal recorded bytes;
    test_streamed_client_summaries_equal_the_whole_stack checks the per-client (sequential) and
    per-chunk merges of the metrics' summaries against float64 NumPy in any grouping;
    test_auto_strategy_shards_clients_over_the_devices_that_divide_s the mesh of other S (6 of
    the 8 devices for S = 6)."""
    assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices"
    alg = golden._algorithm(case)
    ref, ref_metrics = _golden_rounds(alg, "vmap")
    assert set(ref_metrics) >= {"client_drift", "client_cosine", "train_loss"}
    if case == "fedpac":
        assert "precond_drift" in ref_metrics
    for strategy, chunk in [("chunked", 3), ("sharded", None)]:
        other, metrics = _golden_rounds(alg, strategy, chunk)
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(other), strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=strategy)
        assert set(metrics) == set(ref_metrics), strategy
        for key in ref_metrics:
            np.testing.assert_allclose(
                metrics[key],
                ref_metrics[key],
                rtol=2e-5,
                atol=1e-7 if strategy == "sharded" else 0,  # all-reduced: summed in another order
                err_msg=f"{strategy} {key}",
            )


@pytest.mark.cpu_devices
def test_auto_strategy_shards_clients_over_the_devices_that_divide_s():
    """On CPU, ``auto`` = ``sharded`` for convolutional models over the largest device count
    dividing S (8 fake devices here); else the one-device strategy (``sequential`` on CPU)."""
    for s, devices in [(8, 8), (6, 6), (12, 6), (9, 3), (7, 7), (16, 8)]:
        config = fed.RoundConfig(
            num_clients=16, clients_per_round=s, local_steps=1, learning_rate=1
        )
        assert fed.resolve_strategy("auto", s, convolutional=True) == "sharded", s
        assert fed.resolve_strategy("auto", s) == "sequential", "dense models: one device"
        assert fed.client_mesh(config).shape == {"clients": devices}, s
    assert fed.resolve_strategy("auto", 1, convolutional=True) == "sequential"
    assert fed.resolve_strategy("auto", convolutional=True) == "sequential", "S unknown"
    assert fed.resolve_strategy("vmap", 8) == "vmap"
    config = fed.RoundConfig(num_clients=16, clients_per_round=8, local_steps=1, learning_rate=1)
    alg = fed.get_algorithm("fedavg", {"name": "sgd"})
    round_fn = fed.make_round_fn(alg, fp.loss_fn, fp.batch_fn, config)
    assert round_fn.strategy == "sequential", "a plain loss function: not known convolutional"
    conv = models.get_model("cnn", num_classes=3)
    assert conv.convolutional and not models.get_model("mlp", num_classes=3).convolutional
    round_fn = fed.make_round_fn(alg, conv.loss_fn, fp.batch_fn, config)
    assert round_fn.strategy == "sharded" and round_fn.config.strategy == "sharded"
    tree = {"x": jnp.ones(3)}
    placed = round_fn.place(tree)["x"]
    assert placed.sharding.is_fully_replicated and len(placed.sharding.device_set) == 8
    round_fn = fed.make_round_fn(
        alg, conv.loss_fn, fp.batch_fn, dataclasses.replace(config, strategy="vmap")
    )
    assert round_fn.place(tree) is tree


_BACKEND_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, seconds, **kw: (
        _BACKEND_COMPILES.append(name) if name.endswith("backend_compile_duration") else None
    )
)


@pytest.mark.parametrize(
    "strategy", ["sequential", pytest.param("sharded", marks=pytest.mark.cpu_devices)]
)
def test_round_compiles_once(strategy):
    """Rounds 2..R trigger no retracing and no XLA compilation (the loss is traced only while
    compiling round 1), on one device and with clients sharded over the 8 fake devices."""
    traces = []

    def counting_loss(params, model_state, batch, key):
        traces.append(1)
        return fp.loss_fn(params, model_state, batch, key)

    alg = fed.get_algorithm("fedpac", {"name": "muon"}, beta=0.5)
    config = fed.RoundConfig(
        num_clients=4,
        clients_per_round=2,
        local_steps=2,
        learning_rate=lambda r: 0.1 * 0.9**r,
        strategy=strategy,
    )
    server = fed.init_server(
        alg, {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}, {}, num_clients=4, key=jax.random.key(0)
    )
    round_fn = fed.make_round_fn(alg, counting_loss, fp.batch_fn, config)
    data = round_fn.place(jax.tree.map(jnp.asarray, fp.quadratic_clients(4)))
    server, _ = round_fn(server, data)
    after_first, compiles = len(traces), len(_BACKEND_COMPILES)
    assert after_first > 0
    for _ in range(4):
        server, _ = round_fn(server, data)
    assert len(traces) == after_first, "round_fn retraced after the first round"
    assert len(_BACKEND_COMPILES) == compiles, "an XLA compilation after the first round"
    assert round_fn._cache_size() == 1
    if strategy == "sharded":
        assert server.params["w"].sharding.mesh.shape == {"clients": 2}, "S = 2 of 8 devices"


def test_sharded_round_uses_each_calls_key_implementation():
    """A sharded round passes the server key as raw key data; rbg and unsafe_rbg keys have the
    same data shape (4,), so a round first called with one must not rewrap the other as it: the
    reused round must equal a fresh one (bit for bit, same program) for the second kind, and
    hand back a key of that kind."""
    alg = fed.get_algorithm("fedavg", {"name": "sgd"})
    config = fed.RoundConfig(
        num_clients=4, clients_per_round=2, local_steps=2, learning_rate=0.1, strategy="sharded"
    )
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}

    def after_one_round(round_fn, impl):
        data = round_fn.place(jax.tree.map(jnp.asarray, fp.quadratic_clients(4)))
        key = jax.random.key(0, impl=impl)
        server = fed.init_server(alg, params, {}, num_clients=4, key=key)
        return round_fn(server, data)[0]

    reused = fed.make_round_fn(alg, fp.noisy_loss_fn, fp.batch_fn, config)
    first = after_one_round(reused, "rbg")
    second = after_one_round(reused, "unsafe_rbg")
    fresh = after_one_round(
        fed.make_round_fn(alg, fp.noisy_loss_fn, fp.batch_fn, config), "unsafe_rbg"
    )
    assert str(jax.random.key_impl(first.key)) == "rbg"
    assert str(jax.random.key_impl(second.key)) == "unsafe_rbg"
    for a, b in zip(jax.tree.leaves(second.params), jax.tree.leaves(fresh.params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first.params["w"], second.params["w"]), "the keys draw differently"


def test_client_drift_and_preconditioner_drift_match_numpy():
    """Each function traced under one ``jax.jit``, as a round traces it (one compilation, not one
    per operation)."""
    rng = np.random.default_rng(0)
    deltas = {"a": rng.normal(size=(5, 3, 2)), "b": rng.normal(size=(5, 4))}
    flat = np.concatenate([deltas["a"].reshape(5, -1), deltas["b"]], axis=1)
    mean = flat.mean(0)
    unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
    gram = unit @ unit.T
    got = jax.jit(fed_metrics.client_drift)(jax.tree.map(jnp.asarray, deltas))
    # Root mean square distance of the updates to their mean.
    np.testing.assert_allclose(
        got["client_drift"], np.sqrt(np.mean(np.sum((flat - mean) ** 2, axis=1))), rtol=1e-5
    )
    np.testing.assert_allclose(got["client_cosine"], (gram.sum() - np.trace(gram)) / 20, rtol=1e-5)
    states = {"m": rng.normal(size=(5, 6, 4)).astype(np.float32), "count": np.zeros(5, np.int32)}

    def drift(states, **options):
        fn = functools.partial(fed_metrics.preconditioner_drift, **options)
        return jax.jit(fn)(jax.tree.map(jnp.asarray, states))

    got = drift(states, spectral=True)
    dev = states["m"] - states["m"].mean(0)
    # FedPAC (Liu et al.) Eq. (7): (1/S) sum_i ||Theta_i - Theta-bar||^2 (integer counters are not
    # sent).
    np.testing.assert_allclose(got["precond_drift"], np.sum(dev**2) / 5, rtol=1e-5)
    spec = np.mean([np.linalg.norm(d, 2) ** 2 for d in dev])
    np.testing.assert_allclose(got["precond_drift_spectral"], spec, rtol=1e-3)
    # An explicit mask selects leaves: with "m" left out nothing is uploaded, so no drift.
    states["v"] = rng.normal(size=(5, 2)).astype(np.float32)
    only_v = {"m": False, "count": False, "v": True}
    got = drift(states, mask=only_v)
    dev_v = states["v"] - states["v"].mean(0)
    np.testing.assert_allclose(got["precond_drift"], np.sum(dev_v**2) / 5, rtol=1e-5)
    none = {"m": False, "count": False, "v": False}
    assert drift(states, mask=none) == {}


def _numpy_summary(x_C):
    """float64 NumPy: mean, sum of squared deviations, sum of unit vectors, sum of unit norms."""
    flat = np.concatenate([x.reshape(x.shape[0], -1) for x in x_C.values()], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    unit = flat / np.maximum(norms, 1e-30)[:, None]
    mean = {k: v.mean(0) for k, v in x_C.items()}
    return mean, np.sum((flat - flat.mean(0)) ** 2), unit.sum(0), np.sum(unit**2)


@pytest.mark.parametrize("groups", [[1] * 7, [3, 3, 1], [2, 5], [7], [1, 6]])
def test_streamed_client_summaries_equal_the_whole_stack(groups):
    """fed.reduce: merging per-client (Welford) or per-chunk (Chan) summaries in any grouping
    gives the mean, spread and direction sums of the whole stack (float64 NumPy reference),
    including a zero update (unit vector 0) and an integer counter leaf (carried, not averaged).
    Traced under one ``jax.jit``, as a round traces them (one compilation, not one per operation).
    """
    from fedorth.fed import reduce

    rng = np.random.default_rng(3)
    x = {"a": rng.normal(size=(7, 3, 2)), "b": 3.0 + rng.normal(size=(7, 4))}
    x["a"][4], x["b"][4] = 0.0, 0.0
    tree = {"delta": {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}}
    tree["count"] = jnp.full((7,), 5, jnp.int32)
    spread = {"delta": None}

    @jax.jit
    def streamed(tree):
        stats = reduce.empty(jax.tree.map(lambda a: a[0], tree), spread, "delta")
        start = 0
        for size in groups:
            part = jax.tree.map(lambda a, lo=start, hi=start + size: a[lo:hi], tree)
            if size == 1:
                new = reduce.from_one(jax.tree.map(lambda a: a[0], part), spread, "delta")
            else:
                new = reduce.from_stack(part, spread, "delta")
            stats = reduce.merge(stats, new, spread)
            start += size
        return stats

    stats = streamed(tree)
    mean, m2, unit_sum, unit_sq = _numpy_summary(x)
    for key in x:
        np.testing.assert_allclose(stats["mean"]["delta"][key], mean[key], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(stats["m2"]["delta"], m2, rtol=1e-5)
    got_unit = np.concatenate([np.ravel(stats["unit_sum"][k]) for k in x])
    np.testing.assert_allclose(got_unit, unit_sum, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["unit_sq"], unit_sq, rtol=1e-6)
    assert int(stats["count"]) == 7 and int(stats["mean"]["count"]) == 5


def test_communication_accounting_follows_the_seeds_tables():
    """FedPAC (Liu et al.) Table 11 / FedMuon (Liu et al.) Table 7: FedAvg |x|, SCAFFOLD 2|x|,
    FedMuon |x| + |M|."""
    params = {"w": jnp.zeros((40, 30))}
    x = 40 * 30 * 4

    def up(name, optim, **opts):
        alg = fed.get_algorithm(name, optim, **opts)
        server = fed.init_server(alg, params, {}, num_clients=2, key=jax.random.key(0))
        return fed.communication_bytes(alg, server)

    assert up("fedavg", {"name": "sgd"}) == {"bytes_up": x, "bytes_down": x}
    assert up("scaffold", {"name": "sgd"}) == {"bytes_up": 2 * x, "bytes_down": 2 * x}
    # Momentum uploaded; down also carries M-bar and Delta_G.
    assert up("fedmuon", {"name": "muon"}) == {"bytes_up": 2 * x, "bytes_down": 3 * x}
    assert up("fedpac_muon", {"name": "muon"})["bytes_up"] == 2 * x
    # FedMuon_SVD: top k = ceil(5% of rank 30) = 2 singular triplets of the 40 x 30 momentum.
    assert up("fedmuon_svd", {"name": "muon"})["bytes_up"] == x + 2 * (40 + 30 + 1) * 4
    # FedPAC over AdamW sends both moments: |x| + 2|x|.
    assert up("fedpac", {"name": "adamw"})["bytes_up"] == 3 * x


def _muon_momentum(opt_state):
    from fedorth.optim.muon import MuonState

    states = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MuonState))
        if isinstance(x, MuonState)
    ]
    assert len(states) == 1
    return np.asarray(states[0].mu["w"])


def test_light_variant_uploads_low_rank_state():
    """fedpac_muon_light: each client sends its 4 x 3 momentum at rank ceil(0.05 * 3) = 1.

    With one client per round the server's aligned momentum is that rank-1 reconstruction,
    while full FedPAC_Muon keeps a full-rank momentum.
    """
    light, _ = _server_after(
        fed.get_algorithm("fedpac_muon_light", {"name": "muon"}), "vmap", n=4, s=1, rounds=1
    )
    full, _ = _server_after(
        fed.get_algorithm("fedpac_muon", {"name": "muon"}), "vmap", n=4, s=1, rounds=1
    )
    sv_light = np.linalg.svd(_muon_momentum(light.opt_state), compute_uv=False)
    sv_full = np.linalg.svd(_muon_momentum(full.opt_state), compute_uv=False)
    assert sv_light[1] < 1e-5 * sv_light[0], sv_light
    assert sv_full[1] > 1e-2 * sv_full[0], sv_full
    np.testing.assert_allclose(sv_light[0], sv_full[0], rtol=1e-5)


_MESH8 = Mesh(np.array(jax.devices()), ("clients",))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"clients_per_round": 9}, "clients_per_round=9 must lie in"),
        ({"local_steps": 0}, "local_steps=0 must be >= 1"),
        ({"strategy": "pmap"}, "strategy='pmap'; valid"),
        ({"strategy": "chunked"}, "chunk_size=None must be >= 1"),
        pytest.param(  # on one GPU every count is a multiple of its one device
            {"strategy": "sharded", "clients_per_round": 3, "mesh": _MESH8},
            "multiple of the 8",
            marks=pytest.mark.cpu_devices,
        ),
        ({"mesh": Mesh(np.array(jax.devices()), ("batch",))}, "axis named 'clients'"),
        ({"learning_rate": -1.0}, "learning_rate=-1.0 must be > 0"),
    ],
)
def test_bad_round_config_is_rejected(kwargs, match):
    alg = fed.get_algorithm("fedavg", {"name": "sgd"})
    base = {"num_clients": 8, "clients_per_round": 4, "local_steps": 2, "learning_rate": 0.1}
    with pytest.raises(ValueError, match=match):
        fed.make_round_fn(alg, fp.loss_fn, fp.batch_fn, fed.RoundConfig(**{**base, **kwargs}))


@pytest.mark.parametrize(
    "name,optim,opts,match",
    [
        ("fedprox2", {"name": "sgd"}, {}, "fed.algorithm='fedprox2' is unknown; valid: "),
        ("fedavg", {"name": "lion"}, {}, "optim.name='lion' is unknown; valid: "),
        (
            "fedpac",
            {"name": "adamw"},
            {"beta": 1.5},
            r"fed\.options\.beta=1.5 must lie in \[0, 1\]",
        ),
        (
            "fedmuon",
            {"name": "muon"},
            {"alpha": -0.1},
            r"fed\.options\.alpha=-0.1 must lie in \[0, 1\]",
        ),
        ("fedcm", {"name": "sgd"}, {"alpha": 2.0}, r"fed\.options\.alpha=2.0 must lie in \[0, 1\]"),
        ("scaffold", {"name": "sgd"}, {"control": "ii"}, r"fed\.options\.control='ii'; valid"),
        (
            "fedavg",
            {"name": "sgd"},
            {"client_state": "global"},
            r"fed\.options\.client_state='global'",
        ),
        ("local_soap", {"name": "muon"}, {}, "local_soap runs the 'soap' local optimizer"),
        ("fedavg", {"name": "sgd"}, {"gamma": 1.0}, "bad options"),
    ],
)
def test_bad_algorithm_is_rejected(name, optim, opts, match):
    with pytest.raises(ValueError, match=match):
        fed.get_algorithm(name, optim, **opts)


def test_full_participation_only_and_model_state_errors():
    alg = fed.get_algorithm("fedmuon_zg", {"name": "lmo"})
    config = fed.RoundConfig(num_clients=8, clients_per_round=4, local_steps=2, learning_rate=0.1)
    with pytest.raises(ValueError, match="full participation only.*clients_per_round=8"):
        fed.make_round_fn(alg, fp.loss_fn, fp.batch_fn, config)
    with pytest.raises(ValueError, match=r"model state leaf \['steps'\] has dtype int32"):
        fed.init_server(
            fed.get_algorithm("fedavg", {"name": "sgd"}),
            {"w": jnp.zeros((4, 3))},
            {"steps": jnp.zeros([], jnp.int32)},
            num_clients=8,
            key=jax.random.key(0),
        )


def test_aggregate_mask_selects_the_aligned_part_of_the_state():
    """All-False mask == reset (Local-X); all-True mask == full alignment (FedPAC, beta = 0: no
    correction, so that the state is all that differs).

    On tests/test_fed_golden.py's problem: the Local AdamW rounds are the golden test's vmap
    program."""
    import dataclasses

    aligned = fed.get_algorithm("fedpac", {"name": "adamw", "learning_rate": 0.05}, beta=0.0)
    mask = lambda value: dataclasses.replace(  # noqa: E731
        aligned.start, mask=lambda s: jax.tree.map(lambda _: value, s)
    )
    none = dataclasses.replace(aligned, start=mask(False))
    every = dataclasses.replace(aligned, start=mask(True))
    local = golden._algorithm("local_adamw")
    assert local.name == "local_adamw" and aligned.name == "fedpac"
    run = lambda alg: _golden_rounds(alg, "vmap")[0].params["w"]  # noqa: E731
    w_local, w_aligned = run(local), run(aligned)  # each round compiled once
    np.testing.assert_array_equal(run(none), w_local)
    np.testing.assert_array_equal(run(every), w_aligned)
    assert np.max(np.abs(w_aligned - w_local)) > 1e-4
    params, model_state, _ = golden._problem(minimax=False)
    server = fed.init_server(none, params, model_state, num_clients=6, key=jax.random.key(0))
    # Up: the parameters (12 + 3) and the averaged model state (3), no optimizer state.
    assert fed.communication_bytes(none, server)["bytes_up"] == (12 + 3 + 3) * 4


def test_precond_drift_counts_only_the_aligned_leaves_on_both_paths():
    """With a warm-start mask (start.Global(mask=...)), preconditioner drift covers the aligned
    leaves only: the streamed
    summary (sequential) equals the client stack's (spectral_drift forces the stacked path), and
    an all-False mask reports no drift on either path."""
    import dataclasses

    from fedorth.optim.federated import is_float

    full = fed.get_algorithm("fedpac", {"name": "adamw"}, beta=0.3)

    def first_moment_only(state):
        # optax.adamw: (ScaleByAdamState(count, mu, nu), ...): align mu, not nu.
        mask = jax.tree.map(lambda _: False, state)
        return (mask[0]._replace(mu=jax.tree.map(is_float, state[0].mu)), *mask[1:])

    masked = dataclasses.replace(full, start=fed.start.Global(mask=first_moment_only))
    no_mask = fed.start.Global(mask=lambda st: jax.tree.map(lambda _: False, st))
    none = dataclasses.replace(full, start=no_mask)
    run = lambda alg, strategy, spectral=False: _server_after(
        alg, strategy, n=6, s=4, spectral_drift=spectral
    )[1]
    streamed, stacked = run(masked, "sequential"), run(masked, "sequential", True)
    np.testing.assert_allclose(streamed["precond_drift"], stacked["precond_drift"], rtol=2e-5)
    assert streamed["precond_drift"] > 0
    # Which metrics a round reports is fixed when it is traced: jax.eval_shape, no compilation.
    data = jax.tree.map(jnp.asarray, fp.quadratic_clients(6, seed=5))
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    server = fed.init_server(none, params, {}, num_clients=6, key=jax.random.key(1))
    for spectral in (False, True):
        config = fed.RoundConfig(6, 4, 3, 0.05, strategy="sequential", spectral_drift=spectral)
        round_fn = fed.make_round_fn(none, fp.noisy_loss_fn, fp.batch_fn, config)
        metrics = jax.eval_shape(round_fn, server, data)[1]
        assert "train_loss" in metrics and "precond_drift" not in metrics, (spectral, metrics)


def test_server_extra_reaches_clients_and_is_updated_from_reports():
    """A server quantity (here: the mean client update) is stored in `extra` and passed on."""
    import dataclasses

    import optax

    seen = []

    def spy(updates, state, params=None, *, last_delta=None, **_):
        seen.append(last_delta)
        return updates, state

    base = fed.get_algorithm("fedavg", {"name": "sgd"})
    alg = dataclasses.replace(
        base,
        local_tx=optax.chain(
            optax.GradientTransformationExtraArgs(lambda p: (), spy), base.local_tx
        ),
        quantities=fed.quantities.ServerQuantities(
            init=lambda p: {"last_delta": jax.tree.map(jnp.zeros_like, p)},
            update=lambda ctx, new, reports: {"last_delta": reports["delta"]},
        ),
        report=fed.quantities.ClientReport(
            lambda ctx, client: {"delta": client.delta},
            floats=1.0,
        ),
    )
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    server = fed.init_server(alg, params, {}, num_clients=6, key=jax.random.key(0))
    config = fed.RoundConfig(num_clients=6, clients_per_round=3, local_steps=2, learning_rate=0.05)
    round_fn = fed.make_round_fn(alg, fp.loss_fn, fp.batch_fn, config)
    data = jax.tree.map(jnp.asarray, fp.quadratic_clients(6))
    before = server.params["w"].copy()
    server, _ = round_fn(server, data)
    np.testing.assert_allclose(
        server.extra["last_delta"]["w"], server.params["w"] - before, rtol=1e-6, atol=1e-7
    )
    assert seen and all(d is not None for d in seen)
    assert fed.communication_bytes(alg, server)["bytes_up"] == 2 * (12 + 3) * 4


def test_schedule_keys_of_the_optim_config_are_not_optimizer_hyperparameters():
    """The lr schedule runs over rounds in the engine; its keys never reach the direction."""
    optim = {
        "name": "adamw",
        "learning_rate": 0.1,
        "schedule": "cosine",
        "warmup_rounds": 2,
        "final_lr_ratio": 0.1,
        "step_rounds": (3,),
        "weight_decay": 0.01,
        "b1": 0.8,
    }
    from fedorth.fed import local

    assert local.split_optim(optim) == ("adamw", 0.01, {"b1": 0.8})
    fed.get_algorithm("fedpac", optim)  # builds


def test_low_rank_upload_keeps_non_negative_moments_non_negative():
    """A rank-k reconstruction of Adam's second moment can dip below 0 (sqrt -> NaN)."""
    from fedorth.fed.round import _compress_state
    from fedorth.optim.compress import low_rank

    rng = np.random.default_rng(0)
    nu = jnp.asarray(rng.random((12, 9)) ** 4, jnp.float32)  # >= 0, full rank
    mu = jnp.asarray(rng.normal(size=(12, 9)), jnp.float32)
    raw = low_rank(nu, ratio=0.2)
    assert float(jnp.min(raw)) < 0, "the plain reconstruction goes negative on this input"
    out = _compress_state({"nu": nu, "mu": mu}, 0.2)
    np.testing.assert_array_equal(out["nu"], jnp.maximum(raw, 0))
    np.testing.assert_allclose(out["mu"], low_rank(mu, ratio=0.2), rtol=1e-6, atol=1e-6)
