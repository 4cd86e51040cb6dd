"""fed.strategy="auto" on one accelerator: the measured choice, and out-of-memory messages.

No accelerator is needed: ``fed.execution._backend`` pretends one, ``_dividing_devices`` pretends it
is alone, and a fake clock decides which candidate is faster.
"""

import dataclasses
import json

import fed_problems as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedorth import fed, models, train
from fedorth.fed import autotune, execution, memory
from fedorth.train import loop

BACKEND_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, seconds, **kw: (
        BACKEND_COMPILES.append(name) if name.endswith("backend_compile_duration") else None
    )
)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(execution, "_backend", lambda: "gpu")
    monkeypatch.setattr(execution, "_dividing_devices", lambda clients_per_round: 1)


def fake_clock(compile_s: dict, round_s: dict, order):
    """A timer returning, per candidate in ``order``: start, start + compile, + round."""
    ticks, now = [], 100.0
    for name in order:
        ticks += [now, now + compile_s[name], now + compile_s[name] + round_s[name]]
        now += 1000.0
    return iter(ticks).__next__


def _setup(strategy, timer=None, n=12, s=8, chunk_size=None):
    alg = fed.get_algorithm("scaffold", {"name": "sgd"})
    config = fed.RoundConfig(
        num_clients=n,
        clients_per_round=s,
        local_steps=3,
        learning_rate=0.05,
        strategy=strategy,
        chunk_size=chunk_size,
    )
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    server = fed.init_server(alg, params, {}, num_clients=n, key=jax.random.key(1))
    kwargs = {"timer": timer} if timer else {}
    round_fn = fed.make_round_fn(alg, fp.noisy_loss_fn, fp.batch_fn, config, **kwargs)
    data = jax.tree.map(jnp.asarray, fp.quadratic_clients(n, seed=5))
    return round_fn, server, data


def _run(round_fn, server, data, rounds=3):
    history = []
    for _ in range(rounds):
        server, metrics = round_fn(server, data)
        history.append(jax.device_get(metrics))
    return server, history


def _golden_setup(strategy, timer=None):
    """SCAFFOLD on tests/test_fed_golden.py's problem and settings (S = 4 of 6 clients, K = 2):
    its vmap and sequential rounds are the golden test's programs, compiled once for both
    tests (tests/test_fed_engine.py ``golden_round``)."""
    import test_fed_golden as golden
    from test_fed_engine import golden_round

    return golden_round(golden._algorithm("scaffold"), strategy, timer=timer)


def test_auto_keeps_the_faster_candidate_and_its_results(one_gpu, tmp_path):
    """Fake clock: sequential's round is the faster (vmap is the fallback, so this choice is
    the measurement's)."""
    fastest, order = "sequential", ("vmap", "sequential")
    round_s = {"vmap": 0.3, "sequential": 0.1}
    compile_s = {"vmap": 2.0, "sequential": 1.5}
    round_fn, server, data = _golden_setup("auto", fake_clock(compile_s, round_s, order))
    assert isinstance(round_fn, fed.MeasuredRoundFn) and round_fn.strategy == "auto"
    assert autotune.candidate_strategies(round_fn.config) == order
    with_chunks = dataclasses.replace(round_fn.config, chunk_size=3)
    assert autotune.candidate_strategies(with_chunks) == ("vmap", "chunked", "sequential")

    selection = round_fn.select(server, data)
    assert selection["strategy"] == fastest == round_fn.strategy == round_fn.config.strategy
    assert selection["candidates"] == {
        name: {"compile_s": pytest.approx(compile_s[name]), "round_s": pytest.approx(round_s[name])}
        for name in order
    }
    # The measurement ran on copies: the first round's state is still the caller's.
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(server.params))
    assert fed.describe_selection(selection) == (
        "fed.strategy='auto': one round of each candidate on gpu: vmap 300.0 ms (compile 2.0 s), "
        "sequential 100.0 ms (compile 1.5 s) -> sequential"
    )
    loop._write_run_info(tmp_path, round_fn)
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["strategy"] == "sequential" and info["strategy_selection"] == selection

    compiles = len(BACKEND_COMPILES)
    measured, measured_history = _run(round_fn, server, data)
    assert len(BACKEND_COMPILES) == compiles, "the rounds reuse the measured compilation"
    fixed_fn, fixed_server, _ = _golden_setup(fastest)
    fixed, fixed_history = _run(fixed_fn, fixed_server, data)
    # Bit for bit: every round, the first included, is the chosen strategy's round.
    for a, b in zip(jax.tree.leaves(measured.params), jax.tree.leaves(fixed.params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert measured_history == fixed_history
    assert round_fn._cache_size() == 1, "the measured candidate's compilation is reused"


def _conv_setup(conv_impl, strategy, timer=None):
    """FedAvg on a one-convolution CNN with random 8x8 images: 4 clients, all in each round."""
    model = models.get_model(
        "cnn", num_classes=3, features=(4,), dense_sizes=(), conv_impl=conv_impl
    )
    rng = np.random.default_rng(0)
    data = {
        "x": jnp.asarray(rng.normal(size=(4, 6, 8, 8, 1)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 3, size=(4, 6)), jnp.int32),
    }

    def batch_fn(data, client_id, key):
        # 4 consecutive rows (mod 6) from an offset read off the key: no sampling code to compile.
        start = jnp.floor((fp.key_noise(key) + 0.5) * 6).astype(jnp.int32)
        rows = (start + jnp.arange(4)) % 6
        return {"x": data["x"][client_id][rows], "y": data["y"][client_id][rows]}

    params, model_state = model.init(jax.random.key(0), data["x"][0, :1])
    alg = fed.get_algorithm("fedavg", {"name": "sgd"})
    config = fed.RoundConfig(
        num_clients=4, clients_per_round=4, local_steps=2, learning_rate=0.05, strategy=strategy
    )
    server = fed.init_server(alg, params, model_state, num_clients=4, key=jax.random.key(1))
    kwargs = {"timer": timer} if timer else {}
    return fed.make_round_fn(alg, model.loss_fn, batch_fn, config, **kwargs), server, data


def test_auto_also_chooses_the_convolution_of_a_convolutional_model(one_gpu, tmp_path):
    """A model with conv_impl="auto": the pairs that won on an H100 (vmap with im2col, sequential
    with XLA's convolution) are timed; the faster pair's round is the run's, bit for bit a round
    with that strategy and that convolution fixed, and run_info.json records the pairs."""
    order = ("vmap+matmul", "sequential+lax")
    round_s = {"vmap+matmul": 0.2, "sequential+lax": 0.1}
    clock = fake_clock({"vmap+matmul": 2.0, "sequential+lax": 1.0}, round_s, order)
    round_fn, server, data = _conv_setup("auto", "auto", clock)
    assert autotune.candidates(round_fn.config, True) == {
        "vmap+matmul": ("vmap", "matmul"),
        "sequential+lax": ("sequential", "lax"),
    }
    assert tuple(autotune.candidates(round_fn.config, False)) == ("vmap", "sequential")
    selection = round_fn.select(server, data)
    assert selection["candidate"] == "sequential+lax", selection
    assert (selection["strategy"], selection["conv_impl"]) == ("sequential", "lax")
    assert round_fn.strategy == "sequential" and round_fn.conv_impl == "lax"
    assert tuple(selection["candidates"]) == order
    assert fed.describe_selection(selection).endswith("-> sequential+lax")
    loop._write_run_info(tmp_path, round_fn)
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["strategy"] == "sequential" and info["strategy_selection"] == selection

    measured, _ = _run(round_fn, server, data, rounds=2)
    fixed_fn, fixed_server, _ = _conv_setup("lax", "sequential")
    fixed, _ = _run(fixed_fn, fixed_server, data, rounds=2)
    for a, b in zip(jax.tree.leaves(measured.params), jax.tree.leaves(fixed.params), strict=True):
        np.testing.assert_array_equal(a, b)
    # A model whose convolution is given keeps it: the strategies alone are timed.
    given, _, _ = _conv_setup("matmul", "auto", clock)
    assert isinstance(given, fed.MeasuredRoundFn)
    assert set(given._candidates) == {"vmap", "sequential"}
    assert given._candidates["vmap"].conv_impl is None


def test_ties_go_to_vmap_and_a_failing_candidate_is_skipped(one_gpu):
    class Compiled:
        def __init__(self, error):
            self.error = error

        def compile(self):
            if self.error:
                raise self.error
            return lambda server, data: server

    class Candidate:
        config = fed.RoundConfig(8, 8, 2, 0.1, strategy="vmap")
        devices = (jax.devices()[0],)

        def __init__(self, error=None):
            self.error = error

        def lower(self, server, data):
            return Compiled(self.error)

        def _arguments(self, server, data):
            return server, data

    server = {"w": jnp.ones(3)}
    tie = fed.measure_strategies(
        {"vmap": Candidate(), "sequential": Candidate()},
        server,
        None,
        timer=fake_clock(
            {"vmap": 1, "sequential": 1}, {"vmap": 0.5, "sequential": 0.5}, ["vmap", "sequential"]
        ),
    )
    assert tie["strategy"] == "vmap", tie

    broken = jax.errors.JaxRuntimeError("INTERNAL: ptxas exited with non-zero error code 1")
    chosen = fed.measure_strategies(
        {"vmap": Candidate(broken), "sequential": Candidate()},
        server,
        None,
        # vmap's clock stops after its start: only sequential's three ticks follow.
        timer=iter([0.0, 10.0, 11.0, 12.0]).__next__,
    )
    assert chosen["strategy"] == "sequential"
    assert chosen["candidates"]["sequential"] == {"compile_s": 1.0, "round_s": 1.0}
    assert chosen["candidates"]["vmap"]["error"].startswith("JaxRuntimeError: INTERNAL: ptxas")

    # Every candidate out of memory: one message, sized from XLA's, with the remedies.
    oom = jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.\n"
        "BufferAssignment OOM Debugging.\nBufferAssignment stats: ..."
    )
    with pytest.raises(fed.RoundOutOfMemoryError) as info:
        fed.measure_strategies(
            {"vmap": Candidate(oom), "sequential": Candidate(oom)},
            server,
            None,
            timer=iter(range(10)).__next__,
        )
    assert "XLA asked for 16.00 GiB" in str(info.value)
    # And an error that is not about memory is raised as it is.
    with pytest.raises(jax.errors.JaxRuntimeError, match="ptxas"):
        fed.measure_strategies(
            {"vmap": Candidate(broken)}, server, None, timer=iter(range(9)).__next__
        )


@pytest.mark.cpu_devices
def test_cpu_rules_are_unchanged():
    """On the CPU "auto" is still decided by rule, with no measurement."""
    round_fn, _, _ = _setup("auto")
    assert isinstance(round_fn, fed.RoundFn) and round_fn.selection is None
    assert round_fn.strategy == fed.resolve_strategy("auto", 8) == "sequential"


XLA_DUMP = (
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 42949672960 bytes.\n"
    "BufferAssignment OOM Debugging.\nBufferAssignment stats:\n  parameter allocation: 1.2GiB\n"
)


def test_a_round_out_of_memory_names_the_memory_and_the_remedies(monkeypatch):
    round_fn, server, data = _setup("vmap")

    def out_of_memory(*args):
        raise jax.errors.JaxRuntimeError(XLA_DUMP)

    monkeypatch.setattr(round_fn, "_jitted", out_of_memory)
    with pytest.raises(fed.RoundOutOfMemoryError) as info:
        round_fn(server, data)
    message = str(info.value)
    assert "XLA asked for 40.00 GiB" in message, message
    assert "'vmap' runs all 8 clients at once" in message, message
    for remedy in ("fed.strategy=chunked with fed.chunk_size=2", "model.dtype=bfloat16"):
        assert remedy in message, message
    assert "BufferAssignment" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__, "no XLA dump"
    assert issubclass(fed.RoundOutOfMemoryError, train.USER_ERRORS), "the CLI prints one line"

    def message_for(strategy, chunk_size=None):
        config = fed.RoundConfig(12, 8, 3, 0.05, strategy=strategy, chunk_size=chunk_size)
        error = jax.errors.JaxRuntimeError(XLA_DUMP)
        return memory.out_of_memory_message(error, config, jax.devices()[0])

    # Fewer clients at once is the remedy only where more than one runs at once.
    message = message_for("sequential")
    assert "runs one client at a time" in message and "chunk" not in message, message
    assert "model.dtype=bfloat16" in message, message
    message = message_for("chunked", 4)
    assert "runs 4 clients at a time" in message and "fed.chunk_size=2 " in message, message
    # The other sizes XLA reports: the GPU allocator's and the TPU compiler's.
    gpu = "RESOURCE_EXHAUSTED: Failed to allocate request for 16.00GiB (17179869184B) on device"
    assert memory._requested_bytes(gpu) == 17179869184
    tpu = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.5G of 15.48G hbm."
    assert memory._requested_bytes(tpu) == int(20.5 * 2**30)
