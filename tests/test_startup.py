"""A job's start: compilations outside the round, the same initial state, no torch import."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from experiments.bench import startup
from fedorth import fed
from fedorth.train.eager_jit import jit_op_by_op

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _same_bits(a, b) -> bool:
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(a) == len(b) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(a, b, strict=True)
    )


def test_jit_op_by_op_computes_what_dispatch_computes():
    # normal(key) * 0.02 (a ViT's class token): one plain jit folds sqrt(2) * 0.02 into one
    # constant and rounds differently; op by op, the bits of dispatch are kept.
    def draw(seed):
        return jax.random.normal(jax.random.key(seed), (192,)) * 0.02

    eager = draw(3)
    assert not np.array_equal(eager, jax.jit(draw)(3)), "plain jit no longer differs: see module"
    assert np.array_equal(eager, jit_op_by_op(draw)(3))


def test_model_and_server_set_up_in_one_compilation_each_keep_the_bits():
    # A convolution's variance scaling (a constant square root and quotient, which XLA folds
    # in one program) and a class token's normal(0.02), in a small model.
    class Small(nn.Module):
        @nn.compact
        def __call__(self, x):
            token = self.param("token", nn.initializers.normal(0.02), (1, 1, 1, 3))
            return nn.Dense(3)(nn.Conv(3, (3, 3))(x) + token)

    module = Small()

    class Model:
        def init(self, key, x):
            return {"params": module.init(key, x)["params"]}, {}

    model = Model()
    x = np.random.RandomState(0).rand(2, 5, 5, 1).astype(np.float32)
    algorithm = fed.get_algorithm("fedmuon_bc", {"name": "lmo", "learning_rate": 0.01})

    def init_model(seed, x):
        return model.init(jax.random.split(jax.random.key(seed))[0], x)

    def init_server(params, model_state):
        key = jax.random.split(jax.random.key(1))[1]
        return fed.init_server(algorithm, params, model_state, num_clients=3, key=key)

    params, model_state = init_model(42, x)
    # The server's set-up on a small model's parameters (the same code on every leaf).
    small = {"dense": params["params"]["Dense_0"]}
    server = init_server(small, model_state)
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, s, **kw: (
            compiled.append(kw.get("fun_name")) if event == startup.COMPILE_EVENT else None
        )
    )
    jitted_params, jitted_state = jit_op_by_op(init_model)(42, x)
    jitted_server = jit_op_by_op(init_server)(small, model_state)
    assert compiled == ["jit(init_model)", "jit(init_server)"], compiled
    assert _same_bits((params, model_state), (jitted_params, jitted_state))

    def raw(s):
        return s.replace(key=jax.random.key_data(s.key))

    assert _same_bits(raw(server), raw(jitted_server))
    # The server state owns its parameters (the round donates it).
    assert all(
        a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
        for a, b in zip(jax.tree.leaves(small), jax.tree.leaves(jitted_server.params), strict=True)
    )


def test_quick_start_compiles_little_outside_the_round():
    result = startup.measure(rounds=1)
    assert result["compilations_outside_round"] <= 10, (
        "The quick start job compiles more outside the round than it needs: every small eager "
        "jnp operation at set-up (keys, initializers, zeros of the state, slices of the data) "
        "compiles a program of its own; run it in the jitted set-up (fedorth.train.eager_jit) or "
        f"with NumPy on the host. Compiled outside the round: {result['outside_round']}"
    )
    assert result["compilations"] > result["compilations_outside_round"], "the round compiles"
    assert 0 < result["startup_share"] < 1


def test_tensorboard_writer_does_not_import_torch(tmp_path):
    # A stand-in torch that leaves a mark when imported: tensorboardX's writer imports torch
    # whenever it is installed (1.6 s of a job's start).
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    mark = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\nTensor = object\n")
    code = (
        "import pathlib, sys\n"
        "from fedorth.train import logging_utils\n"
        f"writer = logging_utils._tensorboard_writer(pathlib.Path({str(tmp_path / 'tb')!r}))\n"
        "writer.add_scalar('loss', 1.0, 0)\n"
        "writer.close()\n"
        f"print(logging_utils.read_scalars(pathlib.Path({str(tmp_path / 'tb')!r})))\n"
        "import torch\n"  # the real import still works after the writer
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "('loss', 0, 1.0)" in done.stdout
    # The mark comes from the last line's own import only.
    code_without_import = code.replace("import torch\n", "")
    mark.unlink()
    done = subprocess.run(
        [sys.executable, "-c", code_without_import],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert not mark.exists(), "tensorboardX imported torch"


def test_set_up_keeps_the_data_values():
    from fedorth.data.federated import make_federated

    x = np.random.RandomState(0).rand(6, 2)  # float64, as loaders may give
    partition = [np.arange(3), np.arange(3, 6)]
    data = make_federated(x, np.arange(6), x[:2], np.arange(2), partition, "toy", 6)
    assert data.x_train.dtype == jnp.float32
    assert np.array_equal(np.asarray(data.x_train), x.astype(np.float32))
    assert data.y_train.dtype == jnp.int32


# Runs the CLI with its address space limited to what it holds after JAX starts plus a budget
# (resource.setrlimit(RLIMIT_AS)): the same on every machine, and nothing fills the host.
LIMITED_CLI = """
import re, resource, runpy, sys
import experiments
import jax
jax.devices()
with open("/proc/self/status") as f:
    size = int(re.search(r"VmSize:\\s+(\\d+) kB", f.read()).group(1)) * 1024
budget = int(float(sys.argv.pop(1)) * 2**30)
resource.setrlimit(resource.RLIMIT_AS, (size + budget, resource.RLIM_INFINITY))
sys.argv[0] = "experiments.main"
runpy.run_module("experiments.main", run_name="__main__", alter_sys=True)
"""

# FedMuon-LMO keeps M_i and C_i for every client: 2 x 68 MB per client with a 4096-wide MLP,
# on the device (fed.client_state=auto would put 100 such clients on disk, under the limit).
WIDE = [
    "--config=configs/fedmuon_bc.py",
    "--config.model.hidden_sizes=(4096,4096)",
    "--config.fed.client_state=device",
]


def _limited_cli(tmp_path, budget_gib: float, *args: str) -> subprocess.CompletedProcess:
    # RLIMIT_AS counts address space: glibc's per-thread malloc arenas (64 MiB each, as many as
    # threads happen to contend) would make the room left under the limit vary run to run.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_ARENA_MAX": "2"}
    return subprocess.run(
        [sys.executable, "-c", LIMITED_CLI, str(budget_gib), *WIDE, *args,
         f"--workdir={tmp_path / 'run'}", "--config.fed.rounds=1"],
        env=env, capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip


def test_cpu_server_state_out_of_memory_is_one_line(tmp_path):
    # 100 clients x 136 MB of kept state in 2 GiB: refused before anything is allocated.
    done = _limited_cli(tmp_path, 2, "--config.data.num_clients=100")
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: The server state does not fit in the memory of cpu"), lines
    assert "Traceback" not in done.stderr and "RESOURCE_EXHAUSTED" not in done.stderr
    assert "the state each of the 100 clients keeps" in lines[-1]
    assert "--config.data.num_clients=25" in lines[-1]


def test_cpu_round_out_of_memory_is_the_documented_paragraph(tmp_path):
    # 20 clients' kept state (2.7 GB) fits in 3.5 GiB; the round, which writes it anew, does not.
    done = _limited_cli(tmp_path, 3.5, "--config.data.num_clients=20", "--config.fed.local_steps=1")
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: A round does not fit in the memory of cpu:0: XLA asked for"), (
        done.stderr[-3000:]
    )
    assert "Remedies:" in last and "Traceback" not in done.stderr


def test_cpu_round_out_of_memory_with_the_disk_store_is_the_documented_paragraph(tmp_path):
    # The 100 clients' states go to disk; the round that does not fit fails while the store's
    # writer waits for its rows: the round's paragraph is what the run says, not the writer's
    # RESOURCE_EXHAUSTED raised in its place while the run closes.
    done = _limited_cli(
        tmp_path, 2.5, "--config.data.num_clients=100", "--config.fed.client_state=disk"
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: A round does not fit in the memory of cpu:0: XLA asked for"), (
        done.stderr[-3000:]
    )
    assert "Traceback" not in done.stderr and "RESOURCE_EXHAUSTED" not in done.stderr


def test_both_forms_of_xlas_cpu_out_of_memory_are_recognised():
    """XLA:CPU reports a failed allocation as RESOURCE_EXHAUSTED, or, when it fails while a
    computation is dispatched (seen under an address-space limit with other jobs running), as
    INTERNAL "Out of memory allocating N bytes": both are a round out of memory, and the
    paragraph gives the size asked for."""
    from fedorth import fed
    from fedorth.fed import memory

    for text in (
        "RESOURCE_EXHAUSTED: Out of memory allocating 1365430848 bytes.",
        "INTERNAL: Error dispatching computation: Out of memory allocating 335544320 bytes.",
    ):
        assert memory.is_out_of_memory(jax.errors.JaxRuntimeError(text)), text
    assert not memory.is_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: a bad operand"))
    config = fed.RoundConfig(num_clients=4, clients_per_round=2, local_steps=1, learning_rate=0.1)
    error = jax.errors.JaxRuntimeError(
        "INTERNAL: Error dispatching computation: Out of memory allocating 335544320 bytes."
    )
    assert "XLA asked for 0.31 GiB" in memory.out_of_memory_message(error, config, jax.devices()[0])
