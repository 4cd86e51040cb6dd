"""The ``jax_loop`` peer of the round benchmark: Python loops around one jitted local step
(the engine's own ``fed.client.local_step``).

What a JAX user writes without fedorth's engine: for each sampled client, for each local step,
one jitted call, then a jitted server update. It runs the engine's algorithm, not a copy of it:
the server state is `fed.init_server`'s, the clients and keys are the engine's
(`sample_clients`, ``fold_in(round_key, client)``, then ``fold_in(client_key, step)`` split
into batch, model and optimizer keys), the local optimizer is the algorithm's ``local_tx``, a
client's start is its client-start spec's (``fedorth.fed.start``: a warm start keeps the leaves
of ``Global.mask``, FedPAC's Θ, FedLADA's second moment, and restarts the others), the optimizer
states are averaged by `fedorth.optim.federated.average_states` and the server step is the
server-update spec's (``fedorth.fed.update``: its optimizer and rule); `unsupported` names the
design-axis values it does not implement.
tests/test_bench.py runs the bench's algorithms and each other path of the loop for 3 rounds
against ``fed.make_round_fn`` and requires the two to agree to float32 rounding.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.measure import compile_counter
from experiments.bench.workloads import Case, build_model
from fedorth import fed
from fedorth.fed import client as fed_client
from fedorth.fed.context import begin_round, sample_clients
from fedorth.optim import federated as fed_optim


def unsupported(algorithm: fed.FedAlgorithm) -> str | None:
    """Why the loop cannot run `algorithm` (a design-axis value it does not implement), or None."""
    start, corrections = algorithm.start, algorithm.corrections
    checks = {
        "clients that keep their own state": start.name == "persistent",
        "per-client kept leaves": getattr(start, "keep", None) is not None,
        "control variates": corrections.control is not None,
        "client reports": algorithm.report is not None,
        "a client pre-pass": corrections.prepass is not None,
        "a custom delta aggregation": algorithm.server.combine is not None,
        "low-rank state compression": getattr(start, "compression", None) is not None,
    }
    missing = [what for what, needed in checks.items() if needed]
    return f"jax_loop does not implement {', '.join(missing)}" if missing else None


def server_update(algorithm: fed.FedAlgorithm, ctx: fed.RoundContext, results_C):
    """The next server state from the sampled clients' final ``(params, model_state,
    opt_state)``, client-stacked, through the algorithm's axes: the mean update through its
    server update (``algorithm.server``), the averaged model state, the averaged optimizer
    state where clients warm-start from it (``algorithm.start``), its server quantities and the
    corrections' ``g_G`` (``algorithm.corrections``)."""
    params_C, model_state_C, opt_state_C = results_C
    server = ctx.server
    mean_delta = jax.tree.map(lambda p, p0: jnp.mean(p, 0) - p0, params_C, server.params)
    params, server_opt_state = algorithm.server.step(ctx, mean_delta)
    new = server.replace(
        round=server.round + 1,
        params=params,
        model_state=jax.tree.map(lambda x: jnp.mean(x, 0), model_state_C),
        server_opt_state=server_opt_state,
    )
    if algorithm.start.averaged:
        read = algorithm.start.read_mask(opt_state_C)  # what the next round's clients read
        new = new.replace(opt_state=fed_optim.average_states(opt_state_C, read))
    if algorithm.quantities is not None:
        new = new.replace(extra=algorithm.quantities.update(ctx, new, {}))
    return algorithm.corrections.server_update(ctx, new, {}, mean_delta)


class JaxLoopRound:
    """``round(server, data) -> server``: one round, Python loops around jitted pieces.

    The same arguments as ``fed.make_round_fn`` (the strategy of `config` is not used).
    """

    def __init__(self, algorithm: fed.FedAlgorithm, loss_fn, batch_fn, config: fed.RoundConfig):
        why = unsupported(algorithm)
        if why is not None:
            raise ValueError(f"{why} ({algorithm.name}).")
        config.validate(algorithm)
        self.algorithm, self.config = algorithm, config
        tx = algorithm.local_tx

        def extras(server):
            """The local optimizer's extra arguments for this round."""
            ctx = begin_round(server, config)
            out = {**server.extra, "learning_rate": ctx.learning_rate, "round_context": ctx}
            if algorithm.corrections.global_direction:
                out["global_direction"] = server.global_direction
            return out

        def local_step(params, model_state, opt_state, extras, data, client, client_key, step):
            """The engine's own step (fed.client.local_step), jitted alone."""
            carry = (params, model_state, opt_state)
            args = (tx, loss_fn, batch_fn, data, client, client_key, extras, carry, step)
            return fed_client.local_step(*args)[0]

        def finish(server, results):
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *results)
            return server_update(algorithm, begin_round(server, config), stacked)

        def start(server):
            return algorithm.start.client_start(tx, begin_round(server, config), None)

        # The start axis: a client's state at round start, and what it uploads at the end.
        self.start = jax.jit(start)
        self.end = jax.jit(lambda opt_state: algorithm.start.client_end(opt_state)[0])
        self.extras = jax.jit(extras)
        self.local_step = jax.jit(local_step)
        self.finish = jax.jit(finish)

    def __call__(self, server: fed.ServerState, data) -> fed.ServerState:
        config = self.config
        round_key, ids = sample_clients(
            server.key, server.round, config.num_clients, config.clients_per_round
        )
        extras, opt_state = self.extras(server), self.start(server)
        results = []
        for client in np.asarray(ids):
            client_key = jax.random.fold_in(round_key, client)
            carry = (server.params, server.model_state, opt_state)
            for step in range(config.local_steps):
                carry = self.local_step(*carry, extras, data, client, client_key, step)
            params, model_state, opt_state_k = carry
            results.append((params, model_state, self.end(opt_state_k)))
        return self.finish(server, results)


class JaxLoopRunner:
    """The ``jax_loop`` row of a case: `JaxLoopRound` on the case's model and data."""

    kind = "jax_loop"

    def __init__(self, case: Case, data, fed_data, *, conv_impl):
        self.case, self.fed_data = case, fed_data
        self.settings = {"strategy": "python loop", "conv_impl": conv_impl, "unroll": "-"}
        model = build_model(case.workload, conv_impl, case.dtype)
        algorithm = case.fed_algorithm()
        config = fed.RoundConfig(
            num_clients=case.num_clients,
            clients_per_round=case.clients_per_round,
            local_steps=case.local_steps,
            learning_rate=case.optim["learning_rate"],
        )
        self.round = JaxLoopRound(algorithm, model.loss_fn, case.batch_fn, config)
        params, model_state = model.init(jax.random.key(0), data[0][:2])
        self.server = fed.init_server(
            algorithm, params, model_state, num_clients=case.num_clients, key=jax.random.key(1)
        )

    def run(self) -> float:
        start = time.perf_counter()
        self.server = self.round(self.server, self.fed_data)
        jax.block_until_ready(self.server)
        return time.perf_counter() - start

    def warmup(self) -> dict[str, Any]:
        seconds0 = compile_counter()[1]
        first = self.run()
        return {"first_round_s": first, "compile_s": compile_counter()[1] - seconds0}

    def finish(self) -> dict[str, Any]:
        return {}
