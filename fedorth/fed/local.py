"""Local optimizers of federated clients: a direction, then correction, weight decay and lr.

A client's optimizer is built as

    chain(direction, [mix_with_global(beta)], [add_decayed_weights(wd)],
          scale_by_round_learning_rate())

so that the federated corrections act on the *direction* before the learning rate, exactly as
the papers' boxes write them: ``x <- x - eta [(1 - alpha) UV^T + lambda x + alpha Delta_G]``
(FedMuon (Liu et al.) Alg. 2 line 9) and ``x <- x - eta [(1 - beta) P_Theta(g) + beta g_G + lambda
x]``
(FedPAC (Liu et al.) Alg. 9 line 20). The learning rate is the round's (``eta_r``), passed by the
engine.

Directions are chosen by name from :data:`DIRECTIONS`; each factory takes the optimizer's
hyperparameters (``learning_rate`` and ``weight_decay`` are handled here, not by the direction).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from fedorth.optim import federated as fed_optim

PyTree = Any


def matrix_labels(params: PyTree) -> PyTree:
    """``"matrix"`` for dense and conv kernels, ``"other"`` for the rest.

    Muon's default mask, ``fedorth.optim.muon.default_muon_mask``: rank >= 2 and both dims of
    the ``(prod(shape[:-1]), shape[-1])`` view > 1, so a ``(1, 1, 192)`` cls token or a
    ``(1, n)`` row goes with the biases (its polar factor is u/|u|, and a width scale would
    read it as a 1 -> n layer); lookup tables (token and position embeddings, Swin's
    relative-position bias tables) go with them too, as in the Muon reference."""
    from fedorth.optim.muon import default_muon_mask

    return jax.tree.map(lambda m: "matrix" if m else "other", default_muon_mask(params))


def _sgd(*, momentum: float = 0.0, nesterov: bool = False):
    """SGD (``momentum = 0``) or heavy-ball momentum ``m <- mu m + g`` (``optax.trace``); a
    traced ``momentum`` (a sweep's value) always keeps ``m``."""
    if fed_optim.is_concrete(momentum) and momentum == 0.0:
        return optax.identity()
    return optax.trace(decay=momentum, nesterov=nesterov)


def _adamw(*, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
    """Adam's direction (``optax.scale_by_adam``); weight decay is added decoupled, as AdamW."""
    return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)


def _muon(
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    ema: bool = False,
    ns_steps: int = 5,
    ns_coeffs: Any = "jordan",
    shape_scaling: str = "jordan",
    fallback_lr_ratio: float = 1.0,
    fallback_b1: float = 0.9,
    fallback_b2: float = 0.999,
    group_shapes: bool = False,
    ns_dtype: Any = None,
    orthogonalizer: str = "newton_schulz",
    fallback: str = "adam",
    fallback_eps: float = 1e-8,
):
    """Muon on matrix leaves; the fallback scaled by ``fallback_lr_ratio`` (= its lr / lr) else.

    ``fallback``: "adam" (``optax.scale_by_adam(fallback_b1, fallback_b2, fallback_eps)``) or
    "momentum_sgd", the Muon leaves' own momentum (``beta``, ``ema``, ``nesterov``) without
    orthogonalization: M <- beta M + g (``ema``: + (1 - beta) g), the step M (``nesterov``:
    g + beta M, resp. (1 - beta) g + beta M). FedMuon-LMO (bias-corrected LMO) Appendix G steps
    the non-matrix leaves of both LocalMuon and FedMuon with momentum SGD at a tuned rate;
    ``fedmuon_bc`` runs its EMA momentum there, which is "momentum_sgd" with ``ema=True,
    nesterov=False, beta = 1 - alpha``.

    ``group_shapes``: one batched Newton–Schulz per group of equal-shape matrices
    (``fedorth.optim.muon.orthogonalize_tree``; opt-in, for accelerators). ``ns_dtype``:
    Newton–Schulz matmul operands, "bfloat16" | "float32" | None/"auto" (bfloat16 on GPU/TPU,
    float32 on CPU). ``orthogonalizer``: "newton_schulz" or "svd" (exact UV^T, FedMuon
    (Liu et al.) Alg. 2). The fallback Adam has optax's defaults b1 = 0.9, b2 = 0.999,
    eps = 1e-8, where the Muon reference's auxiliary Adam (KellerJordan/Muon
    ``MuonWithAuxAdam``) uses b2 = 0.95, eps = 1e-10."""
    from fedorth.optim.muon import scale_by_muon

    if fallback == "adam":
        other = optax.scale_by_adam(b1=fallback_b1, b2=fallback_b2, eps=fallback_eps)
    elif fallback == "momentum_sgd":
        # optax.trace is M <- beta M + g with the step M or g + beta M; the EMA form is that
        # times (1 - beta) (the zero start makes the two equal at every step).
        other = optax.chain(
            optax.trace(decay=beta, nesterov=nesterov), optax.scale(1.0 - beta if ema else 1.0)
        )
    else:
        raise ValueError(
            f"optim.fallback={fallback!r} is unknown; valid: ['adam', 'momentum_sgd']."
        )
    return optax.partition(
        {
            "matrix": scale_by_muon(
                beta,
                nesterov=nesterov,
                ema=ema,
                ns_steps=ns_steps,
                ns_coeffs=ns_coeffs,
                shape_scaling=shape_scaling,
                group_shapes=group_shapes,
                ns_dtype=ns_dtype,
                orthogonalizer=orthogonalizer,
            ),
            "other": optax.chain(other, optax.scale(fallback_lr_ratio)),
        },
        matrix_labels,
    )


def _soap(**kwargs):
    from fedorth.optim.soap import scale_by_soap

    return scale_by_soap(**kwargs)


def _sophia(**kwargs):
    from fedorth.optim.sophia import scale_by_sophia

    return scale_by_sophia(**kwargs)


def _lmo(*, norm: str = "spectral", momentum: float = 0.0, **kwargs):
    from fedorth.optim.muon import scale_by_lmo

    parts = [fed_optim.ema(momentum)] if momentum else []
    return optax.chain(*parts, scale_by_lmo(norm, **kwargs))


DIRECTIONS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "sgd": _sgd,
    "adamw": _adamw,
    "muon": _muon,
    "soap": _soap,
    "sophia": _sophia,
    "lmo": _lmo,
}
"""Local optimizer directions by name (the config key ``optim.name``): ``factory(**hparams)``
returns the direction transform; the ``optim.*`` keys besides :data:`OPTIM_KEYS` are its keyword
arguments (:func:`direction_keywords`). docs/guides/optimizer.md adds one."""


# Directions whose factory forwards ``**kwargs`` to a transform: the keywords that transform
# accepts are the optimizer's too (read lazily: the modules load on first use).
_FORWARDED = {
    "soap": ("fedorth.optim.soap", "scale_by_soap"),
    "sophia": ("fedorth.optim.sophia", "scale_by_sophia"),
    "lmo": ("fedorth.optim.muon", "scale_by_lmo"),
}


def direction_keywords(name: str) -> list[str]:
    """The hyperparameters (``optim.*`` keys besides :data:`OPTIM_KEYS`) optimizer ``name`` takes.

    Read from the signatures of its factory in :data:`DIRECTIONS` and, for a factory that
    forwards ``**kwargs``, of the transform it forwards them to.
    """
    import importlib

    fns = [DIRECTIONS[name]]
    if name in _FORWARDED:
        module, attr = _FORWARDED[name]
        fns.append(getattr(importlib.import_module(module), attr))
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sorted(
        {
            p.name
            for fn in fns
            for p in inspect.signature(inspect.unwrap(fn)).parameters.values()
            if p.kind in named
        }
    )


def direction(name: str, **hparams) -> optax.GradientTransformation:
    """The direction transform of optimizer ``name`` (see :data:`DIRECTIONS`).

    Raises:
      ValueError: ``name`` is unknown, or a hyperparameter is not one of ``name``'s (the message
        names the ``optim.*`` keys, as a config or an ``optim`` dict spells them).
    """
    if name not in DIRECTIONS:
        raise ValueError(f"optim.name={name!r} is unknown; valid: {sorted(DIRECTIONS)}.")
    accepted = direction_keywords(name)
    unknown = sorted(set(hparams) - set(accepted))
    if unknown:
        raise ValueError(
            f"optim.name={name!r} does not take {', '.join('optim.' + k for k in unknown)}; "
            f"its optim keys are {sorted([*OPTIM_KEYS, *accepted])}."
        )
    try:
        return DIRECTIONS[name](**hparams)
    except TypeError as e:  # a value of the wrong type: name the keys, not the factory
        message = re.sub(r"\b\w+\(\) ", "", str(e))
        raise ValueError(f"optim.name={name!r} with {hparams}: {message}") from e


def decay_rates(name: str, weight_decay: float, hparams: Mapping[str, Any]) -> float | dict:
    """The decoupled weight decay of optimizer ``name``: ``lambda`` for every leaf, or per group.

    Each parameter group decays at its own rate, ``lr_group * lambda``, as in the authors' code
    (FedPAC (Liu et al.) ``main_FedPAC.py``: the ``SingleDeviceMuonWithAuxAdam`` groups, each
    with its own lr and ``weight_decay``; KellerJordan/Muon's ``MuonWithAuxAdam`` likewise).
    Muon's fallback runs at ``fallback_lr_ratio * lr``, so its leaves (``matrix_labels`` "other")
    decay with ``fallback_lr_ratio * lambda``: ``{"matrix": lambda, "other": ratio * lambda}``
    for :func:`local_tx`. Any other optimizer has one group: ``lambda``. A traced ``lambda``
    (a sweep's value) is split by the ratio alone.
    """
    ratio = float(hparams.get("fallback_lr_ratio", 1.0)) if name == "muon" else 1.0
    if ratio == 1.0 or (fed_optim.is_concrete(weight_decay) and not weight_decay):
        return weight_decay
    return {"matrix": weight_decay, "other": ratio * weight_decay}


SCHEDULE_KEYS = ("learning_rate", "schedule", "warmup_rounds", "final_lr_ratio", "step_rounds")
OPTIM_KEYS = ("name", "weight_decay", "ns_dtype", *SCHEDULE_KEYS)
"""``optim.*`` keys every optimizer takes (read by :func:`split_optim` and the round).

``ns_dtype`` (``configs/base.py``: "auto") is the Newton–Schulz matmul dtype; it reaches the
optimizers that run Newton–Schulz (those whose factory takes ``ns_dtype``), and any other
optimizer takes only its default "auto"."""


def split_optim(optim: Mapping[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """Splits an ``optim`` config into (name, weight_decay, direction hyperparameters)."""
    hp = dict(optim)
    name = hp.pop("name")
    for key in SCHEDULE_KEYS:  # the round's learning rate is the engine's, not the optimizer's
        hp.pop(key, None)
    weight_decay = hp.pop("weight_decay", 0.0)
    if fed_optim.is_concrete(weight_decay):  # a sweep's traced value stays an array
        weight_decay = float(weight_decay)
    ns_dtype = hp.pop("ns_dtype", None)
    if ns_dtype not in (None, "auto"):  # "auto" is every NS transform's default: not passed
        if name in DIRECTIONS and "ns_dtype" not in direction_keywords(name):
            raise ValueError(
                f"optim.ns_dtype={ns_dtype!r} sets the Newton–Schulz matmul dtype; "
                f"optim.name={name!r} runs no Newton–Schulz (leave optim.ns_dtype='auto')."
            )
        hp["ns_dtype"] = ns_dtype
    return name, weight_decay, hp


def local_tx(
    direction_tx: optax.GradientTransformation,
    *,
    weight_decay: float | Mapping[str, float] = 0.0,
    mix_beta: float | None = None,
    pre: tuple[optax.GradientTransformation, ...] = (),
) -> optax.GradientTransformationExtraArgs:
    """``chain(*pre, direction, [mix(beta)], [decay(wd)], scale_by_round_learning_rate())``.

    Args:
      direction_tx: the optimizer's direction.
      weight_decay: decoupled weight decay ``lambda`` (added after mixing, before the lr); a
        mapping ``{"matrix": ..., "other": ...}`` decays the groups of :func:`matrix_labels`
        each at its own rate (:func:`decay_rates`). A concrete 0 adds nothing; a traced rate
        (a sweep's value) always adds ``lambda x`` (``x * 0`` where it is 0: the same numbers).
      mix_beta: if not None, mix with the global direction (``Corrections(global_direction=True)``).
      pre: transforms applied to the gradient first (SCAFFOLD's control-variate correction).
    """
    rates = dict(weight_decay) if isinstance(weight_decay, Mapping) else {"all": weight_decay}
    if any(fed_optim.is_concrete(rate) and rate < 0 for rate in rates.values()):
        raise ValueError(f"optim.weight_decay={weight_decay} must be >= 0.")
    parts = [*pre, direction_tx]
    if mix_beta is not None:
        parts.append(fed_optim.mix_with_global(mix_beta))
    if isinstance(weight_decay, Mapping):
        parts.append(
            optax.partition(
                {label: optax.add_decayed_weights(rate) for label, rate in rates.items()},
                matrix_labels,
            )
        )
    elif not fed_optim.is_concrete(weight_decay) or weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(fed_optim.scale_by_round_learning_rate())
    return optax.chain(*parts)
