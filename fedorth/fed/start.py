"""Design axis: how a client's local-optimizer state starts a round, and what it keeps.

* :class:`Reset`: a fresh ``init`` every round (FedAvg, Local-X: FedPAC (Liu et al.) Alg. 1);
* :class:`Global`: warm-started from the server's average of the clients' final states
  (FedMuon (Liu et al.)'s ``M-bar``, FedPAC (Liu et al.)'s ``Theta``), optionally only the
  leaves of ``mask``, some leaves kept per client (``keep``), uploaded low-rank
  (``compression``);
* :class:`Persistent`: each client keeps its own state between the rounds it joins
  (FedMuon-LMO's ``M_i``).

The contract the round calls (every spec of this axis has these):

* ``init_server(tx, params) -> (opt_state, client_opt_state)``: the server's averaged state
  (``ServerState.opt_state``, or None) and what one client keeps (stacked over the ``N``
  clients in ``ServerState.clients.opt_state``, or None);
* ``client_start(tx, ctx, kept) -> opt_state``: the state the client's local steps start
  from (``ctx``: the round's ``fedorth.fed.context.RoundContext``, whose ``server`` holds the
  averaged state; ``kept``: its row of ``ServerState.clients.opt_state``, or None);
* ``client_end(opt_state) -> (upload, kept)``: what it uploads (its final state, low-rank where
  compressed; the drift metric and the reports read it too) and what it keeps (or None);
* ``averaged``: the server averages the uploaded states (``ServerState.opt_state``);
* ``aligned_mask(opt_state)``: the averaged leaves (None: all), the preconditioner drift's;
* ``read_mask(opt_state)``: the leaves of the server's averaged state that a client reads
  (None: all); the server's average may leave the others at ``init``'s zeros
  (``fedorth.optim.federated.average_states``);
* ``comm_bytes(server) -> (up, down)``: the bytes of the states sent each way per client.

Integer schedule counters belong in no ``mask`` or ``keep`` of their own: they are shared by
all clients (never batched over them), so ``lax.cond`` on a counter stays a real branch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from fedorth.fed import metrics as fed_metrics
from fedorth.fed.state import masked_leaves, with_masked_leaves
from fedorth.optim import federated as fed_optim

PyTree = Any
Mask = Callable[[PyTree], PyTree]


def _both(mask_a: PyTree, mask_b: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: bool(a and b), mask_a, mask_b)


def compress_state(state: PyTree, ratio: float, mask: Mask | None = None) -> PyTree:
    """The uploaded leaves low-rank, in Muon's matrix view (``fedorth.optim.compress``): those
    of ``fed_optim.upload_mask`` that ``mask`` keeps (FedPAC: Θ only)."""
    from fedorth.optim.compress import compress_tree

    uploaded = fed_optim.upload_mask(state)
    if mask is not None:
        uploaded = _both(uploaded, mask(state))
    return compress_tree(state, uploaded, ratio)


def _check_ratio(compression: float | None) -> None:
    if compression is not None and not 0.0 < compression <= 1.0:
        raise ValueError(f"state compression={compression} must lie in (0, 1].")


def _uploaded_bytes(server, mask: Mask | None, compression: float | None) -> tuple[int, int]:
    """Up and down bytes of an averaged state: its uploadable leaves within ``mask``."""
    uploaded = fed_optim.upload_mask(server.opt_state)
    if mask is not None:
        uploaded = _both(uploaded, mask(server.opt_state))
    down = fed_metrics.tree_bytes(server.opt_state, uploaded)
    if compression is not None:
        return fed_metrics.low_rank_bytes(server.opt_state, uploaded, compression), down
    return fed_metrics.tree_bytes(server.opt_state, uploaded), down


@dataclasses.dataclass(frozen=True)
class Reset:
    """A fresh ``tx.init(x^r)`` every round; nothing uploaded but the update.

    Attributes:
      averaged: the server also averages the clients' final states into
        ``ServerState.opt_state`` (and measures their drift) without sending them back: an
        observation of Local-X's clients, no algorithm's step.
    """

    averaged: bool = False
    name = "reset"

    def init_server(self, tx, params):
        return (tx.init(params) if self.averaged else None), None

    def client_start(self, tx, ctx, kept):
        del kept
        return tx.init(ctx.params)

    def client_end(self, opt_state):
        return opt_state, None

    def aligned_mask(self, opt_state):
        del opt_state

    def read_mask(self, opt_state):
        del opt_state

    def comm_bytes(self, server) -> tuple[int, int]:
        return _uploaded_bytes(server, None, None) if self.averaged else (0, 0)


@dataclasses.dataclass(frozen=True)
class Global:
    """Warm start from the server's average of the clients' final states.

    Attributes:
      mask: ``mask(opt_state) -> pytree of bools``: only these leaves are warm-started (and,
        where uploadable, uploaded, averaged and low-rank compressed); the others start each
        round from ``init`` (FedLADA aggregates Adam's second moment only; FedPAC its Θ,
        ``fedorth.optim.federated.align_mask``). None: the whole state.
      keep: ``keep(opt_state) -> pytree of bools``: leaves outside ``mask`` that each client
        keeps between the rounds it joins instead of restarting them from ``init`` (FAFED's
        previous STORM iterate); checked disjoint from ``mask``. None: none.
      compression: if set, the uploaded matrix leaves are replaced by their truncated SVD
        keeping this fraction of the rank (FedMuon_SVD, FedPAC_light), in (0, 1].
    """

    mask: Mask | None = None
    keep: Mask | None = None
    compression: float | None = None
    averaged = True
    name = "global"

    def __post_init__(self):
        _check_ratio(self.compression)

    def kept_mask(self, opt_state: PyTree) -> PyTree:
        """``keep(opt_state)``, checked disjoint from ``mask``."""
        kept = self.keep(opt_state)
        shared = self.mask(opt_state) if self.mask else kept
        if any(jax.tree.leaves(_both(kept, shared))):
            raise ValueError(
                "Global(keep=..., mask=...) select the same leaves; a leaf is either averaged "
                "or kept per client."
            )
        return kept

    def init_server(self, tx, params):
        opt_state = tx.init(params)
        if self.keep is None:
            return opt_state, None
        fresh = tx.init(params)
        return opt_state, masked_leaves(fresh, self.kept_mask(fresh))

    def client_start(self, tx, ctx, kept):
        opt_state = ctx.server.opt_state
        if self.mask is not None:
            fresh = tx.init(ctx.params)
            opt_state = jax.tree.map(
                lambda keep, g, f: g if keep else f, self.mask(fresh), opt_state, fresh
            )
        if self.keep is not None:
            # The leaves each client keeps (FAFED's previous iterate), next to the averaged.
            opt_state = with_masked_leaves(opt_state, self.kept_mask(opt_state), kept)
        return opt_state

    def client_end(self, opt_state):
        kept = None
        if self.keep is not None:
            kept = masked_leaves(opt_state, self.kept_mask(opt_state))
        if self.compression is not None:
            opt_state = compress_state(opt_state, self.compression, self.mask)
        return opt_state, kept

    def aligned_mask(self, opt_state):
        return None if self.mask is None else self.mask(opt_state)

    def read_mask(self, opt_state):
        # client_start takes the masked leaves from the server and the others from init.
        return self.aligned_mask(opt_state)

    def comm_bytes(self, server) -> tuple[int, int]:
        return _uploaded_bytes(server, self.mask, self.compression)


@dataclasses.dataclass(frozen=True)
class Persistent:
    """Each client keeps its own state between the rounds it joins; absent clients keep theirs
    (FedMuon-LMO Alg. 4 line 5, lines 12-13; Fed-Sophia's devices).

    Attributes:
      averaged: the server also averages the clients' final states into
        ``ServerState.opt_state`` (and measures their drift) without sending them back: an
        observation of the clients (``fedorth.theory.rollout.observe_clients``), no
        algorithm's step.
      mask, compression: as :class:`Global`'s, for that averaged upload (the kept state is the
        uploaded one).
    """

    averaged: bool = False
    mask: Mask | None = None
    compression: float | None = None
    name = "persistent"

    def __post_init__(self):
        _check_ratio(self.compression)
        if not self.averaged and (self.mask is not None or self.compression is not None):
            raise ValueError("Persistent(mask=..., compression=...) shape an averaged upload.")

    def init_server(self, tx, params):
        return (tx.init(params) if self.averaged else None), tx.init(params)

    def client_start(self, tx, ctx, kept):
        del tx, ctx
        return kept

    def client_end(self, opt_state):
        if self.compression is not None:
            opt_state = compress_state(opt_state, self.compression, self.mask)
        return opt_state, opt_state

    def aligned_mask(self, opt_state):
        return None if self.mask is None else self.mask(opt_state)

    def read_mask(self, opt_state):
        # The average is an observation of the clients, read whole.
        del opt_state

    def comm_bytes(self, server) -> tuple[int, int]:
        if not self.averaged:
            return 0, 0
        return _uploaded_bytes(server, self.mask, self.compression)


ClientStart = Reset | Global | Persistent
