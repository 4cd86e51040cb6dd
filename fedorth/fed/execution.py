"""Running the sampled clients: the execution strategies and their resolution.

``run_clients(fn, shared, xs, config, spread, direction)`` runs one function per client over a
leading client axis, with one of the strategies, which give the same result up to float
reassociation:

* ``"vmap"``: all sampled clients at once (``jax.vmap``);
* ``"chunked"``: vmap over chunks of ``chunk_size`` clients, a ``lax.scan`` over the chunks
  (plus one remainder chunk), bounding peak memory;
* ``"sequential"``: one client at a time inside the compiled call (``lax.scan``);
* ``"sharded"``: the client axis is split over the ``"clients"`` axis of a
  ``jax.sharding.Mesh`` (``jax.shard_map``); each device runs its clients as one device would
  (one at a time on CPU, vmapped elsewhere), and the devices' summaries are combined with
  all-reduces;
* ``"auto"`` (the default): :func:`resolve_strategy`, or on one accelerator the measured choice
  of ``fedorth.fed.autotune``.

What is averaged over the clients is summarized while they run (``fed.reduce``); what the server
needs per client is stacked over the client axis.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from fedorth.fed import reduce
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.config import RoundConfig
from fedorth.models import layers

PyTree = Any


def client_mesh(config: RoundConfig) -> Mesh:
    """The mesh a ``"sharded"`` round lays its clients over.

    ``config.mesh``, or else the first ``d`` of ``jax.devices()`` on one ``"clients"`` axis, with
    ``d`` the largest device count that divides ``clients_per_round`` (every device runs the same
    number of clients).
    """
    if config.mesh is not None:
        return config.mesh
    d = _dividing_devices(config.clients_per_round)
    return Mesh(np.array(jax.devices()[:d]), ("clients",))


def _dividing_devices(clients_per_round: int) -> int:
    """The largest count of ``jax.devices()`` that divides ``clients_per_round``."""
    devices = len(jax.devices())
    return max(d for d in range(1, devices + 1) if clients_per_round % d == 0)


def _backend() -> str:
    """``jax.default_backend()`` (a seam: tests pretend to be on an accelerator)."""
    return jax.default_backend()


def one_device_strategy() -> str:
    return "sequential" if _backend() == "cpu" else "vmap"


# On CPU, "auto" keeps a round on one device once its local state factorizes matrices this large
# on the host (resolve_strategy).
SEQUENTIAL_HOST_MATRIX = 2048


def resolve_strategy(
    strategy: str,
    clients_per_round: int | None = None,
    convolutional: bool = False,
    host_matrix: int = 0,
) -> str:
    """The strategy ``"auto"`` stands for; the others unchanged.

    ``"sharded"`` when ``clients_per_round`` is given, more than one device divides it
    (:func:`client_mesh`), and either the backend is not the CPU or the clients' model is
    ``convolutional`` (:func:`make_round_fn` passes False for algorithms whose host LAPACK
    calls cannot be sharded, only with a JAX lacking ``fedorth.optim.linalg``'s host call).
    Otherwise ``"sequential"`` on the CPU backend and
    ``"vmap"`` elsewhere.

    Why: XLA:CPU runs one client's full-size matrix products on all cores, while ``vmap`` turns
    them into batched products (and convolutions into grouped ones) that it runs slower, and a
    sequential round also holds one client's activations instead of S. Accelerators want the
    batched form. On a CPU split into host devices (``jax_num_cpu_devices``; ``experiments`` sets
    one per core), sharded clients, one at a time on each device, keep the cores busier on
    convolutions (2-core machine, S = 10 x K = 10 FedAvg: CNN 1.35-1.45x, ResNet-18 1.20x a
    one-device round), but not on dense models, whose large products already keep the cores
    busy and whose summaries then cross devices (MLP 0.88-0.97x; docs/PERFORMANCE.md). The
    backend is ``jax.default_backend()`` at call time.

    Except where host LAPACK is the round's work: on CPU, a round whose local state factorizes
    ``n x n`` matrices on the host with ``n >= SEQUENTIAL_HOST_MATRIX`` (``host_matrix``, from
    ``fedorth.optim.linalg.host_matrix_size``: SOAP's largest factor) stays ``"sequential"``, so
    each ``eigh``/``qr`` gets every core. Two one-thread ``eigh`` side by side (one per device)
    took 1.28-1.38x the time of two two-thread ones in turn at n = 512-1024, 1.54x at n = 2048
    and 1.60-1.73x at n = 3072-4096 (2-core Zen 3, ``python -m experiments.bench round --micro``);
    the convolutions' gain from sharding outweighs that below 2048: the FedPAC_SOAP round of the
    CNN (a 4096 factor) ran 1.33x faster sequential, while LeNet-5's (largest factor 400) and
    ResNet-18's (width 0.25, 128) ran 1.42x faster sharded (S = 4, K = 5; docs/PERFORMANCE.md).

    On one accelerator no rule holds for every model (H100, S = 10 x K = 10 FedAvg: vmap is
    0.38x sequential on ResNet-18, 1.9x on ViT-Tiny), so :func:`make_round_fn` times the
    candidates instead (:class:`MeasuredRoundFn`); ``"vmap"`` here is what it falls back to.
    """
    if strategy != "auto":
        return strategy
    one_device = one_device_strategy()
    if clients_per_round is None or (
        one_device == "sequential" and (not convolutional or host_matrix >= SEQUENTIAL_HOST_MATRIX)
    ):
        return one_device
    return "sharded" if _dividing_devices(clients_per_round) > 1 else one_device


def clients_per_group(config: RoundConfig) -> int | None:
    """Clients vmapped together on the looping strategies (1: one at a time); None when all of a
    device's clients run at once (``vmap``, or ``sharded`` off CPU)."""
    strategy = resolve_strategy(config.strategy, config.clients_per_round)
    if strategy == "sharded":
        strategy = one_device_strategy()
    if strategy == "vmap":
        return None
    return 1 if strategy == "sequential" else min(config.chunk_size, config.clients_per_round)


def client_conv_trace_mode(config: RoundConfig) -> str | None:
    """The ``layers.conv_trace_mode`` a round of ``config`` traces its clients' gradients in.

    ``"reverse_unbatched"`` when clients run one at a time (``"sequential"``, or chunks of one):
    models with ``conv_impl="auto"`` then use the canonical convolution on CPU
    (``layers.resolve_conv_impl``); None (not declared) when clients are vmapped.
    """
    return "reverse_unbatched" if clients_per_group(config) == 1 else None


def _run_sharded(
    fn: Callable, shared: PyTree, xs: PyTree, config: RoundConfig, spread: dict, direction: str
) -> tuple[reduce.Stats, PyTree]:
    """``run_clients`` with the client axis split over ``client_mesh(config)``.

    Each device runs its ``S / d`` clients with the one-device strategy, then the devices'
    summaries are combined by all-reduces (:func:`fed.reduce.psum`); the stacked outputs stay
    split over the devices.
    """
    mesh = client_mesh(config)
    inner = dataclasses.replace(config, strategy=one_device_strategy(), mesh=None)

    def local(shared_local, xs_local):
        stats, stacked = run_clients(fn, shared_local, xs_local, inner, spread, direction)
        return reduce.psum(stats, spread, "clients"), stacked

    spec = PartitionSpec("clients")
    # Inside a sweep's shard_map over its replica axis (fedorth.sweep.placement), the clients
    # split over the devices of their replica's group: the context's mesh, its "clients" axis.
    context = jax.sharding.get_abstract_mesh()
    nested = {"axis_names": {"clients"}} if context.manual_axes else {}
    if nested:
        mesh = context
    # `shared` (server state, data) enters replicated. check_vma=False: the summary is replicated
    # by construction (all-reduced), and the integer schedule counters it carries are equal on
    # every client.
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(), spec),
        out_specs=(PartitionSpec(), spec),
        check_vma=False,
        **nested,
    )(shared, xs)


def run_clients(
    fn: Callable, shared: PyTree, xs: PyTree, config: RoundConfig, spread: dict, direction: str
) -> tuple[reduce.Stats, PyTree]:
    """Runs ``fn(shared, x) -> (averaged, stacked)`` for every client ``x`` of ``xs`` (leading
    client axis); ``shared`` (the server state, data, ...) is the same for all.

    Returns the summary (``fed.reduce``) of the ``averaged`` outputs and the client-stacked
    ``stacked`` outputs. Sequential and chunked rounds update the summary in place as clients
    finish, so the averaged outputs are never stacked over clients (docs/PERFORMANCE.md).
    """
    strategy = resolve_strategy(config.strategy, config.clients_per_round)
    if strategy == "sharded":
        return _run_sharded(fn, shared, xs, config, spread, direction)
    fn = functools.partial(fn, shared)
    if strategy == "vmap":
        averaged, stacked = jax.vmap(fn)(xs)
        return reduce.from_stack(averaged, spread, direction), stacked
    s = jax.tree.leaves(xs)[0].shape[0]
    chunk = clients_per_group(config)
    one = jax.eval_shape(fn, jax.tree.map(lambda a: a[0], xs))[0]
    start = reduce.empty(one, spread, direction)
    full, rest = divmod(s, chunk)
    if chunk == 1:

        def body(stats, x):
            averaged, stacked = fn(x)
            return reduce.merge(
                stats, reduce.from_one(averaged, spread, direction), spread
            ), stacked

        # One client at a time: conv_impl="auto" may use the canonical convolution on CPU. The
        # scan traces its body here, inside the context.
        with layers.conv_trace_mode(client_conv_trace_mode(config)):
            return jax.lax.scan(body, start, xs)

    def body_chunk(stats, x):
        averaged, stacked = jax.vmap(fn)(x)
        return reduce.merge(stats, reduce.from_stack(averaged, spread, direction), spread), stacked

    head = jax.tree.map(lambda a: a[: full * chunk].reshape(full, chunk, *a.shape[1:]), xs)
    stats, stacked = jax.lax.scan(body_chunk, start, head)
    stacked = jax.tree.map(lambda a: a.reshape(full * chunk, *a.shape[2:]), stacked)
    if rest:
        averaged, tail = jax.vmap(fn)(jax.tree.map(lambda a: a[full * chunk :], xs))
        stats = reduce.merge(stats, reduce.from_stack(averaged, spread, direction), spread)
        stacked = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stacked, tail)
    return stats, stacked


def calls_host_lapack(algorithm: FedAlgorithm) -> bool:
    """Whether the algorithm's rounds may run ``fedorth.optim.linalg`` (host LAPACK on CPU) in a
    form that cannot be sharded over CPU devices: a local state refreshed on the host (SOAP's
    QR/eigh, FedPAC's server bases; ``linalg.state_refreshed_on_host``) or low-rank state
    compression (SVD), when ``linalg.HOST_CALLS_SHARD`` is False.

    With ``jax.pure_callback`` (the fallback there) a FedPAC_SOAP round sharded over 2 CPU devices
    on 2 cores hung: both XLA:CPU pool threads inside the callbacks, each waiting in
    ``np.asarray`` for the ``device_put`` that ``pure_callback`` makes of its operand, work that no
    free pool thread was left to run (py-spy, 2026-11-21). ``linalg``'s own host call skips that
    ``device_put`` and shards.
    """
    from fedorth.optim import linalg

    if linalg.HOST_CALLS_SHARD:
        return False
    if getattr(algorithm.start, "compression", None) is not None:
        return True
    probe = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    return linalg.state_refreshed_on_host(jax.eval_shape(algorithm.local_tx.init, probe))


def host_matrix_size(algorithm: FedAlgorithm, params: PyTree) -> int:
    """The largest ``n x n`` matrix the algorithm's local state factorizes on the host for
    ``params`` (``fedorth.optim.linalg.host_matrix_size``); 0 without ``params``."""
    if params is None:
        return 0
    from fedorth.optim import linalg

    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    return linalg.host_matrix_size(jax.eval_shape(algorithm.local_tx.init, shapes))


def fixed_strategy(
    algorithm: FedAlgorithm, loss_fn: Callable, config: RoundConfig, params: PyTree = None
) -> RoundConfig:
    """``config`` with its strategy resolved (never ``"auto"``), checked against ``algorithm``.

    ``loss_fn``: a bound ``Model.loss_fn`` also tells ``"auto"`` whether the model is
    convolutional (:func:`resolve_strategy`). ``params`` (arrays or shapes; optional): the
    model's parameters, which size the host LAPACK work of the local state on CPU.
    """
    convolutional = bool(getattr(getattr(loss_fn, "__self__", None), "convolutional", False))
    # Through jax.pure_callback (linalg's fallback) host LAPACK hangs when every XLA:CPU pool
    # thread runs one at once, as the devices of a sharded CPU round do: then "auto" keeps such
    # rounds on one device.
    host_lapack = jax.default_backend() == "cpu" and calls_host_lapack(algorithm)
    config = dataclasses.replace(
        config,
        strategy=resolve_strategy(
            config.strategy,
            config.clients_per_round,
            convolutional and not host_lapack,
            host_matrix_size(algorithm, params) if config.strategy == "auto" else 0,
        ),
    )
    devices = client_mesh(config).devices.size if config.strategy == "sharded" else 1
    if host_lapack and devices > 1:
        raise ValueError(
            f"fed.strategy='sharded' over {devices} CPU devices with "
            f"{algorithm.name}: its SOAP states or low-rank compression run LAPACK on the host "
            "(fedorth.optim.linalg), which hangs when the devices call it at once; use "
            "'sequential' (or 'auto') on CPU."
        )
    config.validate(algorithm)
    return config
