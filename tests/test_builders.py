"""What ``fedorth.train.builders.build`` makes of a config: the seed sets the partition, the
initialization and the samples; the rounds of the algorithms with decompositions call no XLA:CPU
LAPACK kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from reliability_helpers import (
    apply,
    cache_every_program,  # noqa: F401 -- an autouse fixture
    soap_config,
    tiny_config,
)

from fedorth import data as data_lib
from fedorth import fed
from fedorth.train import builders


def test_different_seeds_give_different_partitions_inits_and_samples():
    def parts(seed):
        config = tiny_config(**{"seed": seed, "data.num_clients": 20, "fed.clients_per_round": 5})
        experiment = builders.build(config)
        server = builders.init_server(experiment)
        _, ids = fed.round.sample_clients(server.key, jnp.int32(0), 20, 5)
        batch = data_lib.sample_batch(experiment.data, 0, jax.random.fold_in(server.key, 0), 32)
        return experiment.data, experiment.init_params, ids, batch

    (d1, p1, ids1, b1), (d2, p2, ids2, b2) = parts(1), parts(2)
    assert not np.array_equal(d1.client_index, d2.client_index), "partitions"
    assert not np.array_equal(p1["Dense_0"]["kernel"], p2["Dense_0"]["kernel"]), "inits"
    assert not np.array_equal(ids1, ids2), "sampled clients"
    assert not np.array_equal(b1["x"], b2["x"]), "mini-batches"
    # ... and the same seed gives the same ones.
    d3, p3, ids3, b3 = parts(1)
    np.testing.assert_array_equal(d1.client_index, d3.client_index)
    np.testing.assert_array_equal(p1["Dense_0"]["kernel"], p3["Dense_0"]["kernel"])
    np.testing.assert_array_equal(ids1, ids3)
    np.testing.assert_array_equal(b1["x"], b3["x"])


def test_round_after_checkpoint_cannot_hang_in_batched_lapack():
    """Regression: the main job hung forever right after a checkpoint (round 41).

    Cause (gdb on a reproduction with checkpoint_every=1): not orbax or donation, but the two
    XLA:CPU intra-op threads both inside ``lapack_sgeqrf_ffi`` -> ``jax::ParallelBatchMap``,
    each waiting for batch chunks queued on the same, fully blocked pool (SOAP's vmapped QR basis
    refresh). Fixed in fedorth.optim.linalg (host LAPACK on CPU); here the compiled rounds of the
    algorithms with decompositions must contain no LAPACK custom call.
    """
    for overrides in ({}, {"fed.algorithm": "fedpac_soap_light"}):
        experiment = builders.build(apply(soap_config(), overrides))
        server = builders.init_server(experiment)
        text = experiment.round_fn.lower(server, experiment.data).as_text()
        assert "lapack" not in text, f"{overrides}: the round calls XLA:CPU's LAPACK kernels"
    # The check can see them: a vmapped jnp QR lowers to the (deadlock-prone) batched kernel.
    native = jax.jit(jax.vmap(jnp.linalg.qr)).lower(jnp.ones((2, 4, 4))).as_text()
    assert "lapack" in native
