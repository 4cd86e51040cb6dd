r"""Deep AUC maximization as a min-max problem (Fed minimax (Zhang & Gao) Eq. 20) and the exact ROC
AUC metric.

Fed minimax (Zhang & Gao) §5 (docs/PAPERS.md, Eq. 20), after Liu et al. 2020
("Stochastic AUC maximization with deep neural networks", ICLR): for a score ``h = h(w; a)`` of
example ``a`` with label ``b`` and the positive ratio ``p``,

.. math::
  f(w, w_1, w_2, w_3; a, b) = (1-p)(h - w_1)^2 \mathbb{I}_{[b=1]}
     + p (h - w_2)^2 \mathbb{I}_{[b=-1]}
     + 2(1 + w_3)\big(p\, h\, \mathbb{I}_{[b=-1]} - (1-p)\, h\, \mathbb{I}_{[b=1]}\big)
     - p(1-p) w_3^2,

minimized over the primal ``(w, w_1, w_2)`` and maximized over the dual ``w_3``. For fixed
scores the inner problem is solved by ``w_1 = E[h | b=1]``, ``w_2 = E[h | b=-1]``,
``w_3 = E[h | b=-1] - E[h | b=1]``, where (with ``P(b=1) = p``) the value is
``p(1-p)(E_{pos, neg}[(1 - h_pos + h_neg)^2] - 1)``: the pairwise square-loss surrogate of the AUC
(the identity ``tests/test_auc.py`` checks).

:func:`auc` wraps any classification model of :mod:`fedorth.models` into this objective. Its
parameters are ``{"net": <the model's params>, "a": w_1, "b": w_2, "dual": {"alpha": w_3}}``: the
``"dual"`` key marks the maximization variable for the minimax algorithms
(:func:`fedorth.optim.minimax.minimax_labels`). Labels are 0/1 (``b = -1`` is 0).

Choices: the score is ``h = sigmoid(z_1 - z_0)`` (the softmax probability of class 1) for a
two-logit model (Fed minimax (Zhang & Gao)'s RNN has "output dimension 2"), ``sigmoid(z)`` for one
logit, as
Liu et al. and LibAUC use scores in ``[0, 1]``; ``w_1 = w_2 = w_3 = 0`` at initialization.

The test metric is the exact ROC AUC, :func:`roc_auc` (Mann-Whitney statistic with tied scores
counting 1/2), computed on the host in float64 from the per-example scores that
:meth:`AUCModel.eval_fn` returns under ``"per_example"`` (the runner's
``fedorth.train.builders.make_eval_fn`` turns them into ``test_auc``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedorth.models.base import Model, _as_dict, _example_mask

PyTree = Any

__all__ = [
    "AUCModel",
    "auc",
    "auc_minimax_loss",
    "optimal_auc_variables",
    "pooled_positive_ratio",
    "roc_auc",
    "score_from_logits",
]


def score_from_logits(logits: jax.Array) -> jax.Array:
    """``sigmoid(z_1 - z_0)`` for two logits, ``sigmoid(z)`` for one; ``[B, C] -> [B]``."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if logits.shape[-1] == 2:
        return jax.nn.sigmoid(logits[..., 1] - logits[..., 0])
    if logits.shape[-1] == 1:
        return jax.nn.sigmoid(logits[..., 0])
    raise ValueError(
        f"AUC scores need a model with 1 or 2 outputs (binary task); got {logits.shape[-1]}."
    )


def auc_minimax_loss(
    scores: jax.Array,
    labels: jax.Array,
    a: jax.Array,
    b: jax.Array,
    alpha: jax.Array,
    positive_ratio: float,
) -> jax.Array:
    """Per-example min-max AUC objective of Fed minimax (Zhang & Gao) Eq. 20 (labels 1 positive, 0
    negative).

    Args:
      scores: ``[B]`` scores ``h(w; a)``.
      labels: ``[B]`` 0/1 labels.
      a: ``w_1`` (scalar).
      b: ``w_2`` (scalar).
      alpha: ``w_3`` (scalar, the dual variable).
      positive_ratio: ``p`` in (0, 1).

    Returns:
      ``[B]`` values of ``f``.
    """
    p = positive_ratio
    pos = (labels == 1).astype(scores.dtype)
    neg = 1.0 - pos
    return (
        (1.0 - p) * jnp.square(scores - a) * pos
        + p * jnp.square(scores - b) * neg
        + 2.0 * (1.0 + alpha) * (p * scores * neg - (1.0 - p) * scores * pos)
        - p * (1.0 - p) * jnp.square(alpha)
    )


def optimal_auc_variables(scores, labels) -> tuple[float, float, float]:
    """``(w_1, w_2, w_3) = (E[h|pos], E[h|neg], E[h|neg] - E[h|pos])`` of fixed scores (NumPy)."""
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels)
    mean_pos = scores[labels == 1].mean()
    mean_neg = scores[labels != 1].mean()
    return mean_pos, mean_neg, mean_neg - mean_pos


def pooled_positive_ratio(ratios, weights=None) -> float:
    """Positive ratio of the union of clients with ratios ``r_i`` and equal negatives ``m``.

    With ``fedorth.data.partition_lib.positive_ratio`` every client gets (about) the same number
    of negatives ``m`` and ``r_i m / (1 - r_i)`` positives, so the pooled ratio is
    ``sum_i r_i/(1-r_i) / (N + sum_i r_i/(1-r_i))`` (Fed minimax (Zhang & Gao)'s heterogeneous
    setting: the ``p``
    of Eq. 20). ``weights`` scales each client's negatives (default equal).
    """
    r = np.asarray(ratios, np.float64).reshape(-1)
    if np.any((r <= 0) | (r >= 1)):
        raise ValueError(f"ratios must lie in (0, 1), got {r.tolist()}.")
    w = np.ones_like(r) if weights is None else np.asarray(weights, np.float64)
    pos = np.sum(w * r / (1.0 - r))
    return float(pos / (np.sum(w) + pos))


def roc_auc(scores, labels, mask=None) -> float:
    r"""Exact ROC AUC by ranks (ties get their average rank), in float64 on the host.

    .. math:: \mathrm{AUC} = \frac{\sum_{i \in pos} R_i - n_+(n_+ + 1)/2}{n_+ n_-}
              = P(h_+ > h_-) + \tfrac12 P(h_+ = h_-)

    (Mann-Whitney; Hanley & McNeil 1982, cited by Fed minimax (Zhang & Gao) §5).

    Args:
      scores: ``[M]`` scores (higher = more positive).
      labels: ``[M]`` 0/1 labels.
      mask: optional ``[M]`` weights; examples with ``mask == 0`` are ignored (padding).

    Returns:
      The AUC, or NaN when one class is absent.
    """
    scores = np.asarray(scores, np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError(f"scores {scores.shape} and labels {labels.shape} must have one shape.")
    if mask is not None:
        keep = np.asarray(mask).reshape(-1) != 0
        scores, labels = scores[keep], labels[keep]
    positive = labels == 1
    n_pos = int(positive.sum())
    n_neg = int(positive.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    _, inverse, counts = np.unique(scores[order], return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # 0-based start of each tie group
    ranks = np.empty(scores.size, np.float64)
    ranks[order] = first[inverse] + (counts[inverse] + 1) / 2.0
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


@dataclasses.dataclass(frozen=True)
class AUCModel:
    """A binary classifier trained with the min-max AUC loss (Model-compatible, CONTRACTS.md).

    Attributes:
      base: the wrapped classification :class:`fedorth.models.Model` (1 or 2 outputs).
      positive_ratio: ``p`` of Eq. 20.
    """

    base: Model
    positive_ratio: float

    def __post_init__(self):
        if not 0.0 < float(self.positive_ratio) < 1.0:
            raise ValueError(f"positive_ratio={self.positive_ratio} must lie in (0, 1).")
        if self.base.task != "classification":
            raise ValueError(f"auc needs a classification base model, got task={self.base.task}.")

    @property
    def module(self):
        return self.base.module

    @property
    def task(self) -> str:
        return "classification"

    def init(self, key: jax.Array, x: jnp.ndarray) -> tuple[PyTree, PyTree]:
        """``({"net", "a", "b", "dual": {"alpha"}}, model_state)``; ``w_1 = w_2 = w_3 = 0``."""
        net, model_state = self.base.init(key, x)
        zero = jnp.zeros([], jnp.float32)
        return {"net": net, "a": zero, "b": zero, "dual": {"alpha": zero}}, model_state

    def predict_fn(self, params: PyTree, model_state: PyTree, x: jnp.ndarray) -> jnp.ndarray:
        """Eval-mode scores ``h(w; x)`` in ``[0, 1]``, ``[B]``."""
        return score_from_logits(self.base.predict_fn(params["net"], model_state, x))

    def _values(self, params, scores, labels):
        return auc_minimax_loss(
            scores,
            labels,
            jnp.asarray(params["a"], scores.dtype),
            jnp.asarray(params["b"], scores.dtype),
            jnp.asarray(params["dual"]["alpha"], scores.dtype),
            float(self.positive_ratio),
        )

    def loss_fn(self, params, model_state, batch, key):
        """Train-mode mean of Eq. 20 over the batch (masked mean if ``batch["mask"]``).

        Returns:
          ``(loss, (new_model_state, {"loss": loss}))``.
        """
        variables = {"params": params["net"], **model_state}
        rngs = {} if key is None else {"dropout": key}
        mutable = list(model_state.keys())
        if mutable:
            logits, updates = self.base.module.apply(
                variables, batch["x"], train=True, rngs=rngs, mutable=mutable
            )
            new_state = _as_dict(updates)
        else:
            logits = self.base.module.apply(variables, batch["x"], train=True, rngs=rngs)
            new_state = model_state
        values = self._values(params, score_from_logits(logits), batch["y"])
        mask = _example_mask(batch, values.shape)
        count = jnp.sum(mask)
        loss = jnp.sum(values * mask) / jnp.where(count > 0, count, 1.0)
        return loss, (new_state, {"loss": loss})

    def eval_fn(self, params, model_state, batch) -> dict:
        """Sums of Eq. 20 and of ``[h > 1/2] == y`` over the batch, and the per-example scores.

        Returns:
          ``{"loss_sum", "correct", "count", "per_example": {"score", "label", "mask"}}``; the
          per-example entries (``[B]``) feed :func:`roc_auc` in the runner.
        """
        scores = self.predict_fn(params, model_state, batch["x"])
        values = self._values(params, scores, batch["y"])
        mask = _example_mask(batch, values.shape)
        correct = ((scores > 0.5).astype(jnp.int32) == batch["y"]).astype(values.dtype)
        return {
            "loss_sum": jnp.sum(values * mask),
            "correct": jnp.sum(correct * mask),
            "count": jnp.sum(mask),
            "per_example": {"score": scores, "label": batch["y"], "mask": mask},
        }


def auc(
    *, base: str = "rnn", positive_ratio: float = 0.1, dtype: str = "float32", **base_kwargs
) -> AUCModel:
    """The ``auc`` model: ``base`` (a name of ``fedorth.models.MODELS``) under Eq. 20's loss.

    Args:
      base: the classification model (Fed minimax (Zhang & Gao): ``"rnn"``).
      positive_ratio: ``p`` (Fed minimax (Zhang & Gao): ``r = 0.1`` in the homogeneous setting; use
        :func:`pooled_positive_ratio` for the heterogeneous one).
      dtype: the base model's compute dtype, ``"float32"`` or ``"bfloat16"`` (mixed precision,
        :func:`fedorth.models.layers.compute_dtype`); Eq. 20 is evaluated in float32 on the
        float32 scores either way.
      **base_kwargs: the base model's arguments (e.g. ``hidden_size``, ``vocab_size``,
        ``num_classes``).

    Returns:
      An :class:`AUCModel`.
    """
    from fedorth.models import get_model

    if base == "auc":
        raise ValueError("auc(base='auc') would wrap the AUC loss twice; pick a classifier.")
    return AUCModel(get_model(base, dtype=dtype, **base_kwargs), float(positive_ratio))
