"""Client-level differential privacy from a run's config: ``config.dp``, its accountant, and the
noise multiplier a target epsilon calls for.

The accountant (``dp_accounting``, the ``[dp]`` extra) composes one sampled Gaussian mechanism
per round, matching how the round samples clients (docs/PRIVACY.md):

* ``dp.sampling="fixed"``: ``S`` of ``N`` without replacement, ``SampledWithoutReplacementDpEvent``
  under the replace-one relation (``N`` public), where the clipped sum's sensitivity is ``2C``:
  the Gaussian event's multiplier is ``sigma / 2``. RDP only (Wang, Balle & Kasiviswanathan
  2019, Theorem 27); ``dp_accounting``'s PLD accountant has no such event.
* ``dp.sampling="poisson"``: each client with probability ``q``, ``PoissonSampledDpEvent`` under
  add-or-remove-one (sensitivity ``C``): multiplier ``sigma``; RDP or PLD.
"""

from __future__ import annotations

import functools
import sys

import ml_collections

from fedorth.fed import privacy as fed_privacy

ACCOUNTANTS = ("rdp", "pld")
MISSING = "config.dp needs dp-accounting: pip install 'fedorth[dp]' (or pip install dp-accounting)."


def _dp_accounting():
    try:
        import dp_accounting
    except ImportError:
        raise ValueError(MISSING) from None
    return dp_accounting


def enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether the run trains with client-level DP (``dp.clip_norm`` set)."""
    dp = config.get("dp")
    return dp is not None and dp.get("clip_norm") is not None


def _sampling(config) -> tuple[str, int, int, float]:
    dp = config.dp
    n, s = int(config.data.num_clients), int(config.fed.clients_per_round)
    sampling = dp.get("sampling", "fixed")
    rate = float(dp.get("sampling_rate") or 0.0) if sampling == "poisson" else s / n
    return sampling, n, s, rate


def accountant_and_event(config, noise_multiplier: float):
    """The ``dp_accounting`` accountant and the one-round event of the run's sampling (module
    docstring): what :func:`epsilon` composes once per round."""
    dpa = _dp_accounting()
    sampling, n, s, rate = _sampling(config)
    if sampling == "fixed":
        event = dpa.SampledWithoutReplacementDpEvent(
            n, s, dpa.GaussianDpEvent(noise_multiplier / 2)
        )
        relation = dpa.NeighboringRelation.REPLACE_ONE
        return dpa.rdp.RdpAccountant(neighboring_relation=relation), event
    event = dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(noise_multiplier))
    if config.dp.get("accountant", "rdp") == "pld":
        return dpa.pld.PLDAccountant(), event
    return dpa.rdp.RdpAccountant(), event


def epsilon(config, noise_multiplier: float, rounds: int) -> float:
    """The epsilon at ``dp.delta`` after ``rounds`` rounds with noise multiplier ``sigma``."""
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return float("inf")
    dpa = _dp_accounting()
    accountant, event = accountant_and_event(config, noise_multiplier)
    accountant.compose(dpa.SelfComposedDpEvent(event, rounds))
    return float(accountant.get_epsilon(float(config.dp.delta)))


@functools.lru_cache(maxsize=16)
def _calibrate(config_json: str) -> float:
    config = ml_collections.ConfigDict(__import__("json").loads(config_json))
    target, rounds = float(config.dp.target_epsilon), int(config.fed.rounds)
    low, high = 0.0, 1e4
    if epsilon(config, high, rounds) > target:
        raise ValueError(
            f"dp.target_epsilon={target} cannot be reached in fed.rounds={rounds} (even "
            f"noise_multiplier={high:g} gives more); raise dp.target_epsilon or dp.delta, or "
            "lower fed.rounds or fed.clients_per_round."
        )
    for _ in range(60):
        middle = (low + high) / 2
        if middle > 0 and epsilon(config, middle, rounds) <= target:
            high = middle
        else:
            low = middle
    print(
        f"dp: noise_multiplier={high:.6g} gives epsilon <= {target} at delta="
        f"{config.dp.delta} over {rounds} rounds.",
        file=sys.stderr,
    )
    return high


def noise_multiplier(config: ml_collections.ConfigDict) -> float:
    """``dp.noise_multiplier``, or the smallest that meets ``dp.target_epsilon`` in
    ``fed.rounds`` rounds (binary search with the accountant; the choice is printed)."""
    if config.dp.get("target_epsilon") is None:
        return float(config.dp.noise_multiplier)
    return _calibrate(config.to_json_best_effort(sort_keys=True))


def client_dp(config: ml_collections.ConfigDict) -> fed_privacy.ClientDP | None:
    """The round's ``fedorth.fed.privacy.ClientDP`` from ``config.dp`` (None when off)."""
    if not enabled(config):
        return None
    dp = config.dp
    sampling, n, s, rate = _sampling(config)
    denominator = float(s) if sampling == "fixed" else rate * n
    quantile = dp.get("adaptive_quantile")
    count_noise = dp.get("count_noise_multiplier")
    if count_noise is None:
        count_noise = fed_privacy.default_count_noise(denominator)
    return fed_privacy.ClientDP(
        clip_norm=float(dp.clip_norm),
        noise_multiplier=noise_multiplier(config),
        denominator=denominator,
        sampling=sampling,
        sampling_rate=rate,
        adaptive_quantile=None if quantile is None else float(quantile),
        clip_learning_rate=float(dp.get("clip_learning_rate", 0.2)),
        count_noise_multiplier=float(count_noise),
    )


def epsilon_row(config: ml_collections.ConfigDict, round_index: int) -> dict[str, float]:
    """``{"dp_epsilon": ...}`` after ``round_index`` rounds, or {} without DP."""
    if not enabled(config):
        return {}
    return {"dp_epsilon": epsilon(config, noise_multiplier(config), round_index)}


def check(config: ml_collections.ConfigDict) -> None:
    """One-line errors for ``config.dp`` (``fedorth.train.validate``)."""
    if not enabled(config):
        return
    dp = config.dp
    _dp_accounting()
    clip = float(dp.clip_norm)
    if not clip > 0:
        raise ValueError(f"dp.clip_norm={clip} must be > 0 (an L2 norm; leave it unset for no DP).")
    n = int(config.data.num_clients)
    delta = float(dp.delta)
    if not 0 < delta < 1 / n:
        raise ValueError(
            f"dp.delta={delta} must lie in (0, 1/N = {1 / n:g}) for data.num_clients={n}: a "
            "delta of 1/N or more allows releasing one client's data outright."
        )
    if float(dp.get("noise_multiplier") or 0) < 0:
        raise ValueError(f"dp.noise_multiplier={dp.noise_multiplier} must be >= 0.")
    sampling = dp.get("sampling", "fixed")
    if sampling not in fed_privacy.SAMPLINGS:
        raise ValueError(f"dp.sampling={sampling!r}; valid: {fed_privacy.SAMPLINGS}.")
    accountant = dp.get("accountant", "rdp")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"dp.accountant={accountant!r}; valid: {ACCOUNTANTS}.")
    if sampling == "fixed" and accountant == "pld":
        raise ValueError(
            "dp.accountant='pld' accounts Poisson sampling only (dp_accounting has no PLD of "
            "sampling without replacement): set dp.accountant='rdp' or dp.sampling='poisson'."
        )
    if sampling == "poisson" and not 0 < float(dp.get("sampling_rate") or 0) <= 1:
        raise ValueError(
            f"dp.sampling_rate={dp.get('sampling_rate')} must lie in (0, 1] for "
            "dp.sampling='poisson'."
        )
    s = int(config.fed.clients_per_round)
    if sampling == "poisson" and s != n:
        raise ValueError(
            f"dp.sampling='poisson' runs every client and masks each with probability "
            f"dp.sampling_rate: set fed.clients_per_round={n} (= data.num_clients), got {s}."
        )
    quantile = dp.get("adaptive_quantile")
    if quantile is not None and not 0 <= float(quantile) <= 1:
        raise ValueError(f"dp.adaptive_quantile={quantile} must lie in [0, 1] (or None).")
    if dp.get("target_epsilon") is not None:
        if not float(dp.target_epsilon) > 0:
            raise ValueError(f"dp.target_epsilon={dp.target_epsilon} must be > 0.")
        noise_multiplier(config)
