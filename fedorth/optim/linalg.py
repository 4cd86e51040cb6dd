"""Dense decompositions (QR, symmetric eigendecomposition, SVD) that are safe inside a round.

Why this module exists: in jaxlib 0.10.x, XLA:CPU's batched LAPACK kernels (``geqrf``,
``syevd``, ``gesdd``, ...) fan the batch out over the intra-op thread pool *they are running on*
and block until it is done (``jax::ParallelBatchMap``). When as many of them run at once as the
pool has threads -- which happens when the round vmaps SOAP's basis refresh over clients and XLA
schedules the QRs of several layers concurrently -- every pool thread waits for work that no thread
is left to run, and the process hangs forever (reproduced here: a FedPAC_SOAP run on 2 cores froze
with two ``lapack_sgeqrf_ffi`` calls in ``BlockingCounter::Wait``; jaxlib 0.11.2 removed that
parallel path from open-source builds).

On the CPU backend these functions therefore run LAPACK on the host in a Python callback
(outside XLA's pool; SciPy's single-precision routines for float32, one matrix of a batch after
another; the callback is ``jax.pure_callback``'s host call without its ``device_put``, see
``_host``, so that the devices of a sharded round can run it at once), and on every other
backend they lower to the native ``jnp.linalg`` kernels. The choice is made per platform at
lowering time (``jax.lax.platform_dependent``), so one jitted function serves both.
The results are those of LAPACK either way (SciPy and jaxlib call the same float32 routines);
eigenvector and singular-vector signs are LAPACK's and may differ between the two paths. (Until
2026-11-21 the host path used ``numpy.linalg``, which computes float32 inputs in float64: about
2x slower, e.g. a 3072² QR 2.8 s vs 1.2 s.)

OpenBLAS threads spin while XLA's threads are busy: set ``OPENBLAS_NUM_THREADS=1`` before
NumPy/SciPy are imported (``experiments/__init__.py``, for every ``python -m experiments.*``,
and the tests do) -- measured 8 s instead of 121 s of CPU for the ``local_soap`` default on
2 cores. A host call itself may use more threads: while it runs, the XLA program that made it
waits for it, so a program on one CPU device (a ``sequential`` round) leaves the host's cores
to the call, and one sharded over ``d`` devices runs up to ``d`` calls at once.
:func:`host_threads` says how many OpenBLAS threads one call gets (``FEDORTH_LAPACK_THREADS``;
by default the cores divided by the program's devices), set around the call with
threadpoolctl. OpenBLAS's multi-threaded float32 ``eigh``/``qr`` round differently from its
one-thread ones (the same bytes run after run at a given count, not across counts), so the
count is a function of the settings and the program alone, never of the load, and calls with
more than one thread run one at a time (a concurrent call would change the process-wide count
under them). The tests pin ``FEDORTH_LAPACK_THREADS=1`` (tests/conftest.py), the count their
recorded bytes were made with.

Float64 inputs use the native kernels on every backend: they only occur with ``jax_enable_x64``
(the float64 reference tests), and under the thread-local ``jax.enable_x64`` context JAX checks a
callback's outputs in its callback thread, where x64 is off, and rejects float64 results.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import jax.extend.core
import jax.interpreters.batching
import jax.interpreters.mlir
import jax.numpy as jnp
import numpy as np
import scipy.linalg

# The host call. `jax.pure_callback` hands its callback the operands as JAX arrays: it first
# `device_put`s the host copies onto CPU device 0, and `np.asarray` then waits for that transfer.
# With several CPU devices running one SPMD program (a `shard_map` round over
# `JAX_NUM_CPU_DEVICES` devices) every XLA:CPU pool thread can be inside such a callback, waiting
# for a transfer that no free thread is left to run: the round hangs (jax 0.10.2, 2 cores,
# reproduced with a 3-line callback; without the `device_put` it runs). So the CPU lowering below
# emits the same host call as `pure_callback` (`emit_python_callback`, one call per device under
# `shard_map`, a maximal sharding under automatic SPMD) but gives `fn` the NumPy operands as they
# arrive. That needs two of JAX's internal names; where they are missing (another JAX version) the
# functions fall back to `jax.pure_callback` and `HOST_CALLS_SHARD` is False, so that
# `fedorth.fed` keeps host-LAPACK rounds on one CPU device.
try:
    from jax._src.callback import _callback_op_sharding as _op_sharding
    from jax._src.callback import emit_python_callback as _emit_python_callback

    HOST_CALLS_SHARD = True
except ImportError:  # pragma: no cover - depends on the installed JAX
    HOST_CALLS_SHARD = False


def _cast(outs, dtypes) -> tuple[np.ndarray, ...]:
    # Cast to the declared dtypes (e.g. bfloat16 inputs are factorized in float32).
    return tuple(np.asarray(o, d) for o, d in zip(outs, dtypes, strict=True))


_host_p = jax.extend.core.Primitive("fedorth_host_lapack")
_host_p.multiple_results = True


@_host_p.def_abstract_eval
def _host_abstract_eval(x, *, fn, shapes):
    del x, fn
    return tuple(jax.core.ShapedArray(shape, dtype) for shape, dtype in shapes)


@_host_p.def_impl
def _host_impl(x, *, fn, shapes):  # eager calls, outside any jit
    return tuple(jnp.asarray(o) for o in _cast(fn(np.asarray(x)), [d for _, d in shapes]))


THREADS_ENV = "FEDORTH_LAPACK_THREADS"
_THREADED = threading.Lock()  # host calls with more than one thread run one at a time
_CONTROLLER = []  # threadpoolctl's controller, made at the first threaded call (BLAS loaded)


def host_threads(devices: int = 1) -> int:
    """OpenBLAS threads of one host call made by an XLA program over ``devices`` CPU devices.

    ``FEDORTH_LAPACK_THREADS``: a count, or ``auto`` (default): the cores this process may run
    on divided by ``devices`` (at least 1), since each device may be inside a call at once and
    the program waits for its calls.
    """
    value = os.environ.get(THREADS_ENV, "auto").strip()
    if value == "auto":
        return max(1, len(os.sched_getaffinity(0)) // max(1, devices))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"{THREADS_ENV}={value!r} must be a thread count >= 1 or 'auto' (the cores divided "
            "by the round's CPU devices)."
        )
    return int(value)


def _with_threads(fn, threads: int, x):
    """``fn(x)`` with ``threads`` OpenBLAS threads (module docstring)."""
    if threads == 1 and os.environ.get("OPENBLAS_NUM_THREADS") == "1":
        return fn(x)  # the process's own setting: nothing to change
    from threadpoolctl import ThreadpoolController

    with _THREADED:
        if not _CONTROLLER:
            _CONTROLLER.append(ThreadpoolController())
        with _CONTROLLER[0].limit(limits=threads, user_api="blas"):
            return fn(x)


def _program_devices(axis_context) -> int:
    """The CPU devices of the program being lowered (each may run a host call at once)."""
    mesh = getattr(axis_context, "mesh", None)  # shard_map: one call per device
    if mesh is not None:
        return int(mesh.size)
    return int(getattr(axis_context, "num_devices", 1) or 1)


def _host_lowering(ctx, x, *, fn, shapes):
    dtypes = [d for _, d in shapes]
    sharding = _op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
    # Fixed when the program is lowered: its calls' bytes depend on it (module docstring).
    threads = host_threads(_program_devices(ctx.module_context.axis_context))
    result, _, _ = _emit_python_callback(
        ctx,
        lambda x: _cast(_with_threads(fn, threads, x), dtypes),
        None,
        [x],
        ctx.avals_in,
        ctx.avals_out,
        has_side_effect=False,
        returns_token=False,
        sharding=sharding,
    )
    return result


def _host_batching(args, dims, *, fn, shapes):
    # `fn` loops over any leading batch axes itself, so a vmapped call is one call with the
    # batch axis in front ("broadcast_all" in pure_callback's terms).
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    shapes = tuple(((x.shape[0], *shape), dtype) for shape, dtype in shapes)
    return _host_p.bind(x, fn=fn, shapes=shapes), (0,) * len(shapes)


if HOST_CALLS_SHARD:
    jax.interpreters.mlir.register_lowering(
        _host_p, _host_lowering, platform="cpu", cacheable=False
    )
    jax.interpreters.batching.primitive_batchers[_host_p] = _host_batching


def _host(fn, out_shapes, x):
    """``fn(x)`` (NumPy in, tuple of NumPy arrays out) on the host, inside or outside a jit."""
    shapes = tuple((tuple(s.shape), np.dtype(s.dtype)) for s in out_shapes)
    if HOST_CALLS_SHARD:
        return tuple(_host_p.bind(x, fn=fn, shapes=shapes))
    dtypes = [d for _, d in shapes]
    return jax.pure_callback(
        lambda x: _cast(fn(x), dtypes), out_shapes, x, vmap_method="broadcast_all"
    )


_SECONDS = [0.0]  # host_seconds()
_SECONDS_LOCK = threading.Lock()


def host_seconds() -> float:
    """Seconds this process has spent in host LAPACK calls of this module (on CPU), summed over
    the calls (two calls side by side, one per device, count twice). The bench reads it around a
    round to say how much of the round they are."""
    return _SECONDS[0]


def _each_matrix(fn, x) -> tuple[np.ndarray, ...]:
    """Applies ``fn`` (matrix -> tuple of arrays) to each matrix of ``[..., m, n]``; stacks."""
    start = time.perf_counter()
    try:
        return _each_matrix_untimed(fn, x)
    finally:
        elapsed = time.perf_counter() - start
        with _SECONDS_LOCK:
            _SECONDS[0] += elapsed


def _each_matrix_untimed(fn, x) -> tuple[np.ndarray, ...]:
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float64):  # e.g. bfloat16: LAPACK has no such routines
        x = x.astype(np.float32)
    batch = x.shape[:-2]
    matrices = x.reshape(-1, *x.shape[-2:])
    if not len(matrices):  # an empty batch: shapes from a zero matrix, no rows
        proto = fn(np.zeros(x.shape[-2:], x.dtype))
        return tuple(np.zeros((*batch, *p.shape), p.dtype) for p in proto)
    outs = [fn(m) for m in matrices]
    return tuple(
        np.stack(parts).reshape(*batch, *parts[0].shape) for parts in zip(*outs, strict=True)
    )


# SciPy's LAPACK in the input's precision (sgeqrf/ssyevd/sgesdd for float32, as jaxlib and the
# authors' PyTorch code use). NumPy's linalg computes float32 in float64 and casts back: 2.0-2.3x
# slower for n = 400..3072 on this project's CPU (docs/PERFORMANCE.md).
def _np_qr(x):
    return _each_matrix(lambda m: scipy.linalg.qr(m, mode="economic", check_finite=False), x)


def _np_eigh(x):
    return _each_matrix(lambda m: scipy.linalg.eigh(m, driver="evd", check_finite=False), x)


def _np_svd(x):
    return _each_matrix(
        lambda m: scipy.linalg.svd(
            m, full_matrices=False, check_finite=False, lapack_driver="gesdd"
        ),
        x,
    )


def _native(x: jax.Array) -> bool:
    return x.dtype == jnp.float64


def qr(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Reduced QR of ``[..., m, n]`` (``m >= n``): ``x = q @ r``, like ``jnp.linalg.qr``."""
    if _native(x):
        return tuple(jnp.linalg.qr(x))
    *batch, m, n = x.shape
    k = min(m, n)
    shapes = (
        jax.ShapeDtypeStruct((*batch, m, k), x.dtype),
        jax.ShapeDtypeStruct((*batch, k, n), x.dtype),
    )
    return jax.lax.platform_dependent(
        x, cpu=lambda x: _host(_np_qr, shapes, x), default=lambda x: tuple(jnp.linalg.qr(x))
    )


def eigh(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Ascending eigenvalues and eigenvectors of symmetric ``[..., n, n]`` (``jnp.linalg.eigh``)."""
    if _native(x):
        return tuple(jnp.linalg.eigh(x))
    *batch, n, _ = x.shape
    shapes = (
        jax.ShapeDtypeStruct((*batch, n), x.dtype),
        jax.ShapeDtypeStruct((*batch, n, n), x.dtype),
    )
    return jax.lax.platform_dependent(
        x, cpu=lambda x: _host(_np_eigh, shapes, x), default=lambda x: tuple(jnp.linalg.eigh(x))
    )


def svd(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Thin SVD of ``[..., m, n]``: ``x = u @ diag(s) @ vt``, like ``jnp.linalg.svd``."""
    if _native(x):
        return tuple(jnp.linalg.svd(x, full_matrices=False))
    *batch, m, n = x.shape
    k = min(m, n)
    shapes = (
        jax.ShapeDtypeStruct((*batch, m, k), x.dtype),
        jax.ShapeDtypeStruct((*batch, k), x.dtype),
        jax.ShapeDtypeStruct((*batch, k, n), x.dtype),
    )
    return jax.lax.platform_dependent(
        x,
        cpu=lambda x: _host(_np_svd, shapes, x),
        default=lambda x: tuple(jnp.linalg.svd(x, full_matrices=False)),
    )


def state_refreshed_on_host(state) -> bool:
    """Whether an optimizer state marks itself as refreshed through this module's host calls.

    A state class says so with a class attribute ``HOST_LAPACK = True``
    (:class:`fedorth.optim.soap.SoapState`: its eigenbases are refreshed by QR/eigh); the round
    engine asks this, never for a particular optimizer, to choose a strategy on CPU.
    """

    def marked(node) -> bool:
        return bool(getattr(type(node), "HOST_LAPACK", False))

    return any(marked(node) for node in jax.tree.leaves(state, is_leaf=marked))


def host_matrix_size(state) -> int:
    """The largest ``n`` of the ``n x n`` matrices that marked states (``HOST_LAPACK = True``)
    hold, 0 when there are none: for SOAP, the largest factor its host ``eigh``/``qr`` take.

    ``state`` may hold arrays or shapes (``jax.eval_shape``). The round engine weighs a round's
    host LAPACK work by it (``fedorth.fed.execution.resolve_strategy``).
    """

    def marked(node) -> bool:
        return bool(getattr(type(node), "HOST_LAPACK", False))

    size = 0
    for node in jax.tree.leaves(state, is_leaf=marked):
        if marked(node):
            for leaf in jax.tree.leaves(node):
                shape = tuple(getattr(leaf, "shape", ()))
                if len(shape) >= 2 and shape[-1] == shape[-2]:
                    size = max(size, int(shape[-1]))
    return size
