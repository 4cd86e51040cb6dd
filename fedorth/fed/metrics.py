"""Per-round federated metrics: client drift, preconditioner drift, communication cost.

* Client drift: root mean square over sampled clients of ``||dx_i - mean_j dx_j||`` and the
  mean cosine similarity between the updates of two different clients.
* Preconditioner drift, FedPAC (Liu et al.) Definition 1 / Eq. (7): the mean squared distance
  of the clients' preconditioner states to their average, ``(1/S) sum_i ||Theta_i -
  Theta-bar||^2``, over ``Theta`` only (``fedorth.optim.federated.theta_mask``: SOAP ``{L, R}``,
  Sophia ``{h}``, Muon ``{m}``, §3.2); and the spectral version of its Figure 3, ``(1/S) sum_i
  sum_l ||Theta_i,l - Theta-bar_l||_2^2`` over matrix leaves ``l`` (power iteration). Logged for
  Local-X (states reset or kept per client) too, for Fig. 3/5's Local-vs-FedPAC comparison.
* Communication: bytes a client sends up and receives down per round, counted from the arrays the
  algorithm actually transmits (FedMuon (Liu et al.) Table 7, FedPAC (Liu et al.) Tables 6 and
  11 accounting; FedPAC sends its Θ only, ``fedorth.fed.start.Global.mask``, and SOAP's
  eigenbases are never sent); low-rank uploads count ``k (m + n + 1)``
  numbers per matrix (``fedorth.optim.compress``, which also says how the papers' own figures
  count).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from fedorth.fed import reduce
from fedorth.optim import compress
from fedorth.optim import federated as fed_optim

PyTree = Any


def client_drift(deltas_C: PyTree) -> dict[str, jax.Array]:
    """Drift of the client updates ``dx_i`` (leading client axis).

    ``client_drift = sqrt(mean_i ||dx_i - mean_j dx_j||^2)`` (the root mean square distance of
    the updates to their average) and ``client_cosine = mean_{i != j} <u_i, u_j>`` with
    ``u_i = dx_i / ||dx_i||`` (0 for a zero update), over all leaves. The round engine computes
    the same two numbers while clients run (``fed.reduce``: Welford/Chan summaries, no ``[S, P]``
    stack); this is the version for a stack.
    """
    count = jax.tree.leaves(deltas_C)[0].shape[0]
    stats = reduce.from_stack({"delta": deltas_C}, {"delta": None}, "delta")
    return reduce.drift(stats, "delta", count)


def _spectral_norm_sq(x_C: jax.Array, iters: int = 16) -> jax.Array:
    """Squared spectral norm of each ``[S, ..., m, n]`` matrix by power iteration (summed)."""
    mats = x_C.reshape(-1, x_C.shape[-2], x_C.shape[-1]).astype(jnp.float32)
    v = jnp.ones((mats.shape[0], mats.shape[-1]), jnp.float32) / math.sqrt(mats.shape[-1])

    def body(_, v):
        w = jnp.einsum("bmn,bn->bm", mats, v)
        v = jnp.einsum("bmn,bm->bn", mats, w)
        return v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-30)

    v = jax.lax.fori_loop(0, iters, body, v)
    sq = jnp.sum(jnp.einsum("bmn,bn->bm", mats, v) ** 2, axis=-1)
    return jnp.sum(sq.reshape(x_C.shape[0], -1), axis=1)


def preconditioner_drift(
    states_C: PyTree, *, mask: PyTree | None = None, spectral: bool = False
) -> dict[str, jax.Array]:
    """FedPAC (Liu et al.) Def. 1 / Eq. (7) over ``Θ`` of client-stacked optimizer states.

    ``Δ_D = (1/S) Σ_i ||Θ_i − Θ̄||²`` with ``Θ̄ = (1/S) Σ_i Θ_i``, summed over the leaves of
    ``Θ``; with ``spectral``, also Fig. 3's ``(1/S) Σ_i Σ_l ||Θ_i,l − Θ̄_l||₂²`` over its matrix
    leaves (SOAP: L and R).

    Args:
      states_C: client-stacked optimizer states (leading axis S).
      mask: a pytree of bools like one state selecting the leaves; default ``Θ``
        (``fed_optim.theta_mask``: SOAP ``{L, R}``, Sophia ``{h}``, Muon ``{m}``, else the
        uploaded leaves).
      spectral: also compute the spectral variant.
    """
    if mask is None:
        mask = fed_optim.theta_mask(states_C)
    leaves = reduce.masked_leaves(states_C, mask)
    if not leaves:
        return {}
    total = jnp.zeros([], jnp.float32)
    spec = jnp.zeros([], jnp.float32)
    for x in leaves:
        dev = (x - fed_optim.mean_over_clients(x)[None]).astype(jnp.float32)
        total = total + jnp.sum(dev**2) / x.shape[0]
        if spectral and x.ndim >= 3:
            spec = spec + jnp.mean(_spectral_norm_sq(dev))
    out = {"precond_drift": total}
    if spectral:
        out["precond_drift_spectral"] = spec
    return out


def tree_bytes(tree: PyTree, mask: PyTree | None = None) -> int:
    """Bytes of the (masked) leaves of a pytree of arrays or ``ShapeDtypeStruct``."""
    leaves = jax.tree.leaves(tree)
    flags = jax.tree.leaves(mask) if mask is not None else [True] * len(leaves)
    return sum(
        int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x, m in zip(leaves, flags, strict=True)
        if m
    )


def low_rank_bytes(tree: PyTree, mask: PyTree, ratio: float) -> int:
    """Bytes of the masked leaves as the low-rank upload sends them.

    Each leaf costs ``compress.compressed_num_floats(shape, ratio)`` numbers of its dtype: the
    factors ``(U_k, s_k, V_k)``, ``k(m + n + 1)`` numbers, of its matrix view ``(m, n)`` (Muon's:
    a conv kernel ``(kh·kw·in, out)``), or every entry when the leaf is sent dense (no matrix
    view, or factors not smaller). The same rule decides what ``compress.compress_tree`` truncates.
    """
    total = 0
    for x, m in zip(jax.tree.leaves(tree), jax.tree.leaves(mask), strict=True):
        if m:
            itemsize = jnp.dtype(x.dtype).itemsize
            total += compress.compressed_num_floats(x.shape, ratio) * itemsize
    return total
