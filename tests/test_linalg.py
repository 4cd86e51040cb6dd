"""fedorth.optim.linalg: LAPACK results, and no batched XLA:CPU LAPACK kernel inside a round."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import blas_threads_seen

from fedorth.optim import linalg


def _batch(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_qr_eigh_svd_identities_under_jit_and_vmap():
    x = _batch((3, 6, 4))
    q, r = jax.jit(jax.vmap(linalg.qr))(x)
    np.testing.assert_allclose(q @ r, x, atol=2e-5)
    np.testing.assert_allclose(
        jnp.swapaxes(q, -1, -2) @ q, np.broadcast_to(np.eye(4), (3, 4, 4)), atol=2e-5
    )
    assert np.allclose(np.tril(r, -1), 0)
    sym = x @ jnp.swapaxes(x, -1, -2)
    w, v = jax.jit(jax.vmap(linalg.eigh))(sym)
    np.testing.assert_allclose(v @ (w[..., None] * jnp.swapaxes(v, -1, -2)), sym, atol=1e-4)
    assert np.all(np.diff(np.asarray(w), axis=-1) >= -1e-5), "eigenvalues ascending"
    np.testing.assert_allclose(w, np.linalg.eigvalsh(np.asarray(sym, np.float64)), atol=1e-4)
    u, s, vt = jax.jit(linalg.svd)(x)
    np.testing.assert_allclose((u * s[..., None, :]) @ vt, x, atol=2e-5)
    np.testing.assert_allclose(
        s, np.linalg.svd(np.asarray(x, np.float64), compute_uv=False), rtol=1e-5
    )


@pytest.mark.parametrize("name", ["qr", "eigh", "svd"])
def test_cpu_lowering_avoids_batched_lapack_kernels(name):
    """jaxlib 0.10's batched CPU LAPACK kernels can deadlock XLA's intra-op pool (see module)."""
    fn = getattr(linalg, name)
    x = _batch((4, 5, 5))
    if name == "eigh":
        x = x @ jnp.swapaxes(x, -1, -2)

    def targets(f):
        hlo = jax.jit(jax.vmap(f)).lower(x).compile().as_text()
        return set(re.findall(r'custom_call_target="([^"]+)"', hlo))

    ours = targets(fn)
    assert not any("lapack" in t for t in ours), f"{name} lowered to LAPACK kernels {ours}"
    assert any("callback" in t for t in ours)
    native = targets(getattr(jnp.linalg, name))
    assert any("lapack" in t for t in native), "the native kernel is the one being avoided"


@pytest.mark.parametrize("name", ["qr", "eigh", "svd"])
def test_host_path_runs_single_precision_lapack(name, monkeypatch):
    """float32 in, float32 LAPACK (sgeqrf/ssyevd/sgesdd, as jaxlib and PyTorch): the host path
    must not upcast to float64 as numpy.linalg does (2x the time, docs/PERFORMANCE.md).
    SciPy picks the routine from the array's dtype, so record the dtypes LAPACK is given."""
    import scipy.linalg

    seen = []
    original = getattr(scipy.linalg, name)

    def spy(a, *args, **kwargs):
        seen.append(np.asarray(a).dtype)
        return original(a, *args, **kwargs)

    monkeypatch.setattr(scipy.linalg, name, spy)
    x = _batch((2, 6, 6), seed=3)
    if name == "eigh":
        x = x @ jnp.swapaxes(x, -1, -2)
    outs = jax.jit(getattr(linalg, name))(x)
    jax.block_until_ready(outs)
    assert seen == [np.float32, np.float32], seen
    assert all(o.dtype == jnp.float32 for o in outs)


def test_host_path_accepts_bfloat16():
    """LAPACK has no bfloat16 routines: the host path computes in float32 and casts back."""
    x = _batch((5, 3), seed=4).astype(jnp.bfloat16)
    q, r = jax.jit(linalg.qr)(x)
    assert q.dtype == r.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(q @ r, np.float32), np.asarray(x, np.float32), atol=3e-2, rtol=3e-2
    )


_SHARDED_HOST_CALLS = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from fedorth.optim import linalg

mesh = jax.make_mesh((jax.device_count(),), ("d",))


def body(x):
    y = x[0] @ x[0].T  # the callbacks' operands are computed by the devices themselves
    w, v = linalg.eigh(y)
    q, r = linalg.qr(v @ x[0])
    u, s, vt = linalg.svd(q * w[-1])
    return tuple(a[None] for a in (w, v, q, r, u, s, vt))


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))
x = np.random.default_rng(0).standard_normal((jax.device_count(), 256, 192)).astype(np.float32)
for _ in range(2):
    outs = [np.asarray(o) for o in f(jax.device_put(x, jax.NamedSharding(mesh, P("d"))))]
alone = [np.stack(o) for o in zip(*(jax.jit(lambda m: body(m[None]))(m) for m in x))]
for a, b in zip(outs, alone, strict=True):
    np.testing.assert_array_equal(a, b[:, 0])
w, v, q, r = outs[:4]
y = x @ np.swapaxes(x, 1, 2)
np.testing.assert_allclose(v @ (w[..., None] * np.swapaxes(v, 1, 2)), y, rtol=0, atol=2e-3)
np.testing.assert_allclose(q @ r, v @ x, rtol=0, atol=2e-3)
print("ok", jax.device_count())
"""


def test_host_calls_run_on_every_device_of_a_shard_map_at_once():
    """A shard_map over 2 CPU devices whose devices call eigh/qr/svd on 256-row operands at once.
    With `jax.pure_callback` this hung (the callback `device_put`s its operand, and a copy this
    large waits for a pool thread that the devices' callbacks hold; 64-row ones are copied inline
    and ran): `linalg`'s host call must finish, and each device's results must be those of one
    device alone, bit for bit (same LAPACK routine, same input). In a subprocess, so that a
    regression fails on the timeout instead of hanging the suite."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "", "JAX_NUM_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED_HOST_CALLS],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", "2"], proc.stdout


def test_states_refreshed_on_the_host_are_found_by_their_mark():
    """The engine asks ``state_refreshed_on_host`` whether a local optimizer's state is refreshed
    through these host calls (to keep a CPU round off the sharded strategy when they cannot
    shard): SOAP's state, also inside a chain, yes; Adam's and Muon's, no."""
    import optax

    from fedorth.optim import muon, soap

    params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    chained = optax.chain(optax.add_decayed_weights(0.1), soap(learning_rate=0.1))
    for tx, expected in [
        (soap(learning_rate=0.1), True),
        (chained, True),
        (optax.adam(0.1), False),
        (muon(learning_rate=0.1), False),
    ]:
        state = jax.eval_shape(tx.init, params)
        assert linalg.state_refreshed_on_host(state) is expected, tx


@pytest.mark.cpu_devices
def test_a_host_call_gets_the_cores_its_program_leaves_it(monkeypatch):
    """FEDORTH_LAPACK_THREADS=auto: a program on one CPU device (a sequential round) waits for
    its host call, which then gets every core; a program over d devices, which may be inside d
    calls at once, gives each cores // d. The process's own setting is back after the call."""
    from jax.sharding import PartitionSpec as P
    from threadpoolctl import threadpool_info

    monkeypatch.setenv("FEDORTH_LAPACK_THREADS", "auto")
    monkeypatch.setattr(linalg.os, "sched_getaffinity", lambda pid: {0, 1})
    seen = blas_threads_seen(monkeypatch)
    x = _batch((2, 6, 6), seed=5)
    x = x @ jnp.swapaxes(x, -1, -2)
    # Fresh functions: jit's caches would reuse other tests' lowerings (and their counts).
    jax.block_until_ready(jax.jit(lambda m: linalg.eigh(m))(x))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    sharded = jax.jit(
        jax.shard_map(
            lambda m: linalg.eigh(m), mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False
        )
    )
    jax.block_until_ready(sharded(x))
    assert seen == [2, 1, 1], seen
    assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {1}
    monkeypatch.setenv("FEDORTH_LAPACK_THREADS", "3")
    jax.block_until_ready(jax.jit(lambda m: linalg.eigh(m))(x))
    assert seen[-1] == 3


def test_a_bad_lapack_thread_count_names_the_variable(monkeypatch):
    for value in ("0", "two", "-1"):
        monkeypatch.setenv("FEDORTH_LAPACK_THREADS", value)
        with pytest.raises(ValueError, match=f"FEDORTH_LAPACK_THREADS='{value}' must be"):
            jax.jit(lambda m: linalg.qr(m)).lower(jnp.ones((3, 2)))
