"""Partitioners: coverage, label skew on histograms, reproducibility, positive ratios, errors."""

import numpy as np
import pytest

from fedorth.data import partition as P

# 10 classes of unequal sizes (the digits' class counts): 1797 labels.
CLASS_COUNTS = np.array([178, 182, 177, 183, 181, 182, 181, 179, 174, 180])
LABELS = np.random.default_rng(123).permutation(np.repeat(np.arange(10), CLASS_COUNTS))


def _assert_exact_cover(parts, num_examples):
    """Every example in exactly one client."""
    joined = np.sort(np.concatenate(parts))
    np.testing.assert_array_equal(joined, np.arange(num_examples), err_msg="not an exact cover")


def _same(parts_a, parts_b):
    return len(parts_a) == len(parts_b) and all(
        np.array_equal(a, b) for a, b in zip(parts_a, parts_b, strict=True)
    )


def test_label_histogram_matches_a_loop():
    parts = P.iid(LABELS, 7, seed=0)
    hist = P.label_histogram(parts, LABELS, 10)
    expected = np.zeros((7, 10), np.int64)
    for i, idx in enumerate(parts):
        for j in idx:
            expected[i, LABELS[j]] += 1
    np.testing.assert_array_equal(hist, expected)
    np.testing.assert_array_equal(hist.sum(0), CLASS_COUNTS)


def test_iid_exact_cover_and_balanced_sizes():
    parts = P.iid(LABELS, 13, seed=0)
    _assert_exact_cover(parts, LABELS.size)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1, sizes


@pytest.mark.parametrize("alpha", [0.05, 1.0, 100.0])
def test_dirichlet_label_split_exact_cover(alpha):
    parts = P.dirichlet_label_split(LABELS, 10, seed=3, alpha=alpha)
    assert len(parts) == 10
    _assert_exact_cover(parts, LABELS.size)


def test_dirichlet_label_split_large_alpha_is_close_to_iid():
    # α = 1e5: p_c,i has std sqrt((1/N)(1−1/N)/(Nα+1)) ≈ 3e-4, i.e. 0.06 examples of a class of
    # ~180; the floor at both cut points moves a slice by at most 1. So every count is within
    # 1 + 6σ ≈ 1.4 of M_c/N: we allow 2.
    parts = P.dirichlet_label_split(LABELS, 10, seed=0, alpha=1e5)
    hist = P.label_histogram(parts, LABELS, 10)
    assert np.abs(hist - CLASS_COUNTS[None, :] / 10).max() <= 2.0, hist


def test_dirichlet_label_split_small_alpha_concentrates_labels():
    # With α = 0.01 and N = 10, Dir(α·1_N) puts almost all mass on one coordinate: the largest
    # client share of a class is > 0.9 with probability ≈ 0.9 per class, versus 1/N ≈ 0.1 for IID
    # (α = 1e5 above). Averaged over the 10 classes we require > 0.8 (a fixed seed: deterministic).
    parts = P.dirichlet_label_split(LABELS, 10, seed=0, alpha=0.01)
    hist = P.label_histogram(parts, LABELS, 10)
    max_share = hist.max(axis=0) / CLASS_COUNTS
    assert max_share.mean() > 0.8, max_share
    parts_iid = P.dirichlet_label_split(LABELS, 10, seed=0, alpha=1e5)
    share_iid = P.label_histogram(parts_iid, LABELS, 10).max(axis=0) / CLASS_COUNTS
    assert share_iid.max() < 0.12, share_iid


def test_dirichlet_label_split_min_size_redraw():
    parts = P.dirichlet_label_split(LABELS, 20, seed=0, alpha=0.2, min_size=20)
    assert min(p.size for p in parts) >= 20
    _assert_exact_cover(parts, LABELS.size)
    # The first draw (the unconstrained result for this seed) has a client below 20 examples, so
    # the re-draw actually happened.
    unconstrained = P.dirichlet_label_split(LABELS, 20, seed=0, alpha=0.2)
    assert min(p.size for p in unconstrained) < 20
    with pytest.raises(ValueError, match="min_size"):
        P.dirichlet_label_split(LABELS, 50, seed=0, alpha=0.01, min_size=35, max_redraws=3)


def test_dirichlet_client_mix_sizes_skew_and_reuse_rule():
    size = 150
    parts = P.dirichlet_client_mix(LABELS, 12, seed=0, alpha=0.05, client_size=size)
    assert all(p.size == size for p in parts)
    hist = P.label_histogram(parts, LABELS, 10)
    # Small α: each client is dominated by few classes (IID would give a max share ≈ 0.1 + noise).
    assert (hist.max(axis=1) / size).mean() > 0.7, hist
    # No client holds a duplicate: every n_{i,c} <= 150 < M_c (rule in the docstring).
    assert all(np.unique(p).size == p.size for p in parts)
    # Without replacement until a class pool is exhausted: class c's examples in use are exactly
    # min(total demand D_c, M_c) distinct ones.
    used = np.concatenate(parts)
    for c in range(10):
        demand = hist[:, c].sum()
        distinct = np.unique(used[LABELS[used] == c]).size
        assert distinct == min(demand, CLASS_COUNTS[c]), (c, demand, distinct)
    assert any(hist[:, c].sum() > CLASS_COUNTS[c] for c in range(10)), "no pool was exhausted"


def test_dirichlet_client_mix_large_alpha_is_balanced():
    # α = 1e5: q_i ≈ uniform, so H[i, c] ~ Binomial(100, 0.1): std 3; 6σ = 18.
    parts = P.dirichlet_client_mix(LABELS, 10, seed=1, alpha=1e5, client_size=100)
    hist = P.label_histogram(parts, LABELS, 10)
    assert np.abs(hist - 10).max() <= 18, hist
    # N·n = 1000 < every class's demand cap here: no example is shared across clients.
    used = np.concatenate(parts)
    assert np.unique(used).size == used.size


def test_dirichlet_client_mix_default_size():
    parts = P.dirichlet_client_mix(LABELS, 7, seed=0, alpha=1.0)
    assert all(p.size == LABELS.size // 7 for p in parts)


BINARY = np.random.default_rng(5).permutation(np.repeat([0, 1], [3000, 2600]))


def test_positive_ratio_heterogeneous_fed_minimax():
    ratios = P.FED_MINIMAX_HETEROGENEOUS_RATIOS
    parts = P.positive_ratio(BINARY, 8, seed=0, ratios=ratios)
    joined = np.concatenate(parts)
    assert np.unique(joined).size == joined.size, "clients overlap"
    for r, idx in zip(ratios, parts, strict=True):
        positives = int(BINARY[idx].sum())
        assert abs(positives - r * idx.size) <= 1.0, (r, positives, idx.size)
    # Enough positives: all negatives are kept and only positives are dropped.
    assert (BINARY[joined] == 0).sum() == 3000


def test_positive_ratio_homogeneous_and_scarce_positives():
    parts = P.positive_ratio(BINARY, 4, seed=0, ratios=0.1)
    for idx in parts:
        assert abs(BINARY[idx].sum() - 0.1 * idx.size) <= 1.0
    # 200 positives cannot give 25% of 3000 negatives: negatives are dropped to keep the ratios.
    scarce = np.concatenate([np.zeros(3000, np.int64), np.ones(200, np.int64)])
    parts = P.positive_ratio(scarce, 4, seed=0, ratios=0.25)
    for idx in parts:
        assert abs(scarce[idx].sum() - 0.25 * idx.size) <= 1.0, (scarce[idx].sum(), idx.size)
    assert sum(scarce[idx].sum() for idx in parts) <= 200


def test_positive_ratio_errors():
    with pytest.raises(ValueError, match="binary"):
        P.positive_ratio(LABELS, 8, seed=0, ratios=0.1)
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        P.positive_ratio(BINARY, 2, seed=0, ratios=1.0)
    with pytest.raises(ValueError, match="num_clients=3"):
        P.positive_ratio(BINARY, 3, seed=0, ratios=(0.1, 0.2))


def test_natural_groups():
    groups = np.random.default_rng(0).integers(0, 25, LABELS.size)
    parts = P.natural(LABELS, 25, seed=0, groups=groups)
    _assert_exact_cover(parts, LABELS.size)
    for idx in parts:
        assert np.unique(groups[idx]).size == 1
    subset = P.natural(LABELS, 5, seed=0, groups=groups.astype(str))
    kept = {groups[idx[0]] for idx in subset}
    assert len(kept) == 5
    assert all(np.unique(groups[idx]).size == 1 for idx in subset)
    with pytest.raises(ValueError, match=r"\[1, 25\]"):
        P.natural(LABELS, 26, seed=0, groups=groups)


PARTITIONER_CASES = [
    ("iid", LABELS, {}),
    ("dirichlet_label_split", LABELS, {"alpha": 0.5}),
    ("dirichlet", LABELS, {"alpha": 0.5}),
    ("dirichlet_client_mix", LABELS, {"alpha": 0.5}),
    ("positive_ratio", BINARY, {"ratios": 0.1}),
    ("natural", LABELS, {"groups": np.arange(LABELS.size) % 30}),
]


@pytest.mark.parametrize(("name", "labels", "kwargs"), PARTITIONER_CASES)
def test_reproducible_from_seed(name, labels, kwargs):
    a = P.partition(name, labels, 8, seed=7, **kwargs)
    b = P.partition(name, labels, 8, seed=7, **kwargs)
    c = P.partition(name, labels, 8, seed=8, **kwargs)
    assert _same(a, b), "same seed must give the same partition"
    assert not _same(a, c), "different seeds must give different partitions"
    assert len(a) == 8 and all(p.dtype == np.int64 for p in a)


def test_registry_errors():
    with pytest.raises(ValueError, match=r"Unknown partition 'dirichlet_x'.*'iid'"):
        P.partition("dirichlet_x", LABELS, 4, seed=0)
    for alpha in (0.0, -1.0):
        with pytest.raises(ValueError, match="alpha"):
            P.partition("dirichlet_label_split", LABELS, 4, seed=0, alpha=alpha)
        with pytest.raises(ValueError, match="alpha"):
            P.partition("dirichlet_client_mix", LABELS, 4, seed=0, alpha=alpha)
    for num_clients in (0, LABELS.size + 1):
        with pytest.raises(ValueError, match="num_clients"):
            P.partition("iid", LABELS, num_clients, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        P.iid(LABELS.reshape(-1, 1), 2, seed=0)


# -------------------------------------------- the two Dirichlet schemes against their laws


def _dirichlet_moments(k: int, alpha: float) -> tuple[float, float]:
    """Mean and variance of one coordinate of ``Dir(alpha 1_k)``."""
    return 1.0 / k, (1.0 / k) * (1.0 - 1.0 / k) / (k * alpha + 1.0)


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_dirichlet_label_split_shares_follow_dir_alpha_over_clients(alpha):
    """``dirichlet`` (the per-class split): the share of class ``c`` held by client ``i`` is a
    coordinate of ``p_c ~ Dir(alpha 1_N)`` (up to the floor of ``M_c p``): over 60 draws of 10
    classes of 5000 examples on 8 clients, its mean is 1/N and its variance
    (1/N)(1 - 1/N)/(N alpha + 1) (float64 NumPy, within 4 standard errors)."""
    n, c, m_c, draws = 8, 10, 5000, 60
    labels = np.repeat(np.arange(c), m_c)
    shares = []
    for seed in range(draws):
        hist = P.label_histogram(
            P.partition("dirichlet", labels, n, seed=seed, alpha=alpha), labels, c
        )
        shares.append(hist / m_c)  # [N, C]: fraction of each class on each client
    x = np.asarray(shares, np.float64).ravel()
    mean, var = _dirichlet_moments(n, alpha)
    assert abs(x.mean() - mean) < 1e-12  # the shares of a class sum to 1 over the clients
    # The variance's standard error, from the fourth central moment of the sample.
    se_var = np.sqrt(np.mean((x - x.mean()) ** 4) / x.size)
    assert abs(x.var() - var) < 4 * se_var, (x.var(), var)


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_dirichlet_hsu_class_mix_follows_dir_alpha_over_classes(alpha):
    """``dirichlet_hsu`` (Hsu et al. 2019, the papers' "Dir-alpha"): client ``i``'s class
    fractions are ``Multinomial(n, q_i) / n`` with ``q_i ~ Dir(alpha 1_C)``: mean 1/C and
    variance (1/C)(1 - 1/C)[1/(C alpha + 1) + C alpha / ((C alpha + 1) n)] (float64 NumPy over
    400 clients of 200 examples, within 4 standard errors); every client holds n examples."""
    n_clients, c, size = 400, 10, 200
    labels = np.repeat(np.arange(c), 4000)
    parts = P.partition("dirichlet_hsu", labels, n_clients, seed=3, alpha=alpha, client_size=size)
    assert all(p.size == size for p in parts)
    x = (P.label_histogram(parts, labels, c) / size).astype(np.float64).ravel()
    k = c * alpha
    mean = 1.0 / c
    var = mean * (1 - mean) * (1.0 / (k + 1.0) + k / ((k + 1.0) * size))
    se_var = np.sqrt(np.mean((x - x.mean()) ** 4) / x.size)
    assert abs(x.mean() - mean) < 1e-12  # fractions sum to 1 per client
    assert abs(x.var() - var) < 4 * se_var, (x.var(), var)
    assert P.PARTITIONERS["dirichlet_hsu"] is P.dirichlet_client_mix
    assert P.PARTITIONERS["dirichlet"] is P.dirichlet_label_split


def test_dirichlet_hsu_docstrings_state_alpha_per_class_not_hsus_total():
    """The law above is ``Dir(alpha 1_C)``: alpha per class. Hsu et al.'s ``Dir(alpha' p)``
    (p the uniform prior) is the same law only for ``alpha' = C alpha``; the docstrings say
    which alpha the code takes, and do not equate ``Dir(alpha p)`` with ``Dir(alpha 1_C)``."""
    for doc in (P.__doc__, P.dirichlet_client_mix.__doc__):
        text = " ".join(doc.split())
        assert "α' = C·α" in text or "Hsu's ``α' / C``" in text, text[:300]
        assert "we draw q ~ Dir(αp)" not in text
