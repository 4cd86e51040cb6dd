"""Partitioners: split a labelled training set across federated clients.

Every partitioner has the signature ``fn(labels, num_clients, *, seed, **kwargs)`` and returns a
list of ``num_clients`` int64 index arrays into ``labels`` (one per client, in client order). All
are reproducible from ``seed`` (a NumPy ``default_rng``) and independent of global random state.

Choose one by name with :func:`partition` (registry :data:`PARTITIONERS`):

* ``iid``: a uniform random split into near-equal parts.
* ``dirichlet_label_split`` (alias ``dirichlet``): each class is split across the clients with
  proportions ``p_c ~ Dir(α·1_N)`` (Yurochkin et al. 2019; Wang et al. 2020, FedMA; the
  NIID-Bench benchmark of Li et al. 2022). Every example goes to exactly one client; client sizes
  vary. The default (embedded-data) configs use it.
* ``dirichlet_client_mix`` (alias ``dirichlet_hsu``): Hsu et al. 2019's scheme — each client
  draws its class mix ``q_i ~ Dir(α·1_C)`` (α per class: Hsu's ``Dir(α'p)`` with a uniform prior
  ``p`` and ``α' = C·α``) and a fixed number of examples from the class pools. This is
  the scheme all four papers cite for "Dir-α" (FedMuon (Liu et al.), FedMuon-LMO, FedMuon (Zhang &
  Gao), FedPAC (Liu et al.): "we follow the Dirichlet partitioning scheme (Hsu et al., 2019)") and
  the one FedMuon (Liu et al.)'s and FedPAC's authors' released code runs
  (``data_from_dirichlet``: per-client Dirichlet class weights, 500 examples per client on CIFAR),
  so the papers' presets use it. Equal client sizes; examples are reused across clients once a
  class pool is exhausted (rule in its docstring).
* ``positive_ratio``: binary labels, per-client positive-class ratios (Fed minimax (Zhang & Gao)'s
  imbalanced AUC experiments), dropping the positives that are not needed.
* ``natural``: one client per user/writer id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "PARTITIONERS",
    "dirichlet_client_mix",
    "dirichlet_label_split",
    "iid",
    "label_histogram",
    "natural",
    "partition",
    "positive_ratio",
]

# Fed minimax (Zhang & Gao) §6, heterogeneous setting: positive ratios of its eight clients.
FED_MINIMAX_HETEROGENEOUS_RATIOS = (0.05, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25)


def _check_labels(labels) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}.")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}.")
    return labels


def _check_num_clients(num_clients, num_examples: int) -> int:
    if int(num_clients) != num_clients or not 1 <= num_clients <= num_examples:
        raise ValueError(
            f"num_clients must be an integer in [1, {num_examples}] (the number of examples), "
            f"got {num_clients}."
        )
    return int(num_clients)


def _check_alpha(alpha) -> float:
    if not np.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha (the Dirichlet concentration) must be > 0, got {alpha}.")
    return float(alpha)


def label_histogram(partition: Sequence[np.ndarray], labels, num_classes: int) -> np.ndarray:
    """Per-client label counts ``H[i, c] = #{j in partition[i] : labels[j] = c}``.

    Args:
      partition: list of index arrays, one per client.
      labels: ``[M]`` integer labels.
      num_classes: number of classes ``C`` (labels must lie in ``[0, C)``).

    Returns:
      ``[N, C]`` int64 array of counts.
    """
    labels = _check_labels(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, num_classes={num_classes}), "
            f"got range [{labels.min()}, {labels.max()}]."
        )
    return np.stack(
        [np.bincount(labels[np.asarray(idx)], minlength=num_classes) for idx in partition]
    ).astype(np.int64)


def iid(labels, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """Uniform random split into ``num_clients`` parts whose sizes differ by at most one.

    Args:
      labels: ``[M]`` labels (only their number is used).
      num_clients: number of clients ``N``, ``1 <= N <= M``.
      seed: NumPy seed.

    Returns:
      ``N`` disjoint index arrays covering ``range(M)``.
    """
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, labels.size)
    perm = np.random.default_rng(seed).permutation(labels.size)
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm, num_clients)]


def dirichlet_label_split(
    labels,
    num_clients: int,
    *,
    seed: int,
    alpha: float,
    min_size: int = 0,
    max_redraws: int = 1000,
) -> list[np.ndarray]:
    """Dirichlet label skew by splitting each class across clients (Yurochkin et al. 2019).

    For each class ``c`` with examples ``I_c`` (shuffled): ``p_c ~ Dir(α·1_N)``, and client ``i``
    gets the slice ``I_c[⌊M_c·P_{c,i−1}⌋ : ⌊M_c·P_{c,i}⌋]`` with ``P_c`` the cumulative sum of
    ``p_c``.
    Every example is assigned to exactly one client. ``α → ∞`` tends to an IID split with equal
    expected sizes; ``α → 0`` gives each class to a single client. Not the papers' "Dir-α"
    (:func:`dirichlet_client_mix` is): the default configs' split.

    With ``min_size > 0`` the whole draw is repeated (with fresh randomness from the same stream)
    until every client holds at least ``min_size`` examples, the usual rule in FL code bases
    (e.g. NIID-Bench); this conditions the distribution on that event. No other rebalancing is done.

    Args:
      labels: ``[M]`` integer class labels.
      num_clients: number of clients ``N``.
      seed: NumPy seed.
      alpha: Dirichlet concentration ``α > 0``.
      min_size: smallest client size accepted (0 accepts empty clients).
      max_redraws: how many draws to try before raising.

    Returns:
      ``N`` disjoint index arrays (sorted) whose union is ``range(M)``.
    """
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, labels.size)
    alpha = _check_alpha(alpha)
    if min_size < 0 or min_size * num_clients > labels.size:
        raise ValueError(
            f"min_size must be in [0, M/N = {labels.size // num_clients}], got {min_size}."
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_redraws):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx_c = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(num_clients, alpha))
            cuts = np.floor(np.cumsum(p)[:-1] * idx_c.size).astype(np.int64)
            for i, chunk in enumerate(np.split(idx_c, cuts)):
                parts[i].append(chunk)
        result = [np.sort(np.concatenate(chunks)).astype(np.int64) for chunks in parts]
        if min(r.size for r in result) >= min_size:
            return result
    raise ValueError(
        f"dirichlet_label_split: no draw in {max_redraws} gave every client >= min_size={min_size} "
        f"examples (alpha={alpha}, num_clients={num_clients}, M={labels.size}); lower min_size or "
        "num_clients, or raise alpha."
    )


def dirichlet_client_mix(
    labels,
    num_clients: int,
    *,
    seed: int,
    alpha: float,
    client_size: int | None = None,
) -> list[np.ndarray]:
    """Dirichlet label skew by drawing each client's class mix: ``q_i ~ Dir(α·1_C)`` (Hsu et al.).

    Hsu et al. 2019's scheme, in the parameterization of FedMuon (Liu et al.)'s and FedPAC's
    authors' released code (``data_from_dirichlet``), the "Dir-α" of the papers' presets: ``α``
    is the concentration of each class. Hsu et al. write ``q ~ Dir(α'p)`` with ``p`` the class
    prior and ``α'`` the total concentration; with the uniform prior ``p = 1_C / C`` that is
    ``Dir((α'/C)·1_C)``, so this ``α`` is Hsu's ``α' / C`` (``α = 0.1`` on CIFAR-100, ``C = 100``,
    is Hsu's ``α' = 10``). Client ``i`` draws
    ``n_i ~ Multinomial(client_size, q_i)`` class counts and takes ``n_{i,c}`` examples from class
    ``c``'s pool. Every client has ``client_size`` examples (default ``⌊M/N⌋``).

    Reuse rule (where the released code is loose, stated here): each class pool is a random
    permutation consumed without replacement across clients (in client order). When a pool is
    exhausted it is reshuffled and consumed again, so **an example can belong to several clients**
    once its class is oversubscribed; the reshuffle puts the examples the current client already
    took at the end, so a client holds no duplicates unless it asks for more than the class has
    (then each example appears at most ``⌈n_{i,c}/M_c⌉`` times in it). Classes absent from
    ``labels`` get probability zero (``q_i`` renormalised over the present classes).

    Args:
      labels: ``[M]`` integer class labels.
      num_clients: number of clients ``N``.
      seed: NumPy seed.
      alpha: Dirichlet concentration ``α > 0``.
      client_size: examples per client (default ``M // N``).

    Returns:
      ``N`` index arrays of length ``client_size`` (sorted; may overlap across clients, see above).
    """
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, labels.size)
    alpha = _check_alpha(alpha)
    if client_size is None:
        client_size = labels.size // num_clients
    if int(client_size) != client_size or client_size < 1:
        raise ValueError(f"client_size must be a positive integer, got {client_size}.")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    pointers = np.zeros(len(classes), dtype=np.int64)
    result = []
    for _ in range(num_clients):
        q = rng.dirichlet(np.full(len(classes), alpha))
        counts = rng.multinomial(int(client_size), q)
        taken = []
        for k, need in enumerate(counts):
            got: list[np.ndarray] = []
            while need > 0:
                if pointers[k] == pools[k].size:
                    fresh = rng.permutation(pools[k])
                    mine = np.isin(fresh, np.concatenate(got)) if got else np.zeros(0, bool)
                    if mine.size:
                        fresh = np.concatenate([fresh[~mine], fresh[mine]])
                    pools[k] = fresh
                    pointers[k] = 0
                step = min(need, pools[k].size - pointers[k])
                got.append(pools[k][pointers[k] : pointers[k] + step])
                pointers[k] += step
                need -= step
            taken.extend(got)
        result.append(np.sort(np.concatenate(taken)).astype(np.int64))
    return result


def positive_ratio(
    labels,
    num_clients: int,
    *,
    seed: int,
    ratios: float | Sequence[float] = FED_MINIMAX_HETEROGENEOUS_RATIOS,
    positive_label: int = 1,
) -> list[np.ndarray]:
    """Binary imbalance: client ``i`` holds a fraction ``r_i`` of positives (Fed minimax (Zhang &
    Gao), §6).

    The negatives are split IID into near-equal parts of sizes ``m_i``; client ``i`` then gets
    ``p_i = round(r_i·m_i/(1−r_i))`` positives, the integer closest to the solution of
    ``p = r_i·(p + m_i)``, so the realised ratio ``p_i/(p_i+m_i)`` is within half an example of
    ``r_i`` (``|p_i − r_i·(p_i+m_i)| ≤ (1−r_i)/2``). The remaining positives are dropped (Fed
    minimax (Zhang & Gao)
    "randomly drop positive samples"). If fewer positives exist than needed, every ``m_i`` is scaled
    down by the same factor first (negatives dropped) so that the ratios still hold.
    Fed minimax (Zhang & Gao)'s settings: homogeneous ``ratios=0.1``; heterogeneous
    ``ratios=(0.05, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25)`` for 8 clients (the default).

    Args:
      labels: ``[M]`` binary labels (0/1, or any two values with ``positive_label`` one of them).
      num_clients: number of clients ``N``.
      seed: NumPy seed.
      ratios: one ratio for all clients, or ``N`` ratios, each in ``(0, 1)``.
      positive_label: the label value counted as positive.

    Returns:
      ``N`` disjoint index arrays (sorted).
    """
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, labels.size)
    values = np.unique(labels)
    if values.size > 2 or positive_label not in values:
        raise ValueError(
            f"positive_ratio needs binary labels containing positive_label={positive_label}, "
            f"got label values {values.tolist()}."
        )
    if np.ndim(ratios) > 1 or (np.ndim(ratios) == 1 and len(ratios) != num_clients):
        raise ValueError(
            f"ratios must be a scalar or have num_clients={num_clients} entries, got {ratios}."
        )
    r = np.broadcast_to(np.asarray(ratios, dtype=np.float64), (num_clients,)).copy()
    if np.any((r <= 0) | (r >= 1)):
        raise ValueError(f"ratios must lie in (0, 1), got {r.tolist()}.")
    rng = np.random.default_rng(seed)
    pos = rng.permutation(np.flatnonzero(labels == positive_label))
    neg = rng.permutation(np.flatnonzero(labels != positive_label))
    neg_sizes = np.array([part.size for part in np.array_split(neg, num_clients)])
    need = np.rint(r * neg_sizes / (1 - r)).astype(np.int64)
    if need.sum() > pos.size:
        scale = pos.size / need.sum()
        neg_sizes = np.floor(neg_sizes * scale).astype(np.int64)
        need = np.rint(r * neg_sizes / (1 - r)).astype(np.int64)
        while need.sum() > pos.size:  # rounding up can overshoot by a few examples
            i = int(np.argmax(need))
            neg_sizes[i] -= 1
            need[i] = np.rint(r[i] * neg_sizes[i] / (1 - r[i]))
    if np.any(neg_sizes + need == 0):
        raise ValueError(
            f"positive_ratio: too few examples ({labels.size}) for {num_clients} clients with "
            f"ratios {r.tolist()}; some client would be empty."
        )
    neg_cuts, pos_cuts = np.cumsum(neg_sizes)[:-1], np.cumsum(need)[:-1]
    neg_parts = np.split(neg[: neg_sizes.sum()], neg_cuts)
    pos_parts = np.split(pos[: need.sum()], pos_cuts)
    return [
        np.sort(np.concatenate([n, p])).astype(np.int64)
        for n, p in zip(neg_parts, pos_parts, strict=True)
    ]


def natural(labels, num_clients: int, *, seed: int, groups) -> list[np.ndarray]:
    """One client per natural group (user, writer, device id).

    With ``G`` distinct ids: ``num_clients == G`` keeps every group; ``num_clients < G`` keeps a
    uniformly random subset of ``num_clients`` groups (the others' examples are dropped, as LEAF's
    user sampling does). Clients are ordered by a seeded shuffle of the kept ids.

    Args:
      labels: ``[M]`` labels (only their number is used).
      num_clients: number of clients, at most the number of distinct ids.
      seed: NumPy seed.
      groups: ``[M]`` id of each example's group (any sortable dtype).

    Returns:
      ``num_clients`` disjoint index arrays (sorted).
    """
    labels = _check_labels(labels)
    groups = np.asarray(groups)
    if groups.shape != labels.shape:
        raise ValueError(f"groups must have shape {labels.shape} like labels, got {groups.shape}.")
    ids, inverse = np.unique(groups, return_inverse=True)
    if int(num_clients) != num_clients or not 1 <= num_clients <= ids.size:
        raise ValueError(
            f"num_clients must be an integer in [1, {ids.size}] (the number of distinct groups), "
            f"got {num_clients}."
        )
    chosen = np.random.default_rng(seed).permutation(ids.size)[: int(num_clients)]
    order = np.argsort(inverse, kind="stable")
    starts = np.searchsorted(inverse[order], np.arange(ids.size + 1))
    return [np.sort(order[starts[g] : starts[g + 1]]).astype(np.int64) for g in chosen]


PartitionFn = Callable[..., list[np.ndarray]]

PARTITIONERS: dict[str, PartitionFn] = {
    "iid": iid,
    "dirichlet_label_split": dirichlet_label_split,
    "dirichlet": dirichlet_label_split,  # the per-class split (the default configs')
    "dirichlet_client_mix": dirichlet_client_mix,
    "dirichlet_hsu": dirichlet_client_mix,  # Hsu et al. 2019: the papers' "Dir-α"
    "positive_ratio": positive_ratio,
    "natural": natural,
}


def partition(name: str, labels, num_clients: int, *, seed: int, **kwargs) -> list[np.ndarray]:
    """Partition ``labels`` across ``num_clients`` clients with the partitioner named ``name``.

    Args:
      name: a key of :data:`PARTITIONERS`.
      labels: ``[M]`` integer labels.
      num_clients: number of clients.
      seed: NumPy seed.
      **kwargs: the partitioner's own options (``alpha``, ``ratios``, ``groups``, ...).

    Returns:
      A list of ``num_clients`` index arrays.
    """
    if name not in PARTITIONERS:
        raise ValueError(f"Unknown partition {name!r}; valid choices: {sorted(PARTITIONERS)}.")
    return PARTITIONERS[name](labels, num_clients, seed=seed, **kwargs)
