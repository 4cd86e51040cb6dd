"""FedLADA: local Adam amended by the global average offset (Sun et al. 2023; a FedMuon (Liu et al.)
baseline).

Sun, Shen, Sun, Ding, Tao, "Efficient Federated Learning via Local Adaptive Amended Optimizer
with Linear Speedup", IEEE TPAMI 2023 (arXiv:2308.00522), Alg. 1; a baseline of FedMuon (Liu et
al.) Tables 2-4 ("FedLADA ... only aggregate[s] the second-moment estimate of Adam"). Round ``r``,
sampled client ``i``, local step ``k``::

    m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2          (m starts at 0 each round,
                                                               v at the server's v-bar)
    x <- x - eta [alpha m / (sqrt(v) + eps) + (1 - alpha) Delta]

with the global average offset of the previous round ``Delta = -mean_i(x_i^K - x^r)/(K eta)``
(the engine's ``g_G``, ``Delta^0 = 0``); the server averages the parameters (optionally with a
server learning rate) and the clients' final ``v`` (``v-bar``).

Source. Sun et al.'s box was out of reach; the defaults follow the FedMuon (Liu et al.) authors'
released FedLADA, ``update_FedLADA`` / ``apply_weights_FedLADA`` in junkangLiu0/FedAdamW
``main_FedAdamW.py`` (commit 618fc7f; the same code path is declared but unmapped in
junkangLiu0/FedMuon ``main_FedMuon.py``):

* ``torch.optim.Adam(lr = lr (1 - gamma), weight_decay = 0.001)`` with ``gamma = 0.9``, then
  after each step ``p += gamma lr / K * momen_m`` with ``momen_m = mean_i(dx_i) / lr``: the
  local Adam step has weight ``alpha = 1 - gamma = 0.1`` and the amendment ``0.9 Delta``;
* Adam's ``step`` is set to 10^6 at the start of each round, so neither ``m`` nor ``v`` is
  bias-corrected (``bias_correction=False``; with correction, round 1's steps at K = 50 are
  4.5x smaller); ``exp_avg`` restarts at 0, ``exp_avg_sq`` is the server's average;
* ``weight_decay=0.001`` of ``torch.optim.Adam`` is *coupled* (``g + lambda x`` enters both
  moments): ``coupled_weight_decay=True`` (the config's ``optim.weight_decay`` is then this
  lambda);
* no AMSGrad maximum (``amsgrad=False`` is torch's default there); whether Sun et al.'s Alg. 1
  has one is unconfirmed, and none is implemented;
* ``clip_grad_norm_(max_norm=10)`` before every step -- of *every* method in that code, FedAvg,
  FedCM, SCAFFOLD and the Muon variants alike. fedorth clips no method, so FedLADA's presets
  do not either (``clip_norm=None``; the option exists to reproduce the released runs).

``alpha = 1`` is local Adam with aligned ``v`` and no amendment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax

from fedorth.fed import local, start, update
from fedorth.fed.algorithm import FedAlgorithm
from fedorth.fed.corrections import Corrections
from fedorth.optim import federated as fed_optim
from fedorth.optim.momentum_vr import scale_by_adam_uncorrected


def adam_second_moment_mask(opt_state: Any) -> Any:
    """Bools like ``opt_state``: True on Adam's ``nu`` and ``count``, False elsewhere."""
    is_adam = lambda n: isinstance(n, optax.ScaleByAdamState)  # noqa: E731

    def mark(node):
        if is_adam(node):
            return optax.ScaleByAdamState(
                count=True,
                mu=jax.tree.map(lambda _: False, node.mu),
                nu=jax.tree.map(lambda _: True, node.nu),
            )
        return jax.tree.map(lambda _: False, node)

    return jax.tree.map(mark, opt_state, is_leaf=is_adam)


def fedlada(
    optim: Mapping[str, Any],
    *,
    alpha: float = 0.1,
    server_lr: float = 1.0,
    bias_correction: bool = False,
    coupled_weight_decay: bool = True,
    clip_norm: float | None = None,
) -> FedAlgorithm:
    """FedLADA (Sun et al. 2023, Alg. 1; module docstring for the released code it follows).

    Args:
      optim: ``name="adamw"`` with ``b1``, ``b2``, ``eps``, ``learning_rate`` (eta) and
        ``weight_decay`` (lambda).
      alpha: weight of the local Adam direction in (0, 1]; ``1 - alpha`` weights ``Delta``.
      server_lr: the server step on the averaged update (1: plain averaging).
      bias_correction: divide ``m`` and ``v`` by ``1 - b^t`` (optax's Adam, with the step count
        carried across rounds with ``v``); False: the released code's uncorrected Adam.
      coupled_weight_decay: add ``lambda x`` to the gradient before the moments (torch Adam's
        ``weight_decay``); False: decoupled, ``+ lambda x`` after the mixing (AdamW).
      clip_norm: clip each stochastic gradient to this global norm first (None: no clipping).
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(
            f"fed.options.alpha={alpha} must lie in (0, 1] (weight of the local direction)."
        )
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"fed.options.clip_norm={clip_norm} must be > 0 (or None).")
    opt, weight_decay, hp = local.split_optim(optim)
    if opt != "adamw":
        raise ValueError(f"fedlada runs local Adam: set optim.name='adamw', got {opt!r}.")
    if bias_correction:
        adam = local.direction(opt, **hp)
    else:
        unknown = sorted(set(hp) - {"b1", "b2", "eps"})
        if unknown:
            raise ValueError(f"fedlada: unknown optim keys {unknown} (b1, b2, eps).")
        adam = scale_by_adam_uncorrected(
            hp.get("b1", 0.9), hp.get("b2", 0.999), hp.get("eps", 1e-8)
        )
    pre = [] if clip_norm is None else [optax.clip_by_global_norm(clip_norm)]
    if coupled_weight_decay and weight_decay:
        pre.append(optax.add_decayed_weights(weight_decay))
    tx = local.local_tx(
        optax.chain(*pre, adam) if pre else adam,
        weight_decay=0.0 if coupled_weight_decay else weight_decay,
        mix_beta=1.0 - alpha if alpha < 1.0 else None,
    )
    return FedAlgorithm(
        name="fedlada",
        local_tx=tx,
        start=start.Global(mask=adam_second_moment_mask),
        corrections=Corrections(global_direction=alpha < 1.0),
        server=update.ServerUpdate(tx=optax.sgd(server_lr)),
        paper="Sun et al. 2023 (TPAMI), FedLADA Alg. 1; FedMuon (Liu et al.) Tables 2-4",
    )


def fedadamw(
    optim: Mapping[str, Any], *, gamma: float = 0.5, clip_norm: float | None = None
) -> FedAlgorithm:
    """FedAdamW (arXiv 2510.27486, by the FedMuon (Liu et al.) / FedPAC authors), as their
    released code runs it (junkangLiu0/FedAdamW ``main_FedAdamW.py``, commit 618fc7f,
    ``update_FedAdamW`` and ``apply_weights_FedLADA``, which FedAdamW shares with FedLADA).
    Round ``r``, sampled client ``i``, local step ``k``::

        m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2    (m from 0, v from the server's v-bar)
        x <- x - eta [m_hat / (sqrt(v_hat) + eps) + lambda x + gamma g_G]

    with ``g_G = -mean_i(x_i^K - x^r) / (K eta)`` of the previous round (0 in the first), and
    the server averaging ``x`` and the clients' final ``v``. Where it differs from FedLADA's
    released code (this module's docstring):

    * ``torch.optim.AdamW(lr, weight_decay=0.01)``: the whole AdamW step (not ``(1 - gamma)``
      of it), decoupled weight decay (``optim.weight_decay``);
    * ``gamma = 0.5`` (the code sets ``args.gamma = 0.5`` inside ``update_FedAdamW``): after each
      step ``p += gamma lr / K * momen_m`` with ``momen_m = mean_i(dx_i) / lr``
      (``fedorth.optim.federated.add_global_direction``);
    * Adam's ``step`` starts each round at the server's count, which grows by the local steps of
      a round (``step.add_(nums_sample / batch_size * E)``, 50 = K in its CIFAR-100 runs), so
      ``m`` and ``v`` are bias-corrected with the global step ``t = r K + k + 1``: optax's Adam
      with its count averaged and sent down with ``v`` (``start.Global`` on Adam's ``nu`` and
      ``count``).

    Choices: the code's ``clip_grad_norm_(max_norm=10)`` is ``clip_norm`` (None by default, as
    fedorth clips no method; FedLADA's rule). The paper's text was not read here: where it
    differs from its released code (a per-tensor mean of ``v``, commented out in the code),
    fedorth follows the code.

    Args:
      optim: ``name="adamw"`` with ``b1``, ``b2``, ``eps``, ``learning_rate`` and
        ``weight_decay`` (decoupled).
      gamma: weight of the previous round's global direction, >= 0.
      clip_norm: clip each stochastic gradient to this global norm first (None: no clipping).
    """
    if fed_optim.is_concrete(gamma) and not gamma >= 0:
        raise ValueError(f"fed.options.gamma={gamma} must be >= 0 (weight of g_G).")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"fed.options.clip_norm={clip_norm} must be > 0 (or None).")
    opt, weight_decay, hp = local.split_optim(optim)
    if opt != "adamw":
        raise ValueError(f"fedadamw runs local AdamW: set optim.name='adamw', got {opt!r}.")
    pre = [] if clip_norm is None else [optax.clip_by_global_norm(clip_norm)]
    direction = optax.chain(*pre, local.direction(opt, **hp), fed_optim.add_global_direction(gamma))
    return FedAlgorithm(
        name="fedadamw",
        local_tx=local.local_tx(direction, weight_decay=local.decay_rates(opt, weight_decay, hp)),
        start=start.Global(mask=adam_second_moment_mask),
        corrections=Corrections(global_direction=True),
        server=update.ServerUpdate(),
        paper="FedAdamW (arXiv 2510.27486), the authors' released code",
    )
