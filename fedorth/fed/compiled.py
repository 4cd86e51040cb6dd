"""The jitted round: donation, the sharded round's placement, out-of-memory messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from fedorth.fed.config import RoundConfig
from fedorth.fed.execution import client_mesh
from fedorth.fed.memory import RoundOutOfMemoryError, is_out_of_memory, out_of_memory_message
from fedorth.fed.state import ServerState
from fedorth.models import layers

PyTree = Any


def _with_conv_impl(round_fn: Callable, conv_impl: str) -> Callable:
    """``round_fn`` whose models, traced inside it, take ``conv_impl`` for ``"auto"``."""

    def traced(server, data):
        with layers.auto_conv_impl(conv_impl):
            return round_fn(server, data)

    return traced


class RoundFn:
    """The jitted round of ``fedorth.fed.make_round_fn``: ``round_fn(server, data) -> (server,
    metrics)``.

    Attributes:
      config: the round's settings, with ``strategy`` resolved (never ``"auto"``).
      strategy: ``config.strategy``.
      devices: the devices a round runs on (the mesh's when sharded, else the default device).
      conv_impl: what the models' ``conv_impl="auto"`` stands for in this round (None: the
        backend's default, ``fedorth.models.layers.resolve_conv_impl``); set by
        ``fedorth.fed.autotune`` for the (strategy, convolution) pairs it times.
      selection: None (the strategy was not measured; ``MeasuredRoundFn`` has one).

    A round that runs out of device memory raises :class:`RoundOutOfMemoryError`, whose message
    names the memory XLA asked for and the settings that shrink a round, not XLA's dump.

    A ``"sharded"`` round reads the server state and the data replicated on
    :func:`client_mesh`: :meth:`place` puts a tree there (``jax.device_put`` returns an array
    already placed as it is), and every call places its arguments first, so that only what was
    never placed is copied (the first round's server state; data not placed by :meth:`place`,
    every round). Other strategies read their arguments where they are (``place`` is the
    identity). The server state comes back placed.

    On the sharded path the server's typed PRNG key crosses the jitted call as its raw
    ``key_data``: a typed key coming back from a mesh-sharded ``jit`` adds an entry to the jitted
    function's fast-path cache (jax 0.10.2: a second entry in round 3, without recompiling),
    which would hide a real recompilation from ``_cache_size``. The key's implementation (e.g.
    ``"threefry2x32"``) is a static argument of that call, read from each call's key, so keys of
    another implementation with the same data shape (``rbg`` and ``unsafe_rbg``) compile their
    own round instead of being rewrapped as the first one's. Other attributes (``lower``,
    ``_cache_size``) are the jitted function's.
    """

    selection = None

    def __init__(self, round_fn: Callable, config: RoundConfig, conv_impl: str | None = None):
        self.config = config
        self.strategy = config.strategy
        self.conv_impl = conv_impl
        self._sharding = None
        if conv_impl is not None:
            round_fn = _with_conv_impl(round_fn, conv_impl)
        if self.strategy != "sharded":
            self.devices = (jax.devices()[0],)
            self._jitted = jax.jit(round_fn, donate_argnums=(0,))
            return
        mesh = client_mesh(config)
        self.devices = tuple(mesh.devices.flat)
        self._sharding = NamedSharding(mesh, PartitionSpec())

        def on_key_data(server, data, impl):
            key = jax.random.wrap_key_data(server.key, impl=impl)
            server, metrics = round_fn(server.replace(key=key), data)
            return server.replace(key=jax.random.key_data(server.key)), metrics

        self._jitted = jax.jit(
            on_key_data, donate_argnums=(0,), static_argnums=(2,), out_shardings=self._sharding
        )

    def place(self, tree: PyTree) -> PyTree:
        """``tree`` placed where this round reads it (replicated on the mesh when sharded)."""
        if self._sharding is None:
            return tree

        def put(x):
            if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                # A mesh spanning several processes takes no typed key in device_put
                # ("not addressable"): its key data goes there, and is wrapped on the mesh.
                data = jax.device_put(jax.random.key_data(x), self._sharding)
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
            return jax.device_put(x, self._sharding)

        return jax.tree.map(put, tree)

    def _arguments(self, server: ServerState, data: PyTree):
        if self._sharding is None:
            return server, data
        raw = server.replace(key=jax.random.key_data(server.key))
        return (*self.place((raw, data)), jax.random.key_impl(server.key))

    def select(self, server: ServerState, data: PyTree) -> None:
        """Nothing to choose: the strategy is fixed (:meth:`MeasuredRoundFn.select`)."""
        del server, data

    def __call__(self, server: ServerState, data: PyTree):
        arguments = self._arguments(server, data)
        try:
            new, metrics = self._jitted(*arguments)
        except jax.errors.JaxRuntimeError as error:
            if not is_out_of_memory(error):
                raise
            # from None: the message says it all; XLA's allocation dump would bury it.
            message = out_of_memory_message(error, self.config, self.devices[0])
            raise RoundOutOfMemoryError(message) from None
        if self._sharding is not None:
            new = new.replace(key=jax.random.wrap_key_data(new.key, impl=arguments[-1]))
        return new, metrics

    def lower(self, server: ServerState, data: PyTree):
        return self._jitted.lower(*self._arguments(server, data))

    def __getattr__(self, name: str):
        return getattr(self._jitted, name)
