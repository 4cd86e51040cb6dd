"""Client-level differential privacy in the round: DP-FedAvg's clipped, noised aggregate.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models",
Alg. 1, the fixed-denominator estimator ``f_f``): after its local steps, client ``i``'s whole
upload ``u_i`` (its update ``x_i^K - x^r``, and, for the algorithms that upload more, its
averaged optimizer state (FedPAC's ``Theta``, FedMuon's momentum), its control-variate change
and its report, concatenated: one norm) is clipped to L2 norm ``C``,

    u_i <- u_i * min(1, C / ||u_i||),

and the server replaces the mean of the uploads by

    (sum_i u_i + N(0, sigma_Delta^2 C^2 I)) / D,

with ``D`` the expected cohort size, fixed before the round (``S`` when ``S`` clients are
sampled without replacement; ``q N`` under Poisson sampling). The noise is drawn from the round's
key (``RoundContext.key``), so a run is reproducible and every execution strategy sees the same
noise.

Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping",
Alg. 1): each client also uploads ``b_i = [||u_i|| <= C]``; the server forms the noisy fraction
``b~ = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / D + 1/2`` and takes the geometric step
``C <- C exp(-eta_C (b~ - gamma))`` towards the target quantile ``gamma``. The two releases share
the noise budget of one Gaussian mechanism of multiplier ``sigma`` (their Theorem 1):
``sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)``.

Poisson sampling (``ClientDP.sampling == "poisson"``) runs every client (``S = N``) and masks
each one independently with probability ``q`` from its own key: a masked client uploads zero and
keeps its persistent state, exactly the Poisson-sampled round the accountant composes.

Not protected (docs/PRIVACY.md): the training diagnostics the simulation logs from individual
clients (``train_loss``, ``client_drift``, ``client_cosine``, ``precond_drift``), the server's
own evaluation, per-client state that never leaves the client, and (for fixed-size sampling)
which clients were sampled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from fedorth.fed import reduce
from fedorth.optim import federated as fed_optim

PyTree = Any

# What a client uploads to the server's aggregate (``fedorth.fed.client.per_client_outputs``).
UPLOADS = ("delta", "control_diff", "opt_state", "report")
UNCLIPPED = "dp_unclipped"
SAMPLINGS = ("fixed", "poisson")


@dataclasses.dataclass(frozen=True)
class ClientDP:
    """DP-FedAvg's static settings (module docstring).

    Attributes:
      clip_norm: the initial (or, without adaptive clipping, the fixed) clip norm ``C``.
      noise_multiplier: ``sigma``: the aggregate's noise std is ``sigma C`` (``sigma_Delta C``
        with adaptive clipping).
      denominator: ``D``, the expected cohort size.
      sampling: ``"fixed"`` (``S`` of ``N`` without replacement) or ``"poisson"`` (each client
        with probability ``sampling_rate``; the round runs all ``N``).
      sampling_rate: ``q`` under Poisson sampling.
      adaptive_quantile: ``gamma``, or None for a fixed clip norm.
      clip_learning_rate: ``eta_C`` of the geometric update.
      count_noise_multiplier: ``sigma_b``, the noise std of the clipped count.
    """

    clip_norm: float
    noise_multiplier: float
    denominator: float
    sampling: str = "fixed"
    sampling_rate: float = 1.0
    adaptive_quantile: float | None = None
    clip_learning_rate: float = 0.2
    count_noise_multiplier: float = 0.0

    @property
    def update_noise_multiplier(self) -> float:
        """``sigma_Delta``: ``sigma`` itself, or Andrew et al.'s Theorem 1 share of it."""
        sigma = self.noise_multiplier
        if self.adaptive_quantile is None or sigma == 0:
            return sigma
        return (sigma**-2 - (2 * self.count_noise_multiplier) ** -2) ** -0.5


def init_state(dp: ClientDP | None) -> PyTree:
    """The server's privacy state before round 0: the clip norm ``C`` (None without DP)."""
    if dp is None:
        return None
    # The default float: float64 under jax_enable_x64 (the float64 reference tests).
    return {"clip_norm": jnp.asarray(dp.clip_norm, jnp.result_type(float))}


def round_keys(round_key: jax.Array) -> dict[str, jax.Array]:
    """The keys of a round's privacy draws, from the second half of the round key's split (the
    first draws the sampled ids): ``"noise"`` (the aggregate's, leaf ``j`` from
    ``fold_in(noise, j)``, :func:`gaussian_noise`), ``"count"`` (the clipped count's) and
    ``"mask"`` (Poisson sampling's, client ``i`` from ``fold_in(mask, i)``)."""
    _, key = jax.random.split(round_key)
    aggregate_key, mask_key = jax.random.split(key)
    count_key, noise_key = jax.random.split(aggregate_key)
    return {"noise": noise_key, "count": count_key, "mask": mask_key}


def participates(dp: ClientDP, ctx, client_id: jax.Array) -> jax.Array:
    """Whether client ``client_id`` joins the round (always, for fixed-size sampling)."""
    if dp.sampling == "fixed":
        return jnp.asarray(True)
    mask_key = round_keys(ctx.key)["mask"]
    return jax.random.uniform(jax.random.fold_in(mask_key, client_id)) < dp.sampling_rate


def _upload_leaves(averaged: dict) -> list[jax.Array]:
    groups = {name: averaged[name] for name in UPLOADS if name in averaged}
    return [x for x in jax.tree.leaves(groups) if fed_optim.is_float(x)]


def clip_upload(dp: ClientDP, ctx, averaged: dict, client_id: jax.Array) -> dict:
    """One client's upload clipped jointly to ``C`` (zero when Poisson sampling leaves it
    out), with its clipped indicator ``b_i - 1/2`` under :data:`UNCLIPPED`."""
    clip_norm = ctx.server.privacy["clip_norm"]
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(reduce._wide(x))) for x in _upload_leaves(averaged)))
    joined = participates(dp, ctx, client_id)
    factor = jnp.where(joined, jnp.minimum(1.0, clip_norm / norm), 0.0)
    out = dict(averaged)
    for name in UPLOADS:
        if name in out:
            out[name] = jax.tree.map(
                lambda x: x * factor.astype(x.dtype) if fed_optim.is_float(x) else x, out[name]
            )
    unclipped = (norm <= clip_norm).astype(clip_norm.dtype) - 0.5
    out[UNCLIPPED] = jnp.where(joined, unclipped, 0.0)
    return out


def gaussian_noise(key: jax.Array, tree: PyTree) -> PyTree:
    """Standard normal draws shaped like ``tree``'s float leaves (leaf ``j`` from
    ``fold_in(key, j)``; other leaves are returned as they are)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(
        [
            jax.random.normal(jax.random.fold_in(key, j), x.shape, x.dtype)
            if fed_optim.is_float(x)
            else x
            for j, x in enumerate(leaves)
        ]
    )


def privatize(dp: ClientDP, ctx, stats: dict) -> tuple[dict, PyTree, dict]:
    """The summary with DP-FedAvg's noised fixed-denominator estimate in place of the mean of
    the uploads, the next privacy state and the round's privacy metrics."""
    s, denominator = ctx.clients_per_round, dp.denominator
    clip_norm = ctx.server.privacy["clip_norm"]
    keys = round_keys(ctx.key)
    mean = dict(stats["mean"])
    uploads = {name: mean[name] for name in UPLOADS if name in mean}
    std = dp.update_noise_multiplier * clip_norm
    # (sum_i u_i + sigma C z) / D with sum_i u_i = S mean_i u_i; S / D is 1.0 under fixed-size
    # sampling, so a run without noise and clipping reproduces the plain mean bit for bit. With
    # sigma = 0 the noise term is left out of the program: an add of zeros after the mean would
    # change how XLA fuses the mean's sum (vmapped clients), and with it the sum's last bits.
    if dp.update_noise_multiplier == 0:
        noised = jax.tree.map(
            lambda x: x * (s / denominator) if fed_optim.is_float(x) else x, uploads
        )
    else:
        noised = jax.tree.map(
            lambda x, z: (
                (x * (s / denominator) + z * (std / denominator).astype(x.dtype))
                if fed_optim.is_float(x)
                else x
            ),
            uploads,
            gaussian_noise(keys["noise"], uploads),
        )
    mean.update(noised)
    count_sum = mean.pop(UNCLIPPED) * s
    count_noise = dp.count_noise_multiplier * jax.random.normal(keys["count"], (), clip_norm.dtype)
    unclipped = (count_sum + count_noise) / denominator + 0.5
    metrics = {"dp_clip_norm": clip_norm}
    state = ctx.server.privacy
    if dp.adaptive_quantile is not None:
        step = -dp.clip_learning_rate * (unclipped - dp.adaptive_quantile)
        state = {"clip_norm": clip_norm * jnp.exp(step)}
        metrics["dp_unclipped_fraction"] = unclipped
    return {**stats, "mean": mean}, state, metrics


def default_count_noise(expected_cohort: float) -> float:
    """Andrew et al. 2021's default ``sigma_b = m / 20`` (Sec. 3), ``m`` the expected cohort."""
    return expected_cohort / 20.0


def check_count_noise(dp: ClientDP) -> None:
    """``sigma_Delta`` exists only when ``sigma_b > sigma / 2`` (Theorem 1)."""
    if dp.adaptive_quantile is not None and dp.noise_multiplier > 0:
        if not 2 * dp.count_noise_multiplier > dp.noise_multiplier or math.isinf(
            dp.update_noise_multiplier
        ):
            raise ValueError(
                f"dp.count_noise_multiplier={dp.count_noise_multiplier} must exceed "
                f"dp.noise_multiplier / 2 = {dp.noise_multiplier / 2} for adaptive clipping "
                "(Andrew et al. 2021, Theorem 1); raise it or set dp.adaptive_quantile=None."
            )


def averages_by_own_rule(algorithm, spectral_drift: bool) -> bool:
    """Whether ``algorithm`` averages its uploaded optimizer state otherwise than by its mean
    (SOAP's bases, ``federated.register_average``; the spectral drift stacks the states)."""
    if not algorithm.start.averaged:
        return False
    probe = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    return spectral_drift or fed_optim.has_average_rule(
        jax.eval_shape(algorithm.local_tx.init, probe)
    )


OWN_RULE = (
    "dp: {name} averages its optimizer state with its own rule (SOAP's bases) or the spectral "
    "drift is on, which DP-FedAvg's noised sum does not cover; set spectral_drift=False or use "
    "another local optimizer, or leave config.dp off."
)
MODEL_STATE = (
    "dp: the model has non-trainable state (BatchNorm statistics) that clients would upload "
    "unclipped; use a model without it (e.g. model.name='mlp' or 'cnn'), or leave config.dp off."
)


def check_round(algorithm, plan, server) -> None:
    """Refuses the uploads DP-FedAvg's clipped sum does not cover (at trace time)."""
    if server.privacy is None:
        raise ValueError(
            "RoundConfig.privacy is set but the server state has no privacy state: build it "
            "with fedorth.fed.init_server(..., privacy=round_config.privacy)."
        )
    if algorithm.start.averaged and not plan.stream_opt:
        raise ValueError(OWN_RULE.format(name=algorithm.name))
    check_model_state(server.model_state)


def check_model_state(model_state) -> None:
    if any(fed_optim.is_float(x) for x in jax.tree.leaves(model_state)):
        raise ValueError(MODEL_STATE)
