"""The small CIFAR CNN of FedAvg (McMahan et al., 2017) used to measure the engine's speed.

Two 5×5 SAME convolutions (32 and 64 channels), each followed by ReLU and a 2×2 max-pool, then
dense 384 → 192 → classes (the TensorFlow CIFAR-10 tutorial model that FedAvg trains). It is the
"small CNN" of docs/PERFORMANCE.md's XLA:CPU traps (convolution gradients inside `lax.scan`
on XLA:CPU), hence `conv_impl`. On 32×32×3 inputs with 10 classes it has
  2,432 + 51,264 + 1,573,248 (8·8·64·384 + 384) + 73,920 + 1,930 = 1,702,794 parameters.
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


class CNN(nn.Module):
    """[conv 5×5 → ReLU → max-pool 2×2] × len(features) → dense ReLU layers → logits.

    Attributes:
      num_classes: output logits.
      features: channels of the convolutions.
      dense_sizes: widths of the hidden dense layers.
      conv_impl: `"lax"`, `"matmul"`, `"canonical"` or `"auto"` (`layers.resolve_conv_impl`; same
        parameters).
      dtype: compute dtype (None: float32; `layers.compute_dtype`); parameters stay float32.
    """

    num_classes: int = 10
    features: Sequence[int] = (32, 64)
    dense_sizes: Sequence[int] = (384, 192)
    conv_impl: str = "auto"
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, *, train: bool = False) -> jnp.ndarray:
        del train
        x = as_float(x)
        if x.ndim == 3:
            x = x[..., None]
        for channels in self.features:
            x = conv2d(channels, (5, 5), padding="SAME", impl=self.conv_impl, dtype=self.dtype)(x)
            x = max_pool(nn.relu(x), (2, 2))
        x = x.reshape(x.shape[0], -1)
        for width in self.dense_sizes:
            x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
        return float_logits(nn.Dense(self.num_classes, dtype=self.dtype)(x))


def cnn(
    *,
    num_classes: int = 10,
    features: Sequence[int] = (32, 64),
    dense_sizes: Sequence[int] = (384, 192),
    conv_impl: str = "auto",
    dtype: str = "float32",
) -> Model:
    """The `cnn` model: see `CNN`.

    Args:
      num_classes: number of classes.
      features: convolution channels.
      dense_sizes: hidden dense widths.
      conv_impl: `"lax"`, `"matmul"`, `"canonical"` or `"auto"` (`layers.resolve_conv_impl`).
      dtype: `"float32"` or `"bfloat16"` (mixed precision: `layers.compute_dtype`).

    Returns:
      A classification `Model`.
    """
    check_choice("conv_impl", conv_impl, CONV_IMPLS)
    return Model(
        CNN(
            int(num_classes),
            tuple(int(c) for c in features),
            tuple(int(w) for w in dense_sizes),
            conv_impl,
            compute_dtype(dtype),
        )
    )
