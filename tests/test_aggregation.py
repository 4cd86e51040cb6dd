"""``fed.aggregation``: the server's mean weighted by the clients' example counts (McMahan et al.
2017, Alg. 1) against float64 NumPy transcriptions, on every execution strategy."""

import fed_problems as fp
import jax
import numpy as np
import pytest

from fedorth import fed
from fedorth.fed.privacy import ClientDP

N, S, K, R = 6, 4, 3, 3
LR = 0.05
SIZES = np.array([3, 40, 7, 1, 12, 25])

pytestmark = pytest.mark.usefixtures("x64")


def _data(seed=2, sizes=SIZES):
    data = fp.quadratic_clients(N, seed=seed)
    data["client_size"] = np.asarray(sizes, np.int32)
    return data


def _run(alg, data, *, strategy="auto", chunk_size=None, aggregation="examples", rounds=R):
    server, _ = fp.run_rounds(
        alg,
        data,
        rounds=rounds,
        num_clients=N,
        clients_per_round=S,
        local_steps=K,
        learning_rate=LR,
        strategy=strategy,
        chunk_size=chunk_size,
        aggregation=aggregation,
    )
    return server


def _local_sgd(data, i, w, b):
    yw, yb = w.copy(), b.copy()
    for _ in range(K):
        gw, gb = fp.np_grads(data, i, yw, yb)
        yw, yb = yw - LR * gw, yb - LR * gb
    return yw - w, yb - b


def _weighted(values, weights):
    return sum(n * v for n, v in zip(weights, values, strict=True)) / np.sum(weights)


STRATEGIES = [
    ("vmap", None),
    ("sequential", None),
    ("chunked", 3),  # one chunk of 3 and a remainder of 1
    pytest.param("sharded", None, marks=pytest.mark.cpu_devices),
]


@pytest.mark.parametrize("strategy,chunk_size", STRATEGIES)
def test_examples_weighted_fedavg_matches_mcmahan_alg1(strategy, chunk_size):
    """FedAvg, ``w <- w + sum_k n_k Delta_k / sum_k n_k`` over the sampled clients."""
    data = _data()
    alg = fed.get_algorithm("fedavg", {"name": "sgd"})
    server = _run(alg, data, strategy=strategy, chunk_size=chunk_size)
    w, b = np.zeros((4, 3)), np.zeros(3)
    for r in range(R):
        ids = fp.sampled_ids(jax.random.key(0), r, N, S)
        deltas = [_local_sgd(data, i, w, b) for i in ids]
        n = SIZES[ids]
        w = w + _weighted([d[0] for d in deltas], n)
        b = b + _weighted([d[1] for d in deltas], n)
    np.testing.assert_allclose(server.params["w"], w, rtol=1e-11, atol=1e-13, err_msg=strategy)
    np.testing.assert_allclose(server.params["b"], b, rtol=1e-11, atol=1e-13, err_msg=strategy)
    uniform = _run(alg, data, strategy=strategy, chunk_size=chunk_size, aggregation="uniform")
    assert np.abs(np.asarray(uniform.params["w"]) - w).max() > 1e-3, "the weights must show"


def test_examples_weighted_fedadam_steps_from_the_weighted_mean():
    """FedAdam (Reddi et al. 2021, Alg. 2) steps its server Adam from the weighted ``Delta_t``."""
    slr, sb1, sb2, tau = 0.05, 0.9, 0.99, 1e-3
    data = _data(seed=5)
    alg = fed.get_algorithm(
        "fedadam", {"name": "sgd"}, server_lr=slr, server_b1=sb1, server_b2=sb2, server_tau=tau
    )
    server = _run(alg, data, strategy="sequential")
    x = {"w": np.zeros((4, 3)), "b": np.zeros(3)}
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v = {k: np.zeros_like(a) for k, a in x.items()}
    for r in range(R):
        ids = fp.sampled_ids(jax.random.key(0), r, N, S)
        deltas = [_local_sgd(data, i, x["w"], x["b"]) for i in ids]
        delta = {
            "w": _weighted([d[0] for d in deltas], SIZES[ids]),
            "b": _weighted([d[1] for d in deltas], SIZES[ids]),
        }
        for k in x:
            m[k] = sb1 * m[k] + (1 - sb1) * delta[k]
            v[k] = sb2 * v[k] + (1 - sb2) * delta[k] ** 2
            x[k] = x[k] + slr * m[k] / (np.sqrt(v[k]) + tau)
    for k in x:
        np.testing.assert_allclose(server.params[k], x[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_examples_weighted_scaffold_keeps_its_control_variate_uniform_over_n():
    """SCAFFOLD (Karimireddy et al. 2020, Alg. 1, option II): ``x`` takes the example-weighted
    mean of the updates; ``c <- c + (1/N) sum_{i in S} (c_i^+ - c_i)`` stays an average over all
    ``N`` clients."""
    data = _data(seed=1)
    server = _run(fed.get_algorithm("scaffold", {"name": "sgd"}), data, strategy="vmap")
    w, b, c, _ = fp.np_scaffold(
        data, rounds=R, num_clients=N, clients_per_round=S, local_steps=K, lr=LR, sizes=SIZES
    )
    np.testing.assert_allclose(server.params["w"], w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(server.control["w"], c[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(server.control["b"], c[1], rtol=1e-10, atol=1e-12)


def test_equal_example_counts_give_the_uniform_bytes():
    """With equal counts every weight is exactly 1: the same bytes as ``"uniform"``."""
    data = _data(sizes=[9] * N)
    alg = fed.get_algorithm("fedavg", {"name": "sgd", "momentum": 0.5})
    got = _run(alg, data, strategy="sequential")
    want = _run(alg, data, strategy="sequential", aggregation="uniform")
    for k in want.params:
        np.testing.assert_array_equal(got.params[k], want.params[k])


@pytest.mark.parametrize(
    "name,optim,options,match",
    [
        ("fedavg", {"name": "sgd"}, {"privacy": ClientDP(0.1, 1.0, float(S))}, "fixed denominator"),
        ("feddyn", {"name": "sgd"}, {}, "combines the clients' updates"),
        ("fedpac_soap", {"name": "soap"}, {}, "own rule"),
        ("fedavg", {"name": "sgd"}, {"aggregation": "median"}, "valid: "),
    ],
)
def test_conflicting_aggregation_is_refused_in_one_line(name, optim, options, match):
    alg = fed.get_algorithm(name, optim)
    config = fed.RoundConfig(N, S, K, LR, **{"aggregation": "examples", **options})
    with pytest.raises(ValueError, match=match) as info:
        config.validate(alg)
    assert "\n" not in str(info.value) and "fed.aggregation" in str(info.value)


def test_examples_without_client_sizes_names_the_key():
    data = fp.quadratic_clients(N)
    with pytest.raises(ValueError, match="no client_size") as info:
        _run(fed.get_algorithm("fedavg", {"name": "sgd"}), data, rounds=1)
    assert "\n" not in str(info.value)
