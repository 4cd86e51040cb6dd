"""FLOP counts of the round benchmark: model FLOPs of a local step, Newton–Schulz FLOPs of Muon.

Model FLOPs are counted on the loss's jaxpr (matmuls and convolutions), so a convolution counts
the same however XLA runs it; XLA's own cost analysis (`step_flops`) is kept for dense checks.
"""

from __future__ import annotations

import math

import jax
import jax.extend.core as jax_core

from fedorth.optim.newton_schulz import newton_schulz_flops


def cost_flops(compiled) -> float:
    """``flops`` of XLA's cost analysis of a compiled executable (loop bodies count once)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0]
    return float(cost.get("flops", 0.0))


def step_flops(loss_fn, params, model_state, batch, key) -> float:
    """FLOPs of one forward + backward pass, from XLA's cost analysis of the jitted gradient."""
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    return cost_flops(grad_fn.lower(params, model_state, batch, key).compile())


def _conv_macs(eqn) -> int:
    """Multiply-adds of one ``conv_general_dilated``: every output element sums (rhs input
    features) × (kernel taps) products, padded borders included (as im2col's dot computes them)."""
    rhs = eqn.invars[1].aval
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
    taps = math.prod(rhs.shape[d] for d in spec[2:])
    return math.prod(eqn.outvars[0].aval.shape) * rhs.shape[spec[1]] * taps


def _dot_macs(eqn) -> int:
    lhs = eqn.invars[0].aval
    (contract, _), _ = eqn.params["dimension_numbers"]
    return math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in contract)


def _sub_jaxprs(value):
    if isinstance(value, jax_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax_core.Jaxpr):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _sub_jaxprs(item)


def jaxpr_flops(jaxpr) -> int:
    """2 × the multiply-adds of every ``dot_general`` and ``conv_general_dilated`` in `jaxpr`.

    Sub-jaxprs are entered: calls (jit; custom_jvp/custom_vjp calls: their primal computation),
    ``scan`` bodies times their length, ``cond`` the costliest branch, ``while`` bodies once
    (trip count unknown).
    Elementwise work is not counted (the matmul/convolution convention of model FLOPs).
    """
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += 2 * _dot_macs(eqn)
        elif name == "conv_general_dilated":
            total += 2 * _conv_macs(eqn)
        elif name == "cond":
            total += max(jaxpr_flops(b.jaxpr) for b in eqn.params["branches"])
        else:
            inner = sum(jaxpr_flops(j) for v in eqn.params.values() for j in _sub_jaxprs(v))
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


def model_step_flops(loss_fn, params, model_state, batch, key) -> int:
    """Model FLOPs of one local step: 3 × the forward pass's (`jaxpr_flops` of the loss).

    The convention of model-FLOP utilization: the backward pass costs twice the forward (the
    gradients w.r.t. a layer's inputs and its weights, one product each), whatever runs it.
    Counted on the loss's jaxpr, so every convolution counts the same whether XLA runs it as a
    convolution (which XLA:GPU's cost analysis does not count: cuDNN calls), as im2col + dot, or
    as the canonical convolution's custom VJP (its primal computation is entered). The first
    layer's input gradient, which no step computes, is included (< 1% on the bench models).
    `step_flops` (XLA's own count of the gradient) is kept for dense checks.
    """
    return 3 * jaxpr_flops(jax.make_jaxpr(loss_fn)(params, model_state, batch, key).jaxpr)


def muon_flops(params, ns_steps: int = 5) -> int:
    """Newton–Schulz FLOPs of one Muon update: every leaf of rank >= 2 as (prod(lead), last)."""
    total = 0
    for leaf in jax.tree.leaves(params):
        if leaf.ndim >= 2:
            total += newton_schulz_flops((math.prod(leaf.shape[:-1]), leaf.shape[-1]), ns_steps)
    return total
