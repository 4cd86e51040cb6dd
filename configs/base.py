"""Defaults shared by every config: the CPU-friendly setting on the embedded digits data.

Each algorithm's config imports :func:`get_base_config` and changes what it needs. Every field is
described here; the contract of the sections is in docs/CONTRACTS.md.
"""

import ml_collections
from ml_collections import config_dict


def get_base_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 42  # the papers report seeds 42-46 (FedMuon (Liu et al.) Sec. 7)

    config.data = ml_collections.ConfigDict()
    config.data.name = "digits"  # embedded 8x8 digits: no download (fedorth.data.DATASETS)
    config.data.num_clients = 20  # N
    # fedorth.data.PARTITIONERS: each class split across the clients (the papers' presets use
    # PAPER_DIRICHLET instead)
    config.data.partition = "dirichlet_label_split"
    config.data.alpha = 0.3  # Dirichlet concentration (smaller = more heterogeneous)
    # Training examples held out as a validation split (val_loss, val_accuracy in the metrics):
    # experiments.report picks learning rates on it, not on the test split. 0: none.
    config.data.validation_fraction = 0.0
    config.data.augment = False  # on-device random crop + flip (CIFAR-style images)
    config.data.rand_augment = False  # on-device RandAugment m9 n2 (ViT/Swin fine-tuning)
    config.data.image_size = 0  # resize batches to this square size on device (0: native)
    # The folder of prepared TFDS datasets and of the natural-client files (TFF's .h5, FedJAX's
    # .sqlite, parquet; python -m experiments.prepare). None: $TFDS_DATA_DIR or
    # ~/tensorflow_datasets.
    config.data.data_dir = config_dict.placeholder(str)
    config.data.dataset_kwargs = ml_collections.ConfigDict()  # loader options (max_train, ...)
    config.data.partition_kwargs = ml_collections.ConfigDict()  # partitioner options
    # Natural-client datasets (emnist, shakespeare, stackoverflow, ...): "true" reads each
    # round's sampled clients from the files (fedorth.data.stream), "false" loads every client,
    # "auto" streams when the training examples exceed 4 GiB. Other datasets load whole.
    config.data.stream = "auto"
    config.data.prefetch = True  # streamed: read the next round's clients in a thread

    config.model = ml_collections.ConfigDict()
    config.model.name = "mlp"  # fedorth.models.MODELS
    config.model.hidden_sizes = (128, 128)
    # Compute dtype of every model: "float32" or "bfloat16" (mixed precision on GPUs: bf16
    # activations, matmuls and convolutions; float32 parameters, optimizer states, losses,
    # softmax and normalization statistics; fedorth.models.layers.compute_dtype).
    config.model.dtype = "float32"

    config.fed = ml_collections.ConfigDict()
    config.fed.algorithm = "fedavg"  # fedorth.fed.ALGORITHMS
    config.fed.rounds = 60  # R
    config.fed.clients_per_round = 5  # S, sampled without replacement
    config.fed.local_steps = 10  # K
    config.fed.batch_size = 32  # local mini-batch, sampled with replacement on device
    config.fed.strategy = "auto"  # fed.resolve_strategy | vmap | chunked | sequential | sharded
    config.fed.chunk_size = 0  # clients per chunk for 'chunked'
    config.fed.unroll = 1  # local-step scan unroll (True avoids XLA:CPU conv-in-loop slowness)
    # how the server weighs the sampled clients: uniform (1/S) | examples (n_i / sum n_j,
    # FedAvg's original rule; fedorth.fed.aggregation)
    config.fed.aggregation = "uniform"
    # Where the clients' persistent states live (fedorth.fed.client_store): auto | device | host
    # | disk; auto takes the device where they fit (the estimate is printed at start).
    config.fed.client_state = "auto"
    config.fed.client_state_dir = ""  # the disk store's folder ("": <workdir>/client_state)
    config.fed.options = ml_collections.ConfigDict()  # the algorithm's own options (alpha, beta)

    config.optim = ml_collections.ConfigDict()
    config.optim.name = "sgd"  # local optimizer direction: fedorth.fed.local.DIRECTIONS
    config.optim.learning_rate = 0.05  # local eta
    config.optim.schedule = "constant"  # constant | cosine | warmup_cosine | step (over rounds)
    config.optim.weight_decay = 0.0  # decoupled weight decay lambda
    # Newton-Schulz matmul operands of muon/lmo (fedorth.optim.newton_schulz.default_ns_dtype):
    # "auto" (bfloat16 with float32 accumulation on GPU/TPU, float32 on CPU) | bfloat16 | float32
    config.optim.ns_dtype = "auto"

    config.eval_every = 5  # rounds between test evaluations (and metrics.jsonl rows)
    config.eval_batch_size = 512
    # Also the mean and spread over the test clients of each one's loss and accuracy
    # (test_*_client_mean/std/p10/p90 in metrics.jsonl): datasets whose test split has clients
    # (fedorth.data.natural). Evaluation then runs example by example (slower).
    config.eval_per_client = False
    config.checkpoint_every = 20  # rounds between orbax checkpoints (0: only at the end)
    config.log_condition_number = False  # FedMuon (Liu et al.) Figure 4: kappa of weight matrices
    # Experiment trackers besides metrics.jsonl (always written), comma-separated:
    # "tensorboard" (WORKDIR/tensorboard), "mlflow" (the [mlflow] extra; fedorth.train.trackers).
    config.trackers = "tensorboard"
    config.mlflow_uri = ""  # "": sqlite:///<workdir's parent>/mlflow.db; or http(s)://HOST:PORT
    config.mlflow_experiment = "fedorth"
    # Client-level differential privacy (DP-FedAvg, McMahan et al. 2018; docs/PRIVACY.md; the
    # [dp] extra). Off while clip_norm is None.
    config.dp = ml_collections.ConfigDict()
    config.dp.clip_norm = config_dict.placeholder(float)  # C: each client's upload's L2 bound
    config.dp.noise_multiplier = 1.0  # sigma: the sum's noise std is sigma * C
    config.dp.delta = 1e-5  # delta of the reported (epsilon, delta); must be < 1/N
    # epsilon to meet in fed.rounds rounds: sigma is calibrated (noise_multiplier is ignored)
    config.dp.target_epsilon = config_dict.placeholder(float)
    # gamma: the clip norm follows this quantile of the upload norms (Andrew et al. 2021)
    config.dp.adaptive_quantile = config_dict.placeholder(float)
    config.dp.clip_learning_rate = 0.2  # eta_C of adaptive clipping's geometric update
    # sigma_b of the clipped count (None: expected cohort / 20, Andrew et al. 2021 Sec. 3)
    config.dp.count_noise_multiplier = config_dict.placeholder(float)
    # "fixed": S of N without replacement; "poisson": each client with probability
    # dp.sampling_rate (set fed.clients_per_round = N: every client runs, the others are masked)
    config.dp.sampling = "fixed"
    config.dp.sampling_rate = config_dict.placeholder(float)
    config.dp.accountant = "rdp"  # rdp | pld (pld: Poisson sampling only)
    config.spectral_drift = (
        False  # FedPAC (Liu et al.) Figure 3: spectral-norm preconditioner drift
    )
    return config


# The papers' "Dir-alpha": each client draws its class mix q_i ~ Dir(alpha 1_C) and M/N examples
# (Hsu et al. 2019, which all four papers cite; the released code of FedMuon (Liu et al.) and
# FedPAC (Liu et al.) does the same). fedorth.data.partition.dirichlet_client_mix.
PAPER_DIRICHLET = "dirichlet_hsu"


def paper_setting(
    config: ml_collections.ConfigDict,
    *,
    dataset: str,
    model: str,
    num_classes: int,
    rounds: int = 300,
    num_clients: int = 100,
    clients_per_round: int = 10,
    local_steps: int = 50,
    batch_size: int = 50,
    alpha: float = 0.1,
) -> ml_collections.ConfigDict:
    """The vision setting shared by FedMuon (Liu et al.) and FedPAC (Liu et al.): 100 clients, 10%
    participation, batch 50, K = 50, 300 rounds, Dir-``alpha`` of Hsu et al. (:data:`PAPER_DIRICHLET`;
    FedMuon (Liu et al.) Sec. 7; FedPAC (Liu et al.) Table 1)."""
    config.data.name = dataset
    config.data.num_clients = num_clients
    config.data.partition = PAPER_DIRICHLET
    config.data.alpha = alpha
    config.data.augment = True
    config.model = ml_collections.ConfigDict(
        {"name": model, "num_classes": num_classes, "dtype": config.model.get("dtype", "float32")}
    )
    return paper_federation(
        config,
        rounds=rounds,
        clients_per_round=clients_per_round,
        local_steps=local_steps,
        batch_size=batch_size,
        eval_batch_size=500,
    )


def paper_federation(
    config: ml_collections.ConfigDict,
    *,
    rounds: int,
    clients_per_round: int,
    local_steps: int,
    batch_size: int,
    eval_batch_size: int,
) -> ml_collections.ConfigDict:
    """The round schedule of the papers' settings: ``rounds`` rounds of ``clients_per_round``
    clients running ``local_steps`` steps of batch ``batch_size``, cosine decay, evaluation and
    a checkpoint every 10 rounds."""
    config.fed.rounds = rounds
    config.fed.clients_per_round = clients_per_round
    config.fed.local_steps = local_steps
    config.fed.batch_size = batch_size
    config.optim.schedule = "cosine"
    config.eval_every = 10
    config.checkpoint_every = 10
    config.eval_batch_size = eval_batch_size
    return config


def with_model_dtype(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Adds ``model.dtype = "float32"`` where a preset replaced ``config.model`` without it, so
    ``--config.model.dtype=bfloat16`` works on every (locked) config."""
    if "dtype" not in config.model:
        config.model.dtype = "float32"
    return config
