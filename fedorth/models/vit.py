"""Vision Transformers: ViT-Tiny of FedPAC (Liu et al.) (and FedMuon (Liu et al.)) and the CIFAR
ViT of FedMuon (Zhang & Gao).

Both are pre-LN ViTs (Dosovitskiy et al., 2020) on non-overlapping p×p patches:
  z_0 = [cls; patches·E] + pos,  z ← z + MHA(LN(z)),  z ← z + MLP(LN(z)),  logits = W·LN(pool(z)).
The patch embedding is a Dense layer on flattened patches in (row, column, channel) order, i.e. a
p×p stride-p convolution whose kernel is this Dense kernel reshaped to (p, p, C, dim).

`vit_tiny` — FedPAC (Liu et al.) Appendix D.4 (docs/PAPERS.md): 32×32 input,
patch 4 (64 tokens), dim 192, 6 layers, 3 heads, pre-LN, GELU, Xavier/Glorot linear init,
sinusoidal positional encoding, dropout 0.1 "to both attention and MLP layers". The paper leaves
open (our choices, from the standard ViT/DeiT-Ti): MLP ratio 4 (hidden 768), classification from
a CLS token, qkv bias, 1-D sinusoids over the 65 token positions (CLS = position 0), dropout 0.1 on
the attention probabilities, the attention output projection and both MLP layers, no embedding
dropout, LayerNorm ε = 1e-6. Parameters for 100 classes: 2,698,468.

`vit_zg` — FedMuon (Zhang & Gao) Appendix A.1 Table 2 (docs/PAPERS.md), which
follows kentaroy47/vision-transformers-cifar10 (lucidrains' ViT): patch 4, 8 heads of dimension
64, depth 6, MLP dimension 512, dropout 0.1 in the encoder and MLP. The table omits the model
width; that repository's CIFAR script sets `dim = 512` (its `--dimhead` default), with learned
positional embeddings and CLS token drawn from N(0, 1), embedding dropout 0.1, qkv without bias,
no dropout on attention probabilities, and LayerNorm(ε = 1e-5) + Linear as the head. Linear layers
use PyTorch's default kernel distribution U(±1/√fan_in) (biases start at zero). Parameters on
32×32×3 with 10 classes: 9,523,722.

Dropout is `fedorth.models.layers.Dropout` (16 random bits per element; same drop probability
within 2^-17 and unbiased scaling, half the PRNG work of `flax.linen.Dropout`): dropout was a
quarter of a ViT-Tiny round on CPU.
"""

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from fedorth.models.base import Model
from fedorth.models.layers import Dropout, as_float, check_choice, compute_dtype, float_logits

POS_EMBEDDINGS = ("sinusoidal", "learned")
POOLS = ("cls", "mean")
KERNEL_INITS = {
    "xavier": nn.initializers.xavier_uniform(),
    "torch": nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"),
}


def sinusoidal_positions(num_positions: int, dim: int) -> np.ndarray:
    """Vaswani et al. (2017): PE[t, 2i] = sin(t / 10000^{2i/d}), PE[t, 2i+1] = cos(same)."""
    positions = np.arange(num_positions, dtype=np.float64)[:, None]
    frequencies = np.exp(-math.log(10000.0) * np.arange(0, dim, 2, dtype=np.float64) / dim)
    table = np.zeros((num_positions, dim), np.float64)
    table[:, 0::2] = np.sin(positions * frequencies[None, :])
    table[:, 1::2] = np.cos(positions * frequencies[None, : dim // 2])
    return table.astype(np.float32)


def patchify(x: jnp.ndarray, patch_size: int) -> jnp.ndarray:
    """`[B, H, W, C]` → `[B, (H/p)·(W/p), p·p·C]`, patches row-major, features in (row, col, c)."""
    batch, height, width, channels = x.shape
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"image size {(height, width)} is not divisible by patch_size={patch_size}."
        )
    gh, gw = height // patch_size, width // patch_size
    x = x.reshape(batch, gh, patch_size, gw, patch_size, channels)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(batch, gh * gw, patch_size * patch_size * channels)


class SelfAttention(nn.Module):
    """Multi-head self-attention: softmax(QKᵀ/√d_h)V per head, then an output projection.

    The softmax runs in float32 (or wider) whatever the compute `dtype`; the probabilities are
    cast back to it for the product with V.
    """

    num_heads: int
    head_dim: int
    qkv_bias: bool
    attention_dropout: float
    dropout: float
    kernel_init: nn.initializers.Initializer
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, *, train: bool) -> jnp.ndarray:
        batch, tokens, dim = x.shape
        inner = self.num_heads * self.head_dim
        qkv = nn.Dense(
            3 * inner,
            use_bias=self.qkv_bias,
            kernel_init=self.kernel_init,
            dtype=self.dtype,
            name="qkv",
        )(x)
        qkv = qkv.reshape(batch, tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        probs = nn.softmax(float_logits(scores), axis=-1).astype(v.dtype)
        probs = Dropout(self.attention_dropout)(probs, deterministic=not train)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, tokens, inner)
        out = nn.Dense(dim, kernel_init=self.kernel_init, dtype=self.dtype, name="out")(out)
        return Dropout(self.dropout)(out, deterministic=not train)


class EncoderBlock(nn.Module):
    """Pre-LN block: z + MHA(LN(z)), then z + MLP(LN(z)) with GELU."""

    num_heads: int
    head_dim: int
    mlp_dim: int
    qkv_bias: bool
    attention_dropout: float
    dropout: float
    layer_norm_eps: float
    kernel_init: nn.initializers.Initializer
    dtype: Any = None

    @nn.compact
    def __call__(self, z: jnp.ndarray, *, train: bool) -> jnp.ndarray:
        dim = z.shape[-1]
        y = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, name="norm1")(z)
        y = SelfAttention(
            self.num_heads,
            self.head_dim,
            self.qkv_bias,
            self.attention_dropout,
            self.dropout,
            self.kernel_init,
            self.dtype,
            name="attention",
        )(y, train=train)
        z = z + y
        y = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, name="norm2")(z)
        y = nn.Dense(self.mlp_dim, kernel_init=self.kernel_init, dtype=self.dtype, name="fc1")(y)
        y = nn.gelu(y, approximate=False)
        y = Dropout(self.dropout)(y, deterministic=not train)
        y = nn.Dense(dim, kernel_init=self.kernel_init, dtype=self.dtype, name="fc2")(y)
        y = Dropout(self.dropout)(y, deterministic=not train)
        return z + y


class ViT(nn.Module):
    """Pre-LN Vision Transformer with a CLS token.

    Attributes:
      num_classes: output logits.
      patch_size: p (square patches, stride p).
      dim: token width.
      depth: encoder blocks.
      num_heads: attention heads.
      head_dim: per-head width (None: dim // num_heads).
      mlp_dim: hidden width of the MLP.
      dropout: after the attention projection and in the MLP.
      attention_dropout: on the attention probabilities.
      embedding_dropout: on the token embeddings (after adding positions).
      pos_embedding: `"sinusoidal"` (fixed) or `"learned"`.
      pool: `"cls"` or `"mean"` (over all tokens).
      qkv_bias: bias in the qkv projection.
      layer_norm_eps: LayerNorm ε.
      kernel_init: `"xavier"` or `"torch"` (PyTorch's default U(±1/√fan_in)).
      token_init_std: std of the CLS token (and of learned positions) at init.
      dtype: compute dtype (None: float32; `layers.compute_dtype`). Parameters stay float32;
        LayerNorm statistics and the attention softmax are computed in float32.
    """

    num_classes: int = 100
    patch_size: int = 4
    dim: int = 192
    depth: int = 6
    num_heads: int = 3
    head_dim: int | None = None
    mlp_dim: int = 768
    dropout: float = 0.1
    attention_dropout: float = 0.1
    embedding_dropout: float = 0.0
    pos_embedding: str = "sinusoidal"
    pool: str = "cls"
    qkv_bias: bool = True
    layer_norm_eps: float = 1e-6
    kernel_init: str = "xavier"
    token_init_std: float = 0.02
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, *, train: bool = False) -> jnp.ndarray:
        kernel_init = KERNEL_INITS[self.kernel_init]
        x = as_float(x)
        if x.ndim == 3:
            x = x[..., None]
        z = nn.Dense(self.dim, kernel_init=kernel_init, dtype=self.dtype, name="patch_embed")(
            patchify(x, self.patch_size)
        )
        batch, tokens, _ = z.shape
        token_init = nn.initializers.normal(self.token_init_std)
        cls = self.param("cls_token", token_init, (1, 1, self.dim), jnp.float32)
        z = jnp.concatenate([jnp.broadcast_to(cls.astype(z.dtype), (batch, 1, self.dim)), z], 1)
        if self.pos_embedding == "learned":
            pos = self.param("pos_embedding", token_init, (1, tokens + 1, self.dim), jnp.float32)
        else:
            pos = jnp.asarray(sinusoidal_positions(tokens + 1, self.dim))[None]
        z = z + pos.astype(z.dtype)
        z = Dropout(self.embedding_dropout)(z, deterministic=not train)
        head_dim = self.head_dim or self.dim // self.num_heads
        for i in range(self.depth):
            z = EncoderBlock(
                self.num_heads,
                head_dim,
                self.mlp_dim,
                self.qkv_bias,
                self.attention_dropout,
                self.dropout,
                self.layer_norm_eps,
                kernel_init,
                self.dtype,
                name=f"block_{i}",
            )(z, train=train)
        pooled = z[:, 0] if self.pool == "cls" else jnp.mean(z, axis=1)
        pooled = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, name="head_norm")(
            pooled
        )
        head = nn.Dense(self.num_classes, kernel_init=kernel_init, dtype=self.dtype, name="head")
        return float_logits(head(pooled))


def _vit_model(**attributes) -> Model:
    attributes["dtype"] = compute_dtype(attributes["dtype"])
    check_choice("pos_embedding", attributes["pos_embedding"], POS_EMBEDDINGS)
    check_choice("pool", attributes["pool"], POOLS)
    check_choice("kernel_init", attributes["kernel_init"], tuple(KERNEL_INITS))
    for name in ("dropout", "attention_dropout", "embedding_dropout"):
        if not 0.0 <= attributes[name] < 1.0:
            raise ValueError(f"{name}={attributes[name]} must be in [0, 1).")
    head_dim = attributes["head_dim"]
    if head_dim is None and attributes["dim"] % attributes["num_heads"]:
        raise ValueError(
            f"dim={attributes['dim']} is not divisible by num_heads={attributes['num_heads']}."
        )
    return Model(ViT(**attributes))


def vit_tiny(
    *,
    num_classes: int = 100,
    patch_size: int = 4,
    dim: int = 192,
    depth: int = 6,
    num_heads: int = 3,
    mlp_ratio: float = 4.0,
    dropout: float = 0.1,
    pool: str = "cls",
    dtype: str = "float32",
) -> Model:
    """ViT-Tiny of FedPAC (Liu et al.) Appendix D.4 (choices the paper leaves open: see the module
    docstring).

    Args:
      num_classes: number of classes (100 for CIFAR-100).
      patch_size: 4 on 32×32 inputs (64 tokens).
      dim: embedding dimension (192).
      depth: encoder layers (6).
      num_heads: attention heads (3).
      mlp_ratio: MLP hidden width / dim (4, the ViT/DeiT value; the paper does not state it).
      dropout: on attention probabilities, attention output and MLP (0.1).
      pool: `"cls"` (default) or `"mean"`.
      dtype: `"float32"` or `"bfloat16"` (mixed precision: `layers.compute_dtype`).

    Returns:
      A classification `Model`.
    """
    return _vit_model(
        num_classes=int(num_classes),
        patch_size=int(patch_size),
        dim=int(dim),
        depth=int(depth),
        num_heads=int(num_heads),
        head_dim=None,
        mlp_dim=int(round(mlp_ratio * dim)),
        dropout=float(dropout),
        attention_dropout=float(dropout),
        embedding_dropout=0.0,
        pos_embedding="sinusoidal",
        pool=pool,
        qkv_bias=True,
        layer_norm_eps=1e-6,
        kernel_init="xavier",
        token_init_std=0.02,
        dtype=dtype,
    )


def vit_zg(
    *,
    num_classes: int = 10,
    patch_size: int = 4,
    dim: int = 512,
    depth: int = 6,
    num_heads: int = 8,
    head_dim: int = 64,
    mlp_dim: int = 512,
    dropout: float = 0.1,
    embedding_dropout: float = 0.1,
    dtype: str = "float32",
) -> Model:
    """The CIFAR ViT of FedMuon (Zhang & Gao) Appendix A.1 Table 2 (kentaroy47's ViT; see module
    docstring).

    Args:
      num_classes: number of classes (10 for CIFAR-10, 100 for CIFAR-100).
      patch_size: 4.
      dim: token width (512, from the reference script; the table omits it).
      depth: 6.
      num_heads: 8.
      head_dim: 64.
      mlp_dim: 512.
      dropout: encoder and MLP dropout (0.1).
      embedding_dropout: dropout on token embeddings (0.1 in the reference script).
      dtype: `"float32"` or `"bfloat16"` (mixed precision: `layers.compute_dtype`).

    Returns:
      A classification `Model`.
    """
    return _vit_model(
        num_classes=int(num_classes),
        patch_size=int(patch_size),
        dim=int(dim),
        depth=int(depth),
        num_heads=int(num_heads),
        head_dim=int(head_dim),
        mlp_dim=int(mlp_dim),
        dropout=float(dropout),
        attention_dropout=0.0,
        embedding_dropout=float(embedding_dropout),
        pos_embedding="learned",
        pool="cls",
        qkv_bias=False,
        layer_norm_eps=1e-5,
        kernel_init="torch",
        token_init_std=1.0,
        dtype=dtype,
    )
