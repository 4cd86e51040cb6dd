"""ResNet-18 with the CIFAR stem (FedMuon (Liu et al.), FedMuon-LMO, FedMuon (Zhang & Gao) and
FedPAC (Liu et al.)), BatchNorm or GroupNorm.

Architecture (He et al., 2016, adapted to 32×32 inputs as FedPAC (Liu et al.) Appendix D.3 states:
"Replace
the original 7×7 convolution with a 3×3 kernel; remove the initial downsampling layers (stride-2
convolution and max pooling)"): conv 3×3/64 → norm → ReLU → 4 stages of 2 BasicBlocks with
64, 128, 256, 512 channels and strides 1, 2, 2, 2 → global average pool → dense. BasicBlock:
conv3×3 → norm → ReLU → conv3×3 → norm, plus the identity or a 1×1 conv + norm shortcut when the
shape changes, then ReLU. Convolutions have no bias. With BatchNorm and 10 classes the model has
11,173,962 parameters (the well-known CIFAR ResNet-18 count; GroupNorm has the same count, and
BatchNorm adds 9,600 running statistics in `batch_stats`).

Normalization per paper: FedPAC (Liu et al.) (Appendix D.3) compares BN and GN and uses BN
("ResNet-18-BN"); FedMuon-LMO (§7.1) uses GroupNorm "following Hsieh et al. (2020)", who, like
Reddi et al. (2021), use GroupNorm with **2 groups**: hence `num_groups=2` by default for
`norm="group"`. FedMuon (Liu et al.) and FedMuon (Zhang & Gao) do not say. BatchNorm uses
PyTorch's defaults (momentum 0.1, i.e. Flax momentum 0.9, ε = 1e-5) since the papers' code is
PyTorch. Kernels use Flax's default LeCun-normal initialization.
`width` scales every channel count (64·width, ...) for reduced-width benchmarks and tests.
"""

from collections.abc import Sequence
from functools import partial
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
)

NORMS = ("batch", "group")


class BasicBlock(nn.Module):
    """The two-convolution residual block of ResNet-18/34."""

    channels: int
    strides: int
    norm: partial
    conv_impl: str
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        conv = partial(conv2d, use_bias=False, impl=self.conv_impl, dtype=self.dtype)
        s = (self.strides, self.strides)
        y = conv(self.channels, (3, 3), strides=s, padding=((1, 1), (1, 1)))(x)
        y = nn.relu(self.norm()(y))
        y = conv(self.channels, (3, 3), padding=((1, 1), (1, 1)))(y)
        y = self.norm()(y)
        if self.strides != 1 or x.shape[-1] != self.channels:
            x = conv(self.channels, (1, 1), strides=s, padding="VALID", name="shortcut_conv")(x)
            x = self.norm(name="shortcut_norm")(x)
        return nn.relu(x + y)


class ResNet18(nn.Module):
    """ResNet-18 with the CIFAR stem.

    Attributes:
      num_classes: output logits.
      norm: `"batch"` or `"group"`.
      num_groups: groups of GroupNorm (ignored for BatchNorm).
      width: channel multiplier (1.0 is the standard 64-128-256-512 network).
      stage_sizes: blocks per stage.
      conv_impl: `"lax"`, `"matmul"`, `"canonical"` or `"auto"` (`layers.resolve_conv_impl`; same
        parameters).
      dtype: compute dtype (None: float32; `layers.compute_dtype`). Parameters and BatchNorm's
        running statistics stay float32, and the normalization statistics are computed in
        float32 (Flax's `force_float32_reductions`).
    """

    num_classes: int = 10
    norm: str = "batch"
    num_groups: int = 2
    width: float = 1.0
    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    conv_impl: str = "auto"
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, *, train: bool = False) -> jnp.ndarray:
        x = as_float(x)
        if self.norm == "batch":
            norm = partial(
                nn.BatchNorm,
                use_running_average=not train,
                momentum=0.9,
                epsilon=1e-5,
                dtype=self.dtype,
            )
        else:
            norm = partial(nn.GroupNorm, num_groups=self.num_groups, epsilon=1e-5, dtype=self.dtype)
        widths = stage_widths(self.width)
        x = conv2d(
            widths[0],
            (3, 3),
            padding=((1, 1), (1, 1)),
            use_bias=False,
            impl=self.conv_impl,
            name="stem_conv",
            dtype=self.dtype,
        )(x)
        x = nn.relu(norm(name="stem_norm")(x))
        for stage, (blocks, channels) in enumerate(zip(self.stage_sizes, widths, strict=True)):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = BasicBlock(channels, strides, norm, self.conv_impl, self.dtype)(x)
        x = jnp.mean(x, axis=(-3, -2))
        return float_logits(nn.Dense(self.num_classes, dtype=self.dtype)(x))


def stage_widths(width: float) -> tuple[int, ...]:
    """Channels of the four stages, `round(c·width)` for c in 64, 128, 256, 512."""
    return tuple(max(1, int(round(c * width))) for c in (64, 128, 256, 512))


def resnet18(
    *,
    num_classes: int = 10,
    norm: str = "batch",
    num_groups: int = 2,
    width: float = 1.0,
    conv_impl: str = "auto",
    dtype: str = "float32",
) -> Model:
    """The `resnet18` model (CIFAR stem; FedPAC (Liu et al.) Appendix D.3, FedMuon-LMO §7.1): see
    `ResNet18`.

    Args:
      num_classes: number of classes.
      norm: `"batch"` (FedPAC (Liu et al.)) or `"group"` (FedMuon-LMO).
      num_groups: GroupNorm groups (2, after Hsieh et al. 2020, whom FedMuon-LMO follows).
      width: channel multiplier.
      conv_impl: `"lax"`, `"matmul"`, `"canonical"` or `"auto"` (`layers.resolve_conv_impl`).
      dtype: `"float32"` or `"bfloat16"` (mixed precision: `layers.compute_dtype`).

    Returns:
      A classification `Model`; with `norm="batch"` its `model_state` is `{"batch_stats": ...}`.
    """
    check_choice("norm", norm, NORMS)
    check_choice("conv_impl", conv_impl, CONV_IMPLS)
    if width <= 0:
        raise ValueError(f"width={width} must be positive.")
    if norm == "group":
        bad = [c for c in stage_widths(width) if c % num_groups]
        if num_groups <= 0 or bad:
            raise ValueError(
                f"num_groups={num_groups} must be positive and divide every stage width "
                f"{stage_widths(width)} (width={width})."
            )
    module = ResNet18(
        int(num_classes),
        norm,
        int(num_groups),
        float(width),
        (2, 2, 2, 2),
        conv_impl,
        compute_dtype(dtype),
    )
    return Model(module)
