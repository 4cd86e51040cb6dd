r"""Fed minimax (Zhang & Gao) §5 (deep AUC maximization on imbalanced text), shared by the minimax configs.

Fed minimax (Zhang & Gao), docs/PAPERS.md. Each algorithm config (fed_nsgda_m.py,
fedmuon_da.py, fedsgda_clip.py, local_sgdam.py, fedsgda_m.py, f_sagda.py, fess_gda.py,
local_sgda.py) calls :func:`get_config` with its algorithm name, options and local optimizer.

Default preset (no argument): the embedded Zipf sentiment task (``fedorth.data.heavy_tailed``,
heavy-tailed word frequencies, no download), 8 clients with positives dropped to r = 0.1, p = 4,
batch 64, a small RNN under the min-max AUC loss; runs in well under a minute on 2 CPU cores.

Paper presets ``{dataset}_{setting}_p{period}``:

* dataset: ``sentiment140``, ``sst2`` (TFDS ``glue/sst2``), ``yelp`` (``yelp_polarity_reviews``);
* setting: ``homo`` (positives randomly dropped to r = 0.1 on every client) or ``hetero``
  (client ratios 0.05, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25);
* period: p in {4, 8, 16} local steps per round;

with 8 clients, full participation, batch 64, the RNN of Fed minimax (Zhang & Gao) §5 (two layers, input 300,
hidden 4096, output 2) under Eq. 20's loss with ``p`` the (pooled) positive ratio, "beta fixed
at 0.9" read as momentum 0.9 on the old average, i.e. beta = 0.1 on the new gradient (the
reading of both Zhang & Gao papers, fedorth.fed.algorithms.fedmuon_zg), and tau = 0.1
(FedSGDA-Clip). Choices where the paper is silent: 20000-word vocabulary and 64 tokens
(fedorth's TFDS text defaults), 1000 rounds evaluated every 20, learning rate 0.01 (the paper
tunes it in [1e-3, 1e-1]; the configs' value is a starting point), eta_y = eta_x, server steps
that average the clients' models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections

from configs import base

DATASETS = {"sentiment140": "sentiment140", "sst2": "glue/sst2", "yelp": "yelp_polarity_reviews"}
PERIODS = (4, 8, 16)
HOMOGENEOUS_RATIO = 0.1  # Fed minimax (Zhang & Gao) §5: "the ratio of positives r is set to 0.1"
# Fed minimax (Zhang & Gao) §5:
HETEROGENEOUS_RATIOS = (0.05, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25)
PRESETS = tuple(f"{d}_{s}_p{p}" for d in DATASETS for s in ("homo", "hetero") for p in PERIODS)


def _pooled_ratio(ratios) -> float:
    from fedorth.models.auc import pooled_positive_ratio

    return pooled_positive_ratio(ratios)


def default_config() -> ml_collections.ConfigDict:
    """The embedded, CPU-sized setting (see the module docstring)."""
    config = base.get_base_config()
    config.data.name = "zipf_sentiment"  # fedorth.data.heavy_tailed: Zipf word frequencies
    config.data.num_clients = 8  # Fed minimax (Zhang & Gao) §5: eight clients
    config.data.partition = "positive_ratio"  # drop positives to the ratio r on every client
    config.data.alpha = None  # (Dirichlet only)
    config.data.partition_kwargs = ml_collections.ConfigDict({"ratios": HOMOGENEOUS_RATIO})
    config.data.dataset_kwargs = ml_collections.ConfigDict(
        {"num_train": 8000, "num_test": 2000, "vocab_size": 1000, "max_len": 8}
    )
    config.model = ml_collections.ConfigDict(
        {
            "name": "auc",  # fedorth.models.auc: Eq. 20's min-max AUC loss around a classifier
            "base": "rnn",
            "positive_ratio": HOMOGENEOUS_RATIO,  # p of Eq. 20
            "hidden_size": 32,
            "num_layers": 1,
            "embed_dim": 16,
            "vocab_size": 1000,
        }
    )
    config.fed.rounds = 150
    config.fed.clients_per_round = 8  # full participation (Fed minimax (Zhang & Gao)'s analysis)
    config.fed.local_steps = 4  # p
    config.fed.batch_size = 64  # Fed minimax (Zhang & Gao) §5
    config.optim = ml_collections.ConfigDict(
        {"name": "sgd", "learning_rate": 0.2, "schedule": "constant"}
    )
    config.eval_every = 25
    config.eval_batch_size = 500
    config.checkpoint_every = 0
    return config


def paper_preset(config: ml_collections.ConfigDict, arg: str) -> ml_collections.ConfigDict:
    """Applies preset ``arg`` (``{dataset}_{homo|hetero}_p{4|8|16}``) to ``config``."""
    if arg not in PRESETS:
        raise ValueError(
            f"Unknown preset {arg!r}; valid presets: '' (default, embedded), {', '.join(PRESETS)}."
        )
    dataset, setting, period = arg.rsplit("_", 2)
    ratios = HOMOGENEOUS_RATIO if setting == "homo" else HETEROGENEOUS_RATIOS
    config.data.name = DATASETS[dataset]
    config.data.partition_kwargs = ml_collections.ConfigDict({"ratios": ratios})
    config.data.dataset_kwargs = ml_collections.ConfigDict({"vocab_size": 20000, "max_len": 64})
    config.model = ml_collections.ConfigDict(
        {
            "name": "auc",
            "base": "rnn",
            "positive_ratio": HOMOGENEOUS_RATIO if setting == "homo" else _pooled_ratio(ratios),
            "hidden_size": 4096,  # Fed minimax (Zhang & Gao) §5: "two-layer RNN ... input 300, hidden 4096"
            "num_layers": 2,
            "embed_dim": 300,
            "vocab_size": 20000,
        }
    )
    config.fed.local_steps = int(period[1:])
    config.fed.rounds = 1000
    config.optim.learning_rate = 0.01
    config.eval_every = 20
    config.checkpoint_every = 100
    return config


def get_config(
    algorithm: str,
    arg: str | None,
    *,
    options: Mapping[str, Any] | None = None,
    optim: Mapping[str, Any] | None = None,
) -> ml_collections.ConfigDict:
    """The config of minimax ``algorithm`` for preset ``arg`` (None/"": the embedded default).

    Args:
      algorithm: a minimax name of ``fedorth.fed.ALGORITHMS``.
      arg: the preset.
      options: ``fed.options`` (the algorithm's hyperparameters).
      optim: overrides of ``optim`` (e.g. ``{"name": "muon", "ns_steps": 5}``).
    """
    config = default_config()
    config.fed.algorithm = algorithm
    config.fed.options = ml_collections.ConfigDict(dict(options or {}))
    for key, value in dict(optim or {}).items():
        config.optim[key] = value
    if arg in (None, ""):
        return base.with_model_dtype(config)
    return base.with_model_dtype(paper_preset(config, arg))
