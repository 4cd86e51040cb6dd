"""`Model`: a Flax module plus the pure functions the federated engine calls.

Contract (docs/CONTRACTS.md, "Models"):
  init(key, x) -> (params, model_state)
  loss_fn(params, model_state, batch, key) -> (loss, (model_state, metrics))   # train mode
  eval_fn(params, model_state, batch) -> {"loss_sum", "correct", "count"}        # eval mode, sums

Every module used here is called as `module.apply(variables, x, train=bool)`; variables other
than `params` (BatchNorm's `batch_stats`) form `model_state` and are updated in train mode.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedorth.models.layers import check_choice

TASKS = ("classification", "lm", "multilabel")

# Labels ranked per example by the multi-label recall (Reddi et al. 2021 report recall@5 on
# StackOverflow tag prediction, TFF's tf.keras.metrics.Recall(top_k=5)).
RECALL_TOP_K = 5

PyTree = Any


def _as_dict(tree) -> dict:
    """Plain nested dicts (Flax may return FrozenDicts), so pytree structures stay stable."""
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {k: _as_dict(v) for k, v in tree.items()}
    return tree


def _example_mask(batch: dict, shape: tuple[int, ...]) -> jnp.ndarray:
    """The float `mask` of `batch` broadcast to `shape` (ones when absent).

    A `[B]` mask (padded examples) is expanded over the remaining axes of `shape` explicitly
    (rank promotion is disabled in the tests); a mask of the full `shape` is used as is.
    """
    mask = batch.get("mask")
    if mask is None:
        return jnp.ones(shape, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    if mask.shape == shape:
        return mask
    if mask.shape != shape[: mask.ndim]:
        raise ValueError(f"batch['mask'] has shape {mask.shape}; expected {shape[:1]} or {shape}.")
    mask = mask.reshape(mask.shape + (1,) * (len(shape) - mask.ndim))
    return jnp.broadcast_to(mask, shape)


@dataclasses.dataclass(frozen=True)
class Model:
    """A Flax module with the train/eval functions of its task.

    For `task="classification"`: `batch = {"x": inputs, "y": int labels [B]}` and the loss is the
    mean softmax cross-entropy. For `task="multilabel"`: `batch = {"x": inputs, "y": multi-hot
    labels [B, L]}`, one sigmoid per label; an example's loss is the mean over its `L` labels
    of the binary cross-entropy (Keras's `BinaryCrossentropy`, which TFF's StackOverflow tag
    prediction uses), and the metric is recall@5 (:data:`RECALL_TOP_K`). For `task="lm"`:
    `batch = {"x": tokens [B, T]}` and the loss is the mean next-token cross-entropy,
    ℓ = mean_{b, t<T} CE(logits(x[b, :t+1]), x[b, t+1]); the model reads `x[:, :-1]` and
    predicts `x[:, 1:]`.

    Attributes:
      module: the `flax.linen.Module`, called as `module.apply(variables, x, train=...)`.
      task: `"classification"`, `"lm"` or `"multilabel"`.
      pad_id: for `"lm"`, a token id left out of the accuracy where it is the target (the
        padding of TFF's Shakespeare and StackOverflow windows: TFF reports
        `MaskedCategoricalAccuracy(masked_tokens=[pad])`); the loss still counts it, as TFF's
        `SparseCategoricalCrossentropy` does. None: every target counts.
    """

    module: nn.Module
    task: str = "classification"
    pad_id: int | None = None

    def __post_init__(self):
        check_choice("task", self.task, TASKS)

    @property
    def convolutional(self) -> bool:
        """Whether the module has convolutions (a ``conv_impl`` field, ``layers.conv``): the
        round engine's ``"auto"`` strategy shards such clients over several CPU devices
        (``fed.resolve_strategy``)."""
        return "conv_impl" in {f.name for f in dataclasses.fields(self.module)}

    def _inputs_targets(self, batch: dict):
        x = batch["x"]
        if self.task == "lm":
            if x.ndim != 2:
                raise ValueError(f"lm batch['x'] must be tokens [B, T]; got shape {x.shape}.")
            return x[:, :-1], x[:, 1:]
        return x, batch["y"]

    def init(self, key: jax.Array, x: jnp.ndarray) -> tuple[PyTree, PyTree]:
        """Initializes `(params, model_state)` from an example input `x` (only shapes matter).

        Flax draws every parameter from `key`. With the default threefry keys, XLA:CPU spends
        ~0.1–0.3 s compiling each draw (~10 s for a ResNet); a `jax.random.key(seed,
        impl="rbg")` key compiles about 5× faster (measured on the project's 2-core machines).

        Args:
          key: a PRNG key.
          x: an example batch of inputs (tokens `[B, T]` for `"lm"`).

        Returns:
          `params` (nested dict of arrays) and `model_state` (`{}` or e.g. `{"batch_stats": ...}`).
        """
        params_key, dropout_key = jax.random.split(key)
        variables = self.module.init(
            {"params": params_key, "dropout": dropout_key}, jnp.asarray(x), train=False
        )
        variables = _as_dict(variables)
        params = variables.pop("params")
        return params, variables

    def predict_fn(self, params: PyTree, model_state: PyTree, x: jnp.ndarray) -> jnp.ndarray:
        """Eval-mode logits (`[B, classes]`, or `[B, T, vocab]` for `"lm"`)."""
        return self.module.apply({"params": params, **model_state}, x, train=False)

    def loss_fn(
        self, params: PyTree, model_state: PyTree, batch: dict, key: jax.Array | None
    ) -> tuple[jnp.ndarray, tuple[PyTree, dict]]:
        """Train-mode mean loss (dropout on with `key`, BatchNorm on batch statistics).

        Args:
          params: the model parameters.
          model_state: `{}` or the mutable collections (e.g. `batch_stats`).
          batch: `{"x", "y"}` (`{"x"}` for `"lm"`), optionally a float `mask` `[B]` that weights
            the examples (the loss is then Σ mask·ℓ / Σ mask).
          key: PRNG key for dropout (may be None for models without dropout).

        Returns:
          `(loss, (new_model_state, metrics))` with `metrics = {"loss", "accuracy"}` scalars
          (`{"loss", "recall_at_5"}` for `"multilabel"`).
        """
        inputs, targets = self._inputs_targets(batch)
        variables = {"params": params, **model_state}
        rngs = {} if key is None else {"dropout": key}
        mutable = list(model_state.keys())
        if mutable:
            logits, updates = self.module.apply(
                variables, inputs, train=True, rngs=rngs, mutable=mutable
            )
            new_state = _as_dict(updates)
        else:
            logits = self.module.apply(variables, inputs, train=True, rngs=rngs)
            new_state = model_state
        if self.task == "multilabel":
            losses, hits, positives = _multilabel(logits, targets)
            mask = _example_mask(batch, losses.shape)
            loss = jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)
            recall = jnp.sum(hits * mask) / jnp.maximum(jnp.sum(positives * mask), 1.0)
            return loss, (new_state, {"loss": loss, "recall_at_5": recall})
        losses, correct = _losses(logits, targets)
        mask = _example_mask(batch, losses.shape)
        count = jnp.sum(mask)
        denominator = jnp.where(count > 0, count, 1.0)
        loss = jnp.sum(losses * mask) / denominator
        metrics = {"loss": loss, "accuracy": jnp.sum(correct * mask) / denominator}
        if self._pads():
            scored = mask * (targets != self.pad_id)
            scored_count = jnp.sum(scored)
            scored_count = jnp.where(scored_count > 0, scored_count, 1.0)
            metrics["accuracy"] = jnp.sum(correct * scored) / scored_count
        return loss, (new_state, metrics)

    def _pads(self) -> bool:
        return self.task == "lm" and self.pad_id is not None

    def eval_fn(self, params: PyTree, model_state: PyTree, batch: dict) -> dict:
        """Eval-mode sums over the batch (deterministic: no dropout, BatchNorm running stats).

        Args:
          params: the model parameters.
          model_state: `{}` or the mutable collections (used read-only).
          batch: `{"x", "y"}` (`{"x"}` for `"lm"`), optionally a float `mask` `[B]` (`[B, T-1]`
            token mask also accepted for `"lm"`) that zeroes padded examples.

        Returns:
          `{"loss_sum": Σ mask·ℓ, "correct": Σ mask·[argmax = y], "count": Σ mask}` float32
          scalars; for `"lm"` the sums run over all predicted tokens (count = B·(T−1) unmasked).
          With `pad_id`, `"correct"` leaves out the padded targets and `"accuracy_count"`
          counts the others (accuracy = correct / accuracy_count). For `"multilabel"`:
          `{"loss_sum", "count", "recall_hits", "recall_count"}`, the true labels among each
          example's top 5 and the true labels (recall@5 = recall_hits / recall_count, pooled
          over the examples as Keras's `Recall(top_k=5)`).
        """
        inputs, targets = self._inputs_targets(batch)
        logits = self.predict_fn(params, model_state, inputs)
        if self.task == "multilabel":
            losses, hits, positives = _multilabel(logits, targets)
            mask = _example_mask(batch, losses.shape)
            return {
                "loss_sum": jnp.sum(losses * mask),
                "count": jnp.sum(mask),
                "recall_hits": jnp.sum(hits * mask),
                "recall_count": jnp.sum(positives * mask),
            }
        losses, correct = _losses(logits, targets)
        mask = _example_mask(batch, losses.shape)
        out = {
            "loss_sum": jnp.sum(losses * mask),
            "correct": jnp.sum(correct * mask),
            "count": jnp.sum(mask),
        }
        if self._pads():
            scored = mask * (targets != self.pad_id)
            out.update(correct=jnp.sum(correct * scored), accuracy_count=jnp.sum(scored))
        return out


def _losses(logits: jnp.ndarray, targets: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-example (per-token) cross-entropy and 0/1 correctness, computed in float32 or wider."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(losses.dtype)
    return losses, correct


def _multilabel(logits: jnp.ndarray, targets: jnp.ndarray):
    """Per-example mean binary cross-entropy over the labels, and recall@k's per-example
    counts: true labels among the ``k`` largest logits, and true labels (``targets > 0``)."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    targets = targets.astype(logits.dtype)
    losses = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, targets), axis=-1)
    positive = (targets > 0).astype(logits.dtype)
    _, top = jax.lax.top_k(logits, min(RECALL_TOP_K, logits.shape[-1]))  # ties: lower index
    hits = jnp.sum(jnp.take_along_axis(positive, top, axis=-1), axis=-1)
    return losses, hits, jnp.sum(positive, axis=-1)
