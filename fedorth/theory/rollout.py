"""Many rounds in one compiled call, and rounds that also return every client's optimizer state.

* :func:`rollout` scans a round function over ``R`` rounds (one ``jit`` for a whole run; wrap it
  in ``jax.vmap`` to run several seeds or noise levels at once).
* :func:`observe_clients` builds the engine's round of an algorithm that also returns the
  sampled clients' end-of-round optimizer states ``Theta_i^{r,K}`` (FedPAC (Liu et al.) Definition
  1), which
  the engine itself only averages. It runs the *same* engine round on a twin of the algorithm
  whose clients are ``start.Persistent(averaged=True)`` and start every round from the state the
  original would start from (a fresh ``init`` for Local-X, the server's averaged state for
  FedPAC/FedMuon), so the trajectory is the original's and the clients' final states stay
  readable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.round import RoundConfig, make_round_fn, sample_clients
from fedorth.fed.start import Persistent
from fedorth.fed.state import ClientState, gather_clients, stack_clients

PyTree = Any

__all__ = ["observe_clients", "rollout"]


def rollout(round_fn: Callable[..., tuple], rounds: int) -> Callable[[Any, PyTree], tuple]:
    """``run(server, data) -> (server, history)``: ``rounds`` rounds in one ``lax.scan``.

    Args:
      round_fn: ``round_fn(server, data) -> (server, out, ...)`` (e.g. from
        :func:`fedorth.fed.make_round_fn` or :func:`observe_clients`).
      rounds: number of rounds ``R`` (static).

    Returns:
      A pure function (wrap it in ``jax.jit``, and ``jax.vmap`` for batches of runs); ``history``
      stacks the round's outputs after the server over a leading axis of size ``R`` (the
      outputs themselves when the round returns one, else a tuple).
    """
    if int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds={rounds} must be a positive integer.")

    def run(server, data):
        def body(server, _):
            out = round_fn(server, data)
            return out[0], (out[1] if len(out) == 2 else tuple(out[1:]))

        return jax.lax.scan(body, server, None, length=int(rounds))

    return run


def observe_clients(
    algorithm: FedAlgorithm,
    loss_fn: Callable[..., Any],
    batch_fn: Callable[..., Any],
    config: RoundConfig,
) -> Callable[[Any, PyTree], tuple[Any, dict, PyTree]]:
    """The engine's round of ``algorithm``, also returning the clients' end-of-round states.

    The returned ``round_fn(server, data) -> (server, metrics, opt_state_C)`` takes and returns
    the server state of ``algorithm`` (from :func:`fedorth.fed.init_server`) and follows the same
    trajectory as :func:`fedorth.fed.make_round_fn` (same sampled clients, batches and keys);
    ``opt_state_C`` stacks the ``S`` sampled clients' final optimizer states (sorted client ids,
    as the engine samples them), and ``metrics`` always holds ``precond_drift`` (FedPAC (Liu et
    al.) Eq. 7,
    :func:`fedorth.fed.metrics.preconditioner_drift`), also for Local-X whose server never
    averages states.

    Choice: the twin keeps each client's state in the engine's persistent per-client storage, so
    integer schedule counters are batched over clients inside the round; a ``lax.cond`` on them
    then evaluates both branches (same values, more work), see docs/CONTRACTS.md.

    Args:
      algorithm: an algorithm whose clients start from ``start.Reset()`` or ``start.Global()``
        (without ``keep``) and that keeps no control variates.
      loss_fn: as for :func:`fedorth.fed.make_round_fn`.
      batch_fn: as for :func:`fedorth.fed.make_round_fn`.
      config: the round's settings.

    Returns:
      The jitted round function (the server state is donated, as the engine's).
    """
    if getattr(algorithm.start, "keep", None) is not None:
        raise ValueError(
            f"observe_clients: {algorithm.name} keeps part of its state per client "
            "(start.Global(keep=...)); its clients' kept leaves are already in server.clients."
        )
    if algorithm.start.name not in ("reset", "global") or algorithm.corrections.control:
        raise ValueError(
            f"observe_clients: {algorithm.name} has start={algorithm.start.name!r} and "
            f"control variates {algorithm.corrections.control!r}; only 'reset'/'global' clients "
            "without control variates are supported (persistent clients' states are already in "
            "server.clients)."
        )
    mask = getattr(algorithm.start, "mask", None)
    observed = Persistent(
        averaged=True, mask=mask, compression=getattr(algorithm.start, "compression", None)
    )
    twin = dataclasses.replace(algorithm, start=observed)
    twin_round = make_round_fn(twin, loss_fn, batch_fn, config)
    tx = algorithm.local_tx
    n, s = config.num_clients, config.clients_per_round

    def round_fn(server, data):
        fresh = tx.init(server.params)
        if algorithm.start.name == "reset":
            start = fresh
        elif mask is not None:
            start = jax.tree.map(
                lambda keep, g, f: g if keep else f, mask(fresh), server.opt_state, fresh
            )
        else:
            start = server.opt_state
        twin_server = server.replace(
            opt_state=server.opt_state if server.opt_state is not None else fresh,
            clients=stack_clients(ClientState(opt_state=start, control=None), n),
        )
        _, ids = sample_clients(server.key, server.round, n, s)
        new, metrics = twin_round(twin_server, data)
        states_C = gather_clients(new.clients.opt_state, ids)
        new = new.replace(
            clients=None, opt_state=new.opt_state if algorithm.start.averaged else None
        )
        return new, metrics, states_C

    return jax.jit(round_fn, donate_argnums=(0,))
