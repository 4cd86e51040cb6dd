"""PyTorch peer of ``python -m experiments.bench round``: the same rounds, written PyTorch-style.

Written for this comparison, in the style of the papers' released code (PyTorch): one model object,
the sampled clients in a Python loop, each client loading the global weights
(``load_state_dict``), running ``K`` local steps with a ``torch.optim`` optimizer
(``zero_grad``/``backward``/``step``) on mini-batches drawn with replacement from its own
examples, and the server averaging the clients' weights (and, for FedPAC, their optimizer
states) in Python. The optimizers are our own faithful versions of the authors' references,
written from the papers and the fedorth docstrings (no code copied):

* ``Muon`` -- Jordan et al. (github KellerJordan/Muon, modded-nanogpt convention):
  ``M <- beta M + g``, Nesterov ``g + beta M``, quintic Newton–Schulz (3.4445, -4.7750, 2.0315)
  on the short side of the matrix after ``X / (||X||_F + 1e-7)``, scaled by
  ``sqrt(max(1, fan_out / fan_in))``; conv weights ``(out, in, kh, kw)`` are viewed as
  ``(out, in*kh*kw)``; non-matrix parameters use Adam. NS runs in float32 (the reference uses
  bfloat16 on GPU) so that both sides do the same arithmetic as fedorth (float32, HIGHEST).
* ``SOAP`` -- Vyas et al. (github nikhilvyas/SOAP): Adam in the eigenbasis of per-axis Shampoo
  factors; the first step only builds the factors and ``Q = eigh`` (descending); every
  ``precondition_frequency`` steps one power iteration + QR with the columns sorted by the
  estimated eigenvalues and ``exp_avg_sq`` permuted; 1-D parameters get Adam.
* ``Sophia`` -- Liu et al. (github Liuhong99/Sophia) in the form of FedPAC (Liu et al.) Alg. 8
(fedorth's
  ``clip_mode="paper"``, Hutchinson estimator): ``m <- b1 m + (1-b1) g``; every ``k``-th step
  ``h <- b2 h + (1-b2) max(u * Hu, 0)`` with a Rademacher ``u`` and ``Hu`` by double backward;
  direction ``clip(m / max(h, eps), -rho, rho)``.

FedPAC (Liu et al., Alg. 2) on top of any of them: the server averages the optimizer states
(SOAP: the factors are averaged and ``Q`` rebuilt by ``eigh``; ``exp_avg`` is averaged in the
original space), clients warm-start from it, and each local direction is mixed as
``(1 - beta) d + beta g_G`` with ``g_G = -mean_i(dx_i) / (K lr)``. What a client warm-starts is
fedorth's ``fed.options.aligned`` (``Peer(aligned=...)``):

* ``"theta"`` (fedorth's default, Alg. 2): the preconditioner ``Theta`` and what the server
  derives from it (each optimizer's ``ALIGNED`` keys: SOAP ``L, R``, ``Q`` and the schedule
  counter ``count``; Sophia ``h`` and its counter; Muon the matrices' momentum); the rest
  restarts every round. SOAP's moments restart, so every round begins with the update-free call
  that adds the client's first gradient to the server's ``L, R`` and rebuilds ``Q`` by ``eigh``
  (one ``eigh`` per factor, client and round), and its basis refresh runs every
  ``precondition_frequency`` calls of the whole training (``count``). The server's ``Q``, rebuilt
  by ``eigh`` as part of the whole-state average, is replaced by that call before any use:
  fedorth's server skips it in this mode (``fedorth.optim.soap.average_soap_states``), this peer
  keeps the plain whole-state average (S + 1 ``eigh`` per factor and round against fedorth's S;
  the parameters are the same);
* ``"state"``: the whole state, ``step`` counts included (after round 1, SOAP makes no
  update-free call).

FedAvg is ``torch.optim.SGD`` with a fresh optimizer per client and round.

The models mirror fedorth.models layer for layer (same parameter counts; NCHW layout):
``mlp``, ``lenet5``, ``cnn``, ``vit_tiny`` and ``resnet18`` (``width`` scales the channels).

Threads: callers set ``torch.set_num_threads`` to the number of CPU cores JAX uses (the bench
does) so both frameworks get the same cores. Device: ``Peer(..., device=...)``; the bench puts the
peer on ``cuda`` when JAX's default backend is a GPU and torch sees one (same machine, same GPU),
and synchronizes before reading the clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ALGORITHMS = ("fedavg", "fedpac_muon", "fedpac_soap", "fedpac_sophia")
ALIGNED = ("theta", "state")  # fedorth's fed.options.aligned
MUON_COEFFS = (3.4445, -4.7750, 2.0315)

# ----------------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_sizes: Sequence[int], num_classes: int):
        super().__init__()
        widths = [in_features, *hidden_sizes]
        self.hidden = nn.ModuleList(
            nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True)
        )
        self.out = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = x.flatten(1)
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.out(x)


class LeNet5(nn.Module):
    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.c1 = nn.Conv2d(in_channels, 6, 5)
        self.c3 = nn.Conv2d(6, 16, 5)
        self.f5, self.f6 = nn.Linear(400, 120), nn.Linear(120, 84)
        self.out = nn.Linear(84, num_classes)

    def forward(self, x):
        if x.shape[-2:] == (28, 28):
            x = F.pad(x, (2, 2, 2, 2))
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c3(x)), 2)
        x = F.relu(self.f5(x.flatten(1)))
        return self.out(F.relu(self.f6(x)))


class CNN(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, size: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * (size // 4) ** 2, 384)
        self.fc2, self.out = nn.Linear(384, 192), nn.Linear(192, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.out(F.relu(self.fc2(x)))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = None
        if stride != 1 or c_in != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu((x if self.shortcut is None else self.shortcut(x)) + y)


class ResNet18(nn.Module):
    """CIFAR-stem ResNet-18 with BatchNorm (fedorth.models.resnet, ``norm="batch"``)."""

    def __init__(self, in_channels: int, num_classes: int, width: float = 1.0):
        super().__init__()
        widths = [max(1, int(round(c * width))) for c in (64, 128, 256, 512)]
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0])
        )
        blocks, c_in = [], widths[0]
        for stage, channels in enumerate(widths):
            for block in range(2):
                blocks.append(BasicBlock(c_in, channels, 2 if stage > 0 and block == 0 else 1))
                c_in = channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x):
        x = self.blocks(F.relu(self.stem(x)))
        return self.fc(x.mean(dim=(-2, -1)))


def sinusoidal_positions(num_positions: int, dim: int) -> torch.Tensor:
    """PE[t, 2i] = sin(t / 10000^{2i/d}), PE[t, 2i+1] = cos(same) (fedorth.models.vit)."""
    positions = torch.arange(num_positions, dtype=torch.float64)[:, None]
    freqs = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(positions * freqs)
    table[:, 1::2] = torch.cos(positions * freqs[: dim // 2])
    return table.float()


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp_dim), nn.Linear(mlp_dim, dim)
        self.dropout = dropout

    def forward(self, z):
        batch, tokens, dim = z.shape
        head_dim = dim // self.heads
        qkv = self.qkv(self.norm1(z)).reshape(batch, tokens, 3, self.heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(head_dim), dim=-1)
        probs = F.dropout(probs, self.dropout, self.training)
        out = (probs @ v).transpose(1, 2).reshape(batch, tokens, dim)
        z = z + F.dropout(self.proj(out), self.dropout, self.training)
        y = F.dropout(F.gelu(self.fc1(self.norm2(z))), self.dropout, self.training)
        return z + F.dropout(self.fc2(y), self.dropout, self.training)


class ViT(nn.Module):
    """Pre-LN ViT with a CLS token and fixed sinusoidal positions (fedorth ``vit_tiny``)."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        size: int = 32,
        patch_size: int = 4,
        dim: int = 192,
        depth: int = 6,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.patch_size = patch_size
        tokens = (size // patch_size) ** 2
        self.patch_embed = nn.Linear(patch_size * patch_size * in_channels, dim)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.register_buffer("pos", sinusoidal_positions(tokens + 1, dim)[None])
        mlp_dim = int(round(mlp_ratio * dim))
        self.blocks = nn.Sequential(
            *(EncoderBlock(dim, num_heads, mlp_dim, dropout) for _ in range(depth))
        )
        self.head_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        p = self.patch_size
        x = F.unfold(x, p, stride=p).transpose(1, 2)  # [B, tokens, C*p*p]
        z = self.patch_embed(x)
        z = torch.cat([self.cls_token.expand(z.shape[0], -1, -1), z], dim=1) + self.pos
        z = self.blocks(z)
        return self.head(self.head_norm(z[:, 0]))


def build_model(name: str, input_shape: Sequence[int], num_classes: int, **kwargs) -> nn.Module:
    """The peer of ``fedorth.models.get_model(name, **kwargs)`` on HWC ``input_shape``."""
    height, width, channels = input_shape
    if name == "mlp":
        return MLP(height * width * channels, kwargs.get("hidden_sizes", (200, 200)), num_classes)
    if name == "lenet5":
        return LeNet5(channels, num_classes)
    if name == "cnn":
        return CNN(channels, num_classes, height)
    if name == "resnet18":
        if kwargs.get("norm", "batch") != "batch":
            raise ValueError(f"torch peer resnet18 supports norm='batch' only, got {kwargs}.")
        return ResNet18(channels, num_classes, kwargs.get("width", 1.0))
    if name == "vit_tiny":
        return ViT(channels, num_classes, size=height, **kwargs)
    raise ValueError(
        f"torch peer: model name={name!r}; valid: mlp, lenet5, cnn, resnet18, vit_tiny."
    )


# ------------------------------------------------------------------------------- optimizers


def newton_schulz5(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Jordan's quintic NS on the short side: X <- aX + (bA + cA^2)X, A = X X^T."""
    a, b, c = MUON_COEFFS
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def _adam_direction(state, grad, b1, b2, eps):
    """optax.scale_by_adam: bias-corrected m / (sqrt(v) + eps)."""
    if "exp_avg" not in state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(grad)
        state["exp_avg_sq"] = torch.zeros_like(grad)
    state["step"] += 1
    state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
    state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
    m_hat = state["exp_avg"] / (1 - b1 ** state["step"])
    v_hat = state["exp_avg_sq"] / (1 - b2 ** state["step"])
    return m_hat / (v_hat.sqrt() + eps)


class DirectionOptimizer(torch.optim.Optimizer):
    """Base class: ``p <- p - lr [(1 - beta) d(g) + beta g_G]`` with ``d`` from the subclass.

    ``global_direction`` (a list aligned with the parameters) is FedPAC's ``g_G``; ``None`` (or
    ``beta = 0``) leaves the direction unmixed.
    """

    # The state keys FedPAC's Theta alignment warm-starts (``Peer(aligned="theta")``).
    ALIGNED: tuple[str, ...] = ()

    def __init__(self, params, lr: float, beta: float = 0.0, **defaults):
        super().__init__(params, dict(lr=lr, **defaults))
        self.beta = beta
        self.global_direction: list[torch.Tensor] | None = None

    def direction(self, p, grad, state, group) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                d = self.direction(p, p.grad, self.state[p], group)
                if self.global_direction is not None and self.beta:
                    d = (1 - self.beta) * d + self.beta * self.global_direction[index]
                p.add_(d, alpha=-group["lr"])
                index += 1


class Muon(DirectionOptimizer):
    """Muon on matrices (ndim >= 2), Adam (0.9, 0.999, 1e-8) on the rest; see module docstring."""

    ALIGNED = ("momentum_buffer",)  # Theta = {m} of the matrices; the Adam fallback restarts

    def __init__(self, params, lr, beta=0.0, momentum=0.95, ns_steps=5):
        super().__init__(params, lr, beta, momentum=momentum, ns_steps=ns_steps)

    def direction(self, p, grad, state, group):
        if p.ndim < 2:
            return _adam_direction(state, grad, 0.9, 0.999, 1e-8)
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(grad)
        d = grad.add(buf, alpha=group["momentum"])
        matrix = d.reshape(d.shape[0], -1)  # (out, in*kh*kw)
        scale = max(1.0, matrix.shape[0] / matrix.shape[1]) ** 0.5
        return (scale * newton_schulz5(matrix, group["ns_steps"])).view_as(p)


def soap_project(x: torch.Tensor, qs: list) -> torch.Tensor:
    """x x_1 Q_1^T ... x_k Q_k^T (each tensordot moves the rotated axis to the end)."""
    for q in qs:
        x = torch.tensordot(x, q, dims=([0], [0])) if q is not None else x.movedim(0, -1)
    return x


def soap_project_back(x: torch.Tensor, qs: list) -> torch.Tensor:
    for q in qs:
        x = torch.tensordot(x, q, dims=([0], [1])) if q is not None else x.movedim(0, -1)
    return x


# Seconds spent in torch.linalg's eigh and qr (SOAP's), summed over the calls: the bench reads it
# around a round, as fedorth.optim.linalg.host_seconds on the other side.
LINALG_SECONDS = [0.0]


def _timed(fn, *args):
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        LINALG_SECONDS[0] += time.perf_counter() - start


def soap_eigenbasis(gg: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a factor, largest eigenvalue first."""
    eye = torch.eye(gg.shape[0], dtype=gg.dtype, device=gg.device)
    return torch.flip(_timed(torch.linalg.eigh, gg + 1e-30 * eye)[1], dims=[1])


class SOAP(DirectionOptimizer):
    """SOAP (Vyas et al. 2024) without dimension merging; see the module docstring.

    Two counters, as in fedorth's ``SoapState``: ``count``, the calls so far (the basis refresh
    runs on a call with an update when ``count % precondition_frequency == 0``), and
    ``moment_count``, the calls since the moments were zero: the first of them is the
    update-free one, and the ``t`` of the bias correction is ``moment_count``. In a plain run
    they are equal; under Theta alignment ``count`` runs on and the moments restart each round.
    """

    ALIGNED = ("GG", "Q", "count")

    def __init__(
        self,
        params,
        lr,
        beta=0.0,
        betas=(0.95, 0.95),
        shampoo_beta=0.95,
        eps=1e-8,
        precondition_frequency=10,
        max_precond_dim=10000,
    ):
        super().__init__(
            params,
            lr,
            beta,
            betas=betas,
            shampoo_beta=shampoo_beta,
            eps=eps,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
        )

    @staticmethod
    def _update_factors(state, grad, shampoo_beta):
        for axis, gg in enumerate(state["GG"]):
            if gg is not None:
                others = [a for a in range(grad.ndim) if a != axis]
                gg.lerp_(torch.tensordot(grad, grad, dims=(others, others)), 1 - shampoo_beta)

    def direction(self, p, grad, state, group):
        b1, b2 = group["betas"]
        if "GG" not in state:  # a fresh SOAP: factors from zero
            rotate = p.ndim >= 2
            state["count"] = 0
            state["GG"] = [
                grad.new_zeros(d, d) if rotate and d <= group["max_precond_dim"] else None
                for d in grad.shape
            ]
        if "exp_avg" not in state:  # moments from zero (a fresh SOAP, or a Theta-aligned round)
            state["moment_count"] = 0
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
        count, t = state["count"], state["moment_count"]
        state["count"], state["moment_count"] = count + 1, t + 1
        if t == 0:  # the update-free call: factors, then Q = eigh
            self._update_factors(state, grad, group["shampoo_beta"])
            state["Q"] = [None if gg is None else soap_eigenbasis(gg) for gg in state["GG"]]
            return torch.zeros_like(grad)
        qs = state["Q"]
        rotated = soap_project(grad, qs)
        state["exp_avg"].mul_(b1).add_(rotated, alpha=1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(rotated, rotated, value=1 - b2)
        d = soap_project_back(state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"]), qs)
        d = d * (math.sqrt(1 - b2**t) / (1 - b1**t))
        self._update_factors(state, grad, group["shampoo_beta"])
        if count % group["precondition_frequency"] == 0:
            self._refresh(state)
        return d

    @staticmethod
    def _refresh(state):
        """One power iteration + QR per factor, columns sorted by the estimated eigenvalues."""
        exp_avg = soap_project_back(state["exp_avg"], state["Q"])
        exp_avg_sq = state["exp_avg_sq"]
        new_qs = []
        for axis, (gg, q) in enumerate(zip(state["GG"], state["Q"], strict=True)):
            if gg is None:
                new_qs.append(None)
                continue
            power = gg @ q
            order = torch.argsort((q * power).sum(0), descending=True)
            exp_avg_sq = exp_avg_sq.index_select(axis, order)
            new_qs.append(_timed(torch.linalg.qr, power[:, order])[0])
        state["Q"], state["exp_avg_sq"] = new_qs, exp_avg_sq
        state["exp_avg"] = soap_project(exp_avg, new_qs)


class Sophia(DirectionOptimizer):
    """Sophia as FedPAC (Liu et al.) Alg. 8 (Hutchinson); the caller sets ``hessian`` on refresh
    steps."""

    ALIGNED = ("hessian",)  # Theta = {h}; the schedule counter `count` is shared too

    def __init__(self, params, lr, beta=0.0, betas=(0.965, 0.99), rho=0.04, eps=1e-12, k=10):
        super().__init__(params, lr, beta, betas=betas, rho=rho, eps=eps, k=k)
        self.count = 0  # shared across parameters, like fedorth's schedule counter
        self.hessian: list[torch.Tensor] | None = None

    def needs_hessian(self) -> bool:
        return (self.count + 1) % self.param_groups[0]["k"] == 0

    def step(self, closure=None):
        self._index = 0
        super().step(closure)
        self.count += 1
        self.hessian = None

    def direction(self, p, grad, state, group):
        b1, b2 = group["betas"]
        if "hessian" not in state:
            state["hessian"] = torch.zeros_like(grad)
        if "exp_avg" not in state:  # a fresh Sophia, or a Theta-aligned round
            state["exp_avg"] = torch.zeros_like(grad)
        state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
        if self.hessian is not None:
            state["hessian"].mul_(b2).add_(self.hessian[self._index].clamp(min=0), alpha=1 - b2)
        self._index += 1
        denom = state["hessian"].clamp(min=group["eps"])
        return (state["exp_avg"] / denom).clamp(-group["rho"], group["rho"])


# ----------------------------------------------------------------------------- federation


def _mean(tensors):
    return torch.stack(list(tensors)).mean(0)


def average_optimizer_states(optimizers: list[DirectionOptimizer]) -> list[dict]:
    """Per parameter, the clients' states averaged (SOAP: Q rebuilt from the mean factors)."""
    per_param = [list(group["params"]) for group in optimizers[0].param_groups][0]
    out = []
    for index in range(len(per_param)):
        states = [opt.state[list(opt.param_groups[0]["params"])[index]] for opt in optimizers]
        first, avg = states[0], {}
        for key, value in first.items():
            if torch.is_tensor(value):
                avg[key] = _mean(s[key] for s in states)
            elif not isinstance(value, list):
                avg[key] = value  # integer step counts: shared
        if "GG" in first:
            avg["GG"] = [
                None if gg is None else _mean(s["GG"][axis] for s in states)
                for axis, gg in enumerate(first["GG"])
            ]
            avg["Q"] = [None if gg is None else soap_eigenbasis(gg) for gg in avg["GG"]]
            original = _mean(soap_project_back(s["exp_avg"], s["Q"]) for s in states)
            avg["exp_avg"] = soap_project(original, avg["Q"])
        out.append(avg)
    return out


def _copy_state(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, list):
        return [None if v is None else v.clone() for v in value]
    return value


class Peer:
    """One federated setup in PyTorch; ``run_round()`` runs one round in a Python loop.

    Args:
      model: a ``torch.nn.Module`` (see ``build_model``).
      algorithm: one of ``ALGORITHMS``.
      x: float32 inputs ``[M, C, H, W]``; y: int64 labels ``[M]``.
      partition: per-client index arrays into ``x``.
      clients_per_round, local_steps, batch_size, learning_rate: ``S``, ``K``, ``B``, ``eta``.
      beta: FedPAC's correction weight.
      aligned: what a FedPAC client warm-starts from the server's average, as fedorth's
        ``fed.options.aligned``: ``"theta"`` (the default there and here) or ``"state"`` (the
        module docstring says what each runs).
      seed: seeds client sampling, batches, probes and dropout.
      device: where the model, data and optimizer states live (``"cpu"``, ``"cuda"``, ...).
        Batch indices and Sophia's probes are drawn on the CPU and moved, so every device sees
        the same random streams; every other tensor is made on ``device`` (a SOAP round on cuda
        once failed in ``_update_factors``: factors made on the CPU). Call ``synchronize()``
        before reading a clock.
      amp: the ``torch_amp`` peer: model and batches in ``channels_last`` memory format, the
        forward pass under ``torch.autocast(dtype=bfloat16)`` (parameters, gradients and
        optimizer states stay float32), what a performance-minded PyTorch user writes.
    """

    def __init__(
        self,
        model: nn.Module,
        algorithm: str,
        x: torch.Tensor,
        y: torch.Tensor,
        partition: Sequence[np.ndarray],
        *,
        clients_per_round: int,
        local_steps: int,
        batch_size: int,
        learning_rate: float,
        beta: float = 0.5,
        aligned: str = "theta",
        seed: int = 0,
        device: str | torch.device = "cpu",
        amp: bool = False,
    ):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"torch peer: algorithm={algorithm!r}; valid: {ALGORITHMS}.")
        if aligned not in ALIGNED:
            raise ValueError(f"torch peer: aligned={aligned!r}; valid: {ALIGNED}.")
        self.aligned = aligned
        self.device = torch.device(device)
        self.amp = amp
        if amp:
            model = model.to(memory_format=torch.channels_last)
        self.model, self.algorithm = model.to(self.device), algorithm
        self.x, self.y = x.to(self.device), y.to(self.device)
        self.index = [
            torch.as_tensor(np.asarray(p), dtype=torch.long, device="cpu") for p in partition
        ]
        self.s, self.k, self.b, self.lr = clients_per_round, local_steps, batch_size, learning_rate
        self.beta = beta
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.global_weights = {k: v.clone() for k, v in model.state_dict().items()}
        self.server_opt_state: list[dict] | None = None
        self.global_direction = [torch.zeros_like(p) for p in model.parameters()]

    def synchronize(self) -> None:
        """Waits for the device's queued work (CUDA runs asynchronously; a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _optimizer(self):
        params = self.model.parameters()
        beta = self.beta
        if self.algorithm == "fedavg":
            return torch.optim.SGD(params, lr=self.lr)
        if self.algorithm == "fedpac_muon":
            opt = Muon(params, self.lr, beta)
        elif self.algorithm == "fedpac_soap":
            opt = SOAP(params, self.lr, beta)
        else:
            opt = Sophia(params, self.lr, beta)
        opt.global_direction = self.global_direction
        if self.server_opt_state is not None:
            keep = opt.ALIGNED if self.aligned == "theta" else None
            for p, saved in zip(opt.param_groups[0]["params"], self.server_opt_state, strict=True):
                opt.state[p] = {
                    k: _copy_state(v) for k, v in saved.items() if keep is None or k in keep
                }
            if isinstance(opt, Sophia):
                opt.count = self.sophia_count
        return opt

    def sample_batch(self, client: int):
        rows = self.index[client]
        picks = torch.randint(len(rows), (self.b,), generator=self.generator, device="cpu")
        chosen = rows[picks].to(self.device)
        x = self.x[chosen]
        if self.amp and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, self.y[chosen]

    def client_update(self, client: int):
        """``K`` local steps from the global weights; returns (state_dict, optimizer)."""
        model = self.model
        model.load_state_dict(self.global_weights)
        model.train()
        opt = self._optimizer()
        params = list(model.parameters())
        for _ in range(self.k):
            x, y = self.sample_batch(client)
            opt.zero_grad(set_to_none=False)
            # torch_amp: the forward pass (and so its backward) under bfloat16 autocast.
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
                loss = F.cross_entropy(model(x), y)
            if isinstance(opt, Sophia) and opt.needs_hessian():
                grads = torch.autograd.grad(loss, params, create_graph=True)
                probes = [
                    (
                        torch.randint(0, 2, p.shape, generator=self.generator, device="cpu").float()
                        * 2
                        - 1
                    ).to(self.device)
                    for p in params
                ]
                hvps = torch.autograd.grad(grads, params, grad_outputs=probes)
                opt.hessian = [u * hv for u, hv in zip(probes, hvps, strict=True)]
                for p, g in zip(params, grads, strict=True):
                    p.grad = g.detach()
            else:
                loss.backward()
            opt.step()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return weights, opt

    def run_round(self) -> None:
        """Samples ``S`` clients, runs them one after the other, averages on the server."""
        clients = np.sort(self.rng.choice(len(self.index), self.s, replace=False))
        results = [self.client_update(int(c)) for c in clients]
        new_weights = {}
        for key, value in self.global_weights.items():
            if value.is_floating_point():
                new_weights[key] = _mean(w[key] for w, _ in results)
            else:
                new_weights[key] = results[0][0][key]  # BatchNorm's num_batches_tracked
        if self.algorithm != "fedavg":
            names = [name for name, _ in self.model.named_parameters()]
            scale = -1.0 / (self.k * self.lr)
            self.global_direction = [
                scale * (new_weights[n] - self.global_weights[n]) for n in names
            ]
            optimizers = [opt for _, opt in results]
            self.server_opt_state = average_optimizer_states(optimizers)
            if isinstance(optimizers[0], Sophia):
                self.sophia_count = optimizers[0].count
        self.global_weights = new_weights
