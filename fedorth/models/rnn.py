"""Elman RNN text classifier of FedMuon (Zhang & Gao) and Fed minimax (Zhang & Gao) (input 300,
hidden 4096, output 2).

FedMuon (Zhang & Gao) Appendix A.2 Table 3 (docs/PAPERS.md) gives "input dimension
300, hidden dimension 4096, output dimension 2" for "a recurrent neural network (RNN) [Elman,
1990]" on Sentiment140; Fed minimax (Zhang & Gao) §6 (docs/PAPERS.md, "Empirical
Settings") calls the same model "a two-layer recurrent neural network with input dimension 300,
hidden dimension 4096, and output dimension 2". We read "two-layer" the way PyTorch's
`nn.RNN(input_size=300, hidden_size=4096, num_layers=2)` does: two stacked tanh recurrent layers,
then a linear read-out of the top layer's last hidden state (`num_layers` is configurable; the
other reading, one recurrent layer + read-out, is `num_layers=1`). Per layer ℓ:
  h_t^ℓ = tanh(W_ih^ℓ·h_t^{ℓ−1} + W_hh^ℓ·h_{t−1}^ℓ + b^ℓ),  h_t^0 = x_t,  logits = W_o·h_T^L + b_o.
One bias per layer (PyTorch's b_ih + b_hh is the same function with a redundant vector).
Initialization is PyTorch's for nn.RNN: every weight and bias U(±1/√hidden); the read-out uses
PyTorch's Linear kernel distribution U(±1/√hidden) with a zero bias.

Inputs: token ids `[B, T]` (int, looked up in a learned `vocab_size × 300` embedding; `pad_id`
positions leave the state unchanged, so the read-out is the state after the last real token) or
precomputed word vectors `[B, T, 300]` (float, every position is real). The input projection of
each layer is one matrix product over all time steps; only h·W_hh runs inside `lax.scan`.
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedorth.models.base import Model
from fedorth.models.layers import compute_dtype, float_logits


def _uniform(scale: float) -> nn.initializers.Initializer:
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -scale, scale)

    return init


class RNNClassifier(nn.Module):
    """Stacked Elman (tanh) RNN over a sequence, linear read-out of the last real hidden state.

    Attributes:
      num_classes: output logits.
      hidden_size: recurrent width.
      num_layers: stacked recurrent layers.
      vocab_size: embedding rows for token-id inputs (None: inputs must be float vectors).
      embed_dim: embedding width (input dimension, 300).
      pad_id: token id that marks padding (ignored for float inputs).
      dtype: compute dtype (None: float32; `layers.compute_dtype`): the embedding, the input
        projections, the recurrence (its carried state included) and the read-out; parameters
        stay float32.
    """

    num_classes: int = 2
    hidden_size: int = 4096
    num_layers: int = 2
    vocab_size: int | None = None
    embed_dim: int = 300
    pad_id: int = 0
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, *, train: bool = False) -> jnp.ndarray:
        del train
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.integer):
            if self.vocab_size is None:
                raise ValueError("integer token inputs need vocab_size (got vocab_size=None).")
            if x.ndim != 2:
                raise ValueError(f"token inputs must be [B, T]; got shape {x.shape}.")
            valid = x != self.pad_id
            h = nn.Embed(
                self.vocab_size,
                self.embed_dim,
                embedding_init=nn.initializers.normal(1.0),
                dtype=self.dtype,
            )(x)
        else:
            if x.ndim != 3 or x.shape[-1] != self.embed_dim:
                raise ValueError(
                    f"vector inputs must be [B, T, {self.embed_dim}]; got shape {x.shape}."
                )
            valid = jnp.ones(x.shape[:2], bool)
            h = x if self.dtype is None else x.astype(self.dtype)
        init = _uniform(1.0 / math.sqrt(self.hidden_size))
        valid_tb = valid.T[:, :, None]  # [T, B, 1]
        for layer in range(self.num_layers):
            w_ih = self.param(f"layer_{layer}_w_ih", init, (h.shape[-1], self.hidden_size))
            w_hh = self.param(f"layer_{layer}_w_hh", init, (self.hidden_size, self.hidden_size))
            bias = self.param(f"layer_{layer}_bias", init, (self.hidden_size,))
            drive = (
                jnp.einsum("bti,ih->tbh", h, w_ih.astype(h.dtype))
                + bias.astype(h.dtype)[None, None, :]
            )
            w_hh = w_hh.astype(drive.dtype)

            def step(state, inputs, w_hh=w_hh):
                drive_t, valid_t = inputs
                new = jnp.tanh(drive_t + state @ w_hh)
                new = jnp.where(valid_t, new, state)
                return new, new

            state0 = jnp.zeros(drive.shape[1:], drive.dtype)
            last, states = jax.lax.scan(step, state0, (drive, valid_tb))
            h = states.transpose(1, 0, 2)  # [B, T, hidden], input of the next layer
        readout = nn.Dense(
            self.num_classes,
            kernel_init=nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"),
            dtype=self.dtype,
            name="readout",
        )
        return float_logits(readout(last))


def rnn(
    *,
    num_classes: int = 2,
    hidden_size: int = 4096,
    num_layers: int = 2,
    vocab_size: int | None = None,
    embed_dim: int = 300,
    pad_id: int = 0,
    dtype: str = "float32",
) -> Model:
    """The `rnn` text classifier of FedMuon (Zhang & Gao) (Table 3) and Fed minimax (Zhang &
    Gao) (§6): see `RNNClassifier`.

    Args:
      num_classes: 2 (binary sentiment).
      hidden_size: 4096 in the papers; smaller for tests.
      num_layers: stacked recurrent layers (2: "two-layer RNN", Fed minimax (Zhang & Gao)).
      vocab_size: vocabulary for token-id inputs; None for precomputed 300-d vectors only.
      embed_dim: input dimension (300).
      pad_id: padding token id.
      dtype: `"float32"` or `"bfloat16"` (mixed precision: `layers.compute_dtype`).

    Returns:
      A classification `Model`.
    """
    sizes = {"hidden_size": hidden_size, "num_layers": num_layers, "embed_dim": embed_dim}
    for name, value in sizes.items():
        if int(value) <= 0:
            raise ValueError(f"{name}={value} must be a positive integer.")
    if vocab_size is not None and int(vocab_size) <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be a positive integer or None.")
    return Model(
        RNNClassifier(
            int(num_classes),
            int(hidden_size),
            int(num_layers),
            None if vocab_size is None else int(vocab_size),
            int(embed_dim),
            int(pad_id),
            compute_dtype(dtype),
        )
    )
