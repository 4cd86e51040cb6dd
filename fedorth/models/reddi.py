"""The models of Reddi et al. 2021 ("Adaptive Federated Optimization", Appendix C): the EMNIST
character CNN, the recurrent language models of Shakespeare and StackOverflow, and the logistic
regression of StackOverflow tag prediction.

* ``emnist_cnn``: conv 3x3 32 (ReLU), conv 3x3 64 (ReLU), max-pool 2x2, dropout 0.25, dense 128
  (ReLU), dropout 0.5, dense 62; VALID convolutions, so 28x28 inputs flatten to 12x12x64:
  ``320 + 18,496 + 1,179,776 + 7,998 = 1,206,590`` parameters.
* ``lstm_lm``: a next-token language model, ``embedding -> LSTM layers -> [dense projection] ->
  dense vocabulary``, reading ``x[:, :-1]`` and predicting ``x[:, 1:]`` (``task="lm"``). Reddi
  et al.'s Shakespeare model is ``embed_dim=8, hidden_sizes=(256, 256)`` over TFF's 90 character
  ids (86 characters, pad, out-of-vocabulary, BOS, EOS): ``720 + 271,360 + 525,312 + 23,130 =
  820,522`` parameters; its StackOverflow model is ``embed_dim=96, hidden_sizes=(670,),
  projection=96`` over 10,004 word ids: ``960,384 + 2,055,560 + 64,416 + 970,388 =
  4,050,748``. An LSTM layer of width ``h`` on inputs of width ``i`` has ``4 (h (i + h) + h)``
  parameters, one bias per gate as Keras's.
* ``multilabel_lr``: multi-label logistic regression, one dense layer from the input features to
  one sigmoid per label (``task="multilabel"``; TFF's ``Dense(500, activation="sigmoid")``). On
  StackOverflow tags, 10,000 bag-of-words features to 500 tags: ``5,000,000 + 500 = 5,000,500``
  parameters.
"""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fedorth.models.base import Model
from fedorth.models.layers import (
    CONV_IMPLS,
    as_float,
    check_choice,
    compute_dtype,
    conv2d,
    float_logits,
    max_pool,
)
from fedorth.models.mlp import MLP


class EmnistCNN(nn.Module):
    """Reddi et al.'s EMNIST CNN (module docstring)."""

    num_classes: int = 62
    conv_impl: str = "auto"
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, *, train: bool = False) -> jnp.ndarray:
        x = as_float(x)
        if x.ndim == 3:
            x = x[..., None]
        for channels in (32, 64):
            x = conv2d(channels, (3, 3), padding="VALID", impl=self.conv_impl, dtype=self.dtype)(x)
            x = nn.relu(x)
        x = max_pool(x, (2, 2))
        x = nn.Dropout(0.25, deterministic=not train)(x)
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(128, dtype=self.dtype)(x))
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return float_logits(nn.Dense(self.num_classes, dtype=self.dtype)(x))


def emnist_cnn(*, num_classes: int = 62, conv_impl: str = "auto", dtype: str = "float32") -> Model:
    """The ``emnist_cnn`` model: see :class:`EmnistCNN`.

    Args:
      num_classes: number of classes (62 for EMNIST-62, 10 for its digits).
      conv_impl: ``"lax"``, ``"matmul"``, ``"canonical"`` or ``"auto"``.
      dtype: ``"float32"`` or ``"bfloat16"`` (mixed precision: ``layers.compute_dtype``).

    Returns:
      A classification ``Model``.
    """
    check_choice("conv_impl", conv_impl, CONV_IMPLS)
    return Model(EmnistCNN(int(num_classes), conv_impl, compute_dtype(dtype)))


class LSTMLanguageModel(nn.Module):
    """Embedding, stacked LSTMs, an optional dense projection, dense logits over the vocabulary.

    Attributes:
      num_classes: the vocabulary (ids ``0..num_classes-1``).
      embed_dim: embedding width.
      hidden_sizes: the LSTM layers' widths.
      projection: width of a dense layer after the last LSTM (linear, as Reddi et al.'s
        StackOverflow model), or 0 for none.
      dtype: compute dtype (None: float32); parameters stay float32.
    """

    num_classes: int = 90
    embed_dim: int = 8
    hidden_sizes: Sequence[int] = (256, 256)
    projection: int = 0
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, *, train: bool = False) -> jnp.ndarray:
        del train
        if x.ndim != 2:
            raise ValueError(f"lstm_lm inputs must be token ids [B, T]; got shape {x.shape}.")
        h = nn.Embed(self.num_classes, self.embed_dim, dtype=self.dtype)(x)
        for width in self.hidden_sizes:
            cell = nn.OptimizedLSTMCell(width, dtype=self.dtype, param_dtype=jnp.float32)
            h = nn.RNN(cell)(h)
        if self.projection:
            h = nn.Dense(self.projection, dtype=self.dtype)(h)
        return float_logits(nn.Dense(self.num_classes, dtype=self.dtype)(h))


def lstm_lm(
    *,
    num_classes: int = 90,
    embed_dim: int = 8,
    hidden_sizes: Sequence[int] = (256, 256),
    projection: int = 0,
    dtype: str = "float32",
) -> Model:
    """The ``lstm_lm`` model (``task="lm"``): see :class:`LSTMLanguageModel`; the defaults are
    Reddi et al.'s Shakespeare model.

    Args:
      num_classes: the vocabulary size (the data's ``num_classes``).
      embed_dim: embedding width.
      hidden_sizes: LSTM widths.
      projection: dense width after the LSTMs (0: none).
      dtype: ``"float32"`` or ``"bfloat16"``.

    Returns:
      A language ``Model``: next-token loss over ``x[:, 1:]``.
    """
    module = LSTMLanguageModel(
        int(num_classes),
        int(embed_dim),
        tuple(int(w) for w in hidden_sizes),
        int(projection),
        compute_dtype(dtype),
    )
    return Model(module, task="lm")


def multilabel_lr(*, num_classes: int = 500, dtype: str = "float32") -> Model:
    """The ``multilabel_lr`` model: ``logits = W x + b`` with one sigmoid per label (module
    docstring); the defaults are Reddi et al.'s StackOverflow tag model.

    Args:
      num_classes: the number of labels (the data's ``num_classes``: 500 tags).
      dtype: ``"float32"`` or ``"bfloat16"``.

    Returns:
      A multi-label ``Model``: mean sigmoid cross-entropy over the labels, recall@5.
    """
    return Model(MLP((), int(num_classes), compute_dtype(dtype)), task="multilabel")
