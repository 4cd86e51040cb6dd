"""From a config to the objects of a run: data, model, algorithm, round function.

The config sections are the contract of docs/CONTRACTS.md (``seed``, ``data``, ``model``, ``fed``,
``optim``, ``eval_every``, ``checkpoint_every``); see ``configs/base.py`` for every field.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import pathlib
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from fedorth import data as data_lib
from fedorth import fed, models
from fedorth.data import augment, randaugment
from fedorth.fed import client_store as client_store_lib
from fedorth.fed import memory as fed_memory
from fedorth.fed import privacy as fed_privacy
from fedorth.fed import stored_round
from fedorth.models import lora, pretrained
from fedorth.train import distributed, eager_jit, feed, privacy

SCHEDULES = ("constant", "cosine", "warmup_cosine", "step")


class ConfigError(ValueError):
    """The config cannot run: unknown names or out-of-range values (``fedorth.train.validate``,
    before anything is loaded or compiled), a file it names that is missing or not what it says
    (:func:`check_files`), or data it cannot split among its clients (:func:`build_data`)."""


@dataclasses.dataclass
class Experiment:
    """Everything a run needs, built once from the config."""

    config: ml_collections.ConfigDict
    data: data_lib.FederatedData
    model: models.Model
    algorithm: fed.FedAlgorithm
    round_config: fed.RoundConfig
    round_fn: fed.RoundFn
    init_params: Any
    init_model_state: Any
    # The training clients read per round (data.stream; fedorth.data.stream), or None: `data`
    # then holds the test split and the clients' counts, and round r reads
    # fedorth.train.feed.RoundFeed(...)(r).
    stream: data_lib.stream_lib.ClientStream | None = None
    # The clients' states outside the device (fed.client_state host or disk; round_fn is then
    # the store's fedorth.fed.stored_round.StoredRoundFn), or None.
    client_store: client_store_lib.ArrayStore | None = None


def _to_dict(section: ml_collections.ConfigDict | None) -> dict[str, Any]:
    if section is None:
        return {}
    return section.to_dict() if hasattr(section, "to_dict") else dict(section)


def learning_rate_schedule(optim: ml_collections.ConfigDict, rounds: int):
    """The local learning rate ``eta_r`` as a function of the round (or a float).

    ``optim.learning_rate`` may be a traced scalar (a sweep's replicas, ``fedorth.sweep``): the
    schedule is then a function of it, and its values were checked before tracing.
    """
    lr = optim.learning_rate
    if not isinstance(lr, jax.core.Tracer):
        lr = float(lr)
        if not lr > 0:
            raise ValueError(f"optim.learning_rate={lr} must be > 0.")
    schedule = optim.get("schedule", "constant")
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r}; valid: {SCHEDULES}.")
    if schedule == "constant":
        return lr
    if schedule == "cosine":  # FedMuon (Liu et al.) Sec. 7: cosine decay over the rounds
        return optax.cosine_decay_schedule(
            lr, decay_steps=max(rounds, 1), alpha=optim.get("final_lr_ratio", 0.0) or 1e-8
        )
    if schedule == "warmup_cosine":
        warmup = int(optim.get("warmup_rounds", 0))
        return optax.warmup_cosine_decay_schedule(
            0.0,
            lr,
            warmup_steps=max(warmup, 1),
            decay_steps=max(rounds, warmup + 1),
            end_value=lr * (optim.get("final_lr_ratio", 0.0) or 1e-8),
        )
    boundaries = {int(b): 0.1 for b in optim.get("step_rounds", ())}
    return optax.piecewise_constant_schedule(lr, boundaries)


def make_round_config(config: ml_collections.ConfigDict) -> fed.RoundConfig:
    """The round's static settings (``fed.RoundConfig``) from a run's config: ``data.num_clients``,
    ``fed.clients_per_round``, ``fed.local_steps``, the learning-rate schedule over
    ``fed.rounds``, ``fed.strategy``, ``fed.chunk_size``, ``fed.unroll``, ``fed.aggregation`` and
    ``spectral_drift``.
    The one place a config becomes a ``RoundConfig`` (:func:`build`, :func:`dry_build` and the
    config checks of ``fedorth.train.validate`` all call it)."""
    strategy = config.fed.get("strategy", "auto")
    mesh = distributed.round_mesh(int(config.fed.clients_per_round))
    if mesh is not None:  # several processes: the round spans all their devices
        if strategy not in ("auto", "sharded"):
            raise ConfigError(
                f"fed.strategy={strategy!r} runs a round on one device, and this run has "
                f"{jax.process_count()} processes, whose devices a round spans together: use "
                "--config.fed.strategy=sharded (or auto)."
            )
        strategy = "sharded"
    return fed.RoundConfig(
        num_clients=int(config.data.num_clients),
        clients_per_round=int(config.fed.clients_per_round),
        local_steps=int(config.fed.local_steps),
        learning_rate=learning_rate_schedule(config.optim, int(config.fed.rounds)),
        strategy=strategy,
        mesh=mesh,
        chunk_size=config.fed.get("chunk_size"),
        unroll=config.fed.get("unroll", 1),
        spectral_drift=bool(config.get("spectral_drift", False)),
        privacy=privacy.client_dp(config),
        aggregation=config.fed.get("aggregation", "uniform"),
    )


def _loader_kwargs(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """The ``data.*`` keys every loader takes, whole or streamed."""
    return dict(
        data_dir=cfg.get("data_dir"),
        dataset_kwargs=_to_dict(cfg.get("dataset_kwargs")),
        validation_fraction=float(cfg.get("validation_fraction", 0.0) or 0.0),
    )


def build_data(config: ml_collections.ConfigDict, seed: int) -> data_lib.FederatedData:
    cfg = config.data
    kwargs = _to_dict(cfg.get("partition_kwargs"))
    if cfg.get("alpha") is not None and cfg.partition.startswith("dirichlet"):
        alpha = float(cfg.alpha)
        if not alpha > 0:
            raise ValueError(f"data.alpha={alpha} must be > 0 for partition {cfg.partition!r}.")
        kwargs["alpha"] = alpha
    try:
        return data_lib.load_federated(
            cfg.name,
            num_clients=int(cfg.num_clients),
            partition=cfg.partition,
            seed=seed,
            **_loader_kwargs(cfg),
            **kwargs,
        )
    except data_lib.DataConfigError as e:
        raise ConfigError(str(e)) from None


def build_streamed_data(config: ml_collections.ConfigDict, seed: int):
    """``(data, stream)``: :func:`build_data`'s dataset and None, or for a dataset with natural
    clients that ``data.stream`` streams, the dataset without its training examples and the
    :class:`fedorth.data.stream.ClientStream` the rounds read them from."""
    cfg = config.data
    try:
        mode = data_lib.stream_lib.stream_mode(cfg.get("stream", "auto"))
    except data_lib.DataConfigError as e:
        raise ConfigError(str(e)) from None
    if mode is False or not data_lib.has_natural_clients(cfg.name) or cfg.partition != "natural":
        return build_data(config, seed), None  # which refuses a natural dataset's partition
    try:
        return data_lib.load_streamed(
            cfg.name,
            num_clients=int(cfg.num_clients),
            seed=seed,
            stream=mode,
            **_loader_kwargs(cfg),
        )
    except data_lib.DataConfigError as e:
        raise ConfigError(str(e)) from None


def image_size(config: ml_collections.ConfigDict) -> int:
    """``data.image_size``: the side batches are resized to on device (0: native size)."""
    return int(config.data.get("image_size", 0) or 0)


# Natural next-token datasets whose windows are padded with id 0 (fedorth.data.natural): their
# accuracy leaves the padded targets out, as TFF reports it.
PADDED_LM_DATASETS = ("shakespeare", "stackoverflow")

# model.* keys that wrap the model in LoRA adapters (fedorth.models.lora); lora_rank 0 = off.
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_targets", "lora_trainable")


def build_model(config: ml_collections.ConfigDict, fed_data: data_lib.FederatedData):
    kwargs = _to_dict(config.model)
    name = kwargs.pop("name")
    adapters = {key[len("lora_") :]: kwargs.pop(key) for key in LORA_KEYS if key in kwargs}
    if adapters.get("rank"):
        config_without = ml_collections.ConfigDict(
            {**_to_dict(config), "model": {"name": name, **kwargs}}
        )
        return lora.lora(build_model(config_without, fed_data), **adapters)
    if name == "llama":
        # The embedding must hold every id the tokenizer emits: JAX clamps out-of-range gathers,
        # so a smaller vocabulary would train silently on wrong tokens.
        data_vocab = int(fed_data.num_classes)
        vocab = kwargs.get("vocab_size")
        if vocab is None:
            kwargs["vocab_size"] = data_vocab
        elif int(vocab) != data_vocab:
            raise ValueError(
                f"model.vocab_size={vocab} but the data's tokenizer has {data_vocab} ids: set "
                f"model.vocab_size={data_vocab} (or None to follow the tokenizer), or use the "
                "tokenizer the model was meant for (data.dataset_kwargs.tokenizer)."
            )
    elif "num_classes" not in kwargs and config.model.get("task") != "lm":
        kwargs["num_classes"] = fed_data.num_classes
    model = models.get_model(name, **kwargs)
    dataset = (config.get("data") or {}).get("name")
    if dataset in PADDED_LM_DATASETS and isinstance(model, models.Model):
        if model.task == "lm":  # TFF's accuracy leaves the padding out (models.Model.pad_id)
            model = dataclasses.replace(model, pad_id=0)
    return model


def make_batch_fn(config: ml_collections.ConfigDict):
    batch_size = int(config.fed.batch_size)
    if batch_size < 1:
        raise ValueError(f"fed.batch_size={batch_size} must be >= 1.")
    use_augment = bool(config.data.get("augment", False))
    use_rand_augment = bool(config.data.get("rand_augment", False))
    size = image_size(config)
    if use_rand_augment:
        name = config.data.name
        if name not in data_lib.tfds.IMAGE_STATS:
            raise ValueError(
                f"data.rand_augment=True needs an RGB image dataset with known statistics "
                f"({sorted(data_lib.tfds.IMAGE_STATS)}); got data.name={name!r}."
            )
        mean, std = (
            jnp.asarray(s, jnp.float32).reshape(1, 1, 1, -1)
            for s in data_lib.tfds.IMAGE_STATS[name]
        )

    def batch_fn(fed_data, client_id, key):
        sample_key, aug_key = jax.random.split(key)
        batch = data_lib.sample_batch(fed_data, client_id, sample_key, batch_size)
        x = batch["x"]
        if use_augment:
            x = augment.random_crop_flip(aug_key, x)
        if use_rand_augment:  # on [0, 1] pixels, at the dataset's resolution (randaugment.py)
            rand_key = jax.random.fold_in(aug_key, 1)  # runs without it keep their draws
            x = (randaugment.rand_augment(rand_key, x * std + mean) - mean) / std
        if size:
            x = randaugment.resize(x, size)
        return {**batch, "x": x}

    return batch_fn


def check_files(config: ml_collections.ConfigDict) -> None:
    """Checks that the files the config names (``model.pretrained``,
    ``data.dataset_kwargs.tokenizer``) exist and are what it says, without loading them.

    Run by :func:`build` before the data are loaded; not part of
    ``fedorth.train.validate.validate``, so that a config can be checked and printed where its
    files are not.

    Raises:
      ConfigError: one line per problem, naming the key and the fix.
    """
    errors = []
    source = config.model.get("pretrained")
    if source:
        try:
            pretrained.check_checkpoint(config.model.name, str(source))
        except pretrained.PretrainedError as e:
            errors.append(str(e))
    path = _to_dict(config.data.get("dataset_kwargs")).get("tokenizer")
    if path:
        from fedorth.data.tokenizer import load_tokenizer

        hub = "roberta-base" if str(config.data.name).startswith("glue/") else "t5-base"
        try:
            load_tokenizer(str(path), hub_name=hub)
        except (OSError, ValueError, ImportError) as e:  # missing, malformed, sentencepiece
            errors.append(str(e))
    if errors:
        raise ConfigError("\n".join(errors))


def _check_tokenizer(config: ml_collections.ConfigDict) -> None:
    """A pretrained text model on GLUE needs its own subword tokenizer (``glue/sst2`` would
    otherwise fall back to fedorth's word vocabulary, ids the checkpoint never saw)."""
    name = str(config.data.name)
    kwargs = _to_dict(config.data.get("dataset_kwargs"))
    if name.startswith("glue/") and config.model.name == "roberta_base":
        if not kwargs.get("tokenizer"):
            raise ValueError(
                f"data.name={name!r} with model.name='roberta_base' needs "
                "--config.data.dataset_kwargs.tokenizer=PATH: RoBERTa's tokenizer.json (get it "
                "once with `hf download roberta-base tokenizer.json --local-dir DIR`; "
                "docs/FINETUNING.md)."
            )
        from fedorth.data.tokenizer import load_tokenizer

        ids = load_tokenizer(kwargs["tokenizer"], hub_name="roberta-base").vocab_size
        vocab = int(config.model.get("vocab_size", 50265))  # roberta_base's default
        if ids > vocab:  # JAX clamps out-of-range gathers: wrong tokens, silently
            raise ValueError(
                f"data.dataset_kwargs.tokenizer={kwargs['tokenizer']!r} has {ids} ids but "
                f"model.vocab_size={vocab}: use the checkpoint's own tokenizer.json."
            )


def build(config: ml_collections.ConfigDict) -> Experiment:
    """Builds the run's data, model, algorithm and jitted round function."""
    seed = int(config.seed)
    algorithm = fed.get_algorithm(
        config.fed.algorithm, _to_dict(config.optim), **_to_dict(config.fed.get("options"))
    )
    check_files(config)  # before the data are loaded
    _check_tokenizer(config)
    fed_data, stream = build_streamed_data(config, seed)
    model = build_model(config, fed_data)

    def example_input(x_train):
        example = x_train[:2]
        if image_size(config):  # the model sees batches resized on device (make_batch_fn)
            example = randaugment.resize(jnp.asarray(example), image_size(config))
        return example

    if isinstance(model, lora.LoRAModel):
        # LoRAModel.init's draws, with the checkpoint loaded before the split: the frozen base
        # goes beside the data (FederatedData.frozen_params), never into the state.
        init_key, _ = jax.random.split(jax.random.key(seed))
        params, model_state, adapter_key = model.init_base(
            init_key, example_input(fed_data.x_train)
        )
    else:

        def init_model(x_train):
            init_key, _ = jax.random.split(jax.random.key(seed))
            return model.init(init_key, example_input(x_train))

        # One compilation for the keys and every draw (op by op: ~20 for a small MLP).
        params, model_state = eager_jit.jit_op_by_op(init_model)(fed_data.x_train)
    if config.model.get("pretrained"):
        try:
            params, report = pretrained.load_pretrained(
                config.model.name, params, str(config.model.pretrained)
            )
        except pretrained.PretrainedError as e:  # the tensors do not fit the model's shapes
            raise ConfigError(str(e)) from None
        logging.info("model.pretrained: %s", report)
    if isinstance(model, lora.LoRAModel):
        params, frozen = model.split(params, adapter_key)
        fed_data = fed_data.replace(frozen_params=frozen)
    round_config = make_round_config(config)
    if round_config.privacy is not None:
        try:
            fed_privacy.check_model_state(model_state)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    round_fn = fed.make_round_fn(
        algorithm, model.loss_fn, make_batch_fn(config), round_config, params=params
    )
    # A sharded round (fed.strategy "auto" on several devices) reads the data replicated on its
    # mesh: placed once here, not copied every round.
    fed_data = round_fn.place(fed_data)
    return Experiment(
        config, fed_data, model, algorithm, round_config, round_fn, params, model_state, stream
    )


# Example input of each dataset without loading it: (shape of one example, dtype, classes).
# Text and synthetic shapes depend on the loader options (``data.dataset_kwargs``); their
# defaults are read from the loaders' signatures so this table cannot drift from them.
IMAGE_SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "digits": ((8, 8, 1), 10),
    "mnist": ((28, 28, 1), 10),
    "fashion_mnist": ((28, 28, 1), 10),
    "cifar10": ((32, 32, 3), 10),
    "cifar100": ((32, 32, 3), 100),
    "tiny_imagenet": ((64, 64, 3), 200),
    "emnist": ((28, 28, 1), 62),
    "cifar100_pachinko": ((32, 32, 3), 100),
}
_TEXT_DATASETS = ("glue/sst2", "sentiment140", "yelp_polarity_reviews")


def _loader_default(fn: Callable, name: str, kwargs: dict[str, Any]) -> Any:
    if name in kwargs:
        return kwargs[name]
    return inspect.signature(fn).parameters[name].default


def input_spec(
    name: str, dataset_kwargs: dict[str, Any] | None = None
) -> tuple[tuple[int, ...], Any, int]:
    """``(example shape, dtype, num_classes)`` of dataset ``name`` without loading it.

    Args:
      name: a key of ``fedorth.data.DATASETS``.
      dataset_kwargs: the loader options of the config (``max_len``, ``seq_len``, ``dim``, ...).

    Returns:
      The shape of one input example (tokens ``[seq_len + 1]`` for ``c4``), its dtype and the
      number of classes (for ``c4`` the vocabulary: 257 bytes, or the tokenizer's).
    """
    kwargs = dict(dataset_kwargs or {})
    if name in IMAGE_SHAPES:
        shape, classes = IMAGE_SHAPES[name]
        if name == "emnist" and kwargs.get("only_digits"):
            classes = 10
        return shape, jnp.float32, classes
    natural = data_lib.natural
    if name == "shakespeare":
        seq_len = int(_loader_default(natural.load_shakespeare, "sequence_length", kwargs))
        return (seq_len + 1,), jnp.int32, natural.SHAKESPEARE_VOCAB_SIZE
    if name == "stackoverflow":
        seq_len = int(_loader_default(natural.load_stackoverflow, "sequence_length", kwargs))
        vocab = int(_loader_default(natural.load_stackoverflow, "vocab_size", kwargs))
        return (seq_len + 1,), jnp.int32, vocab + 4
    if name == "stackoverflow_tags":
        words = int(_loader_default(natural.load_stackoverflow_tags, "vocab_size", kwargs))
        tags = int(_loader_default(natural.load_stackoverflow_tags, "tag_vocab_size", kwargs))
        return (words,), jnp.float32, tags
    if name in data_lib.glue.LOADERS and (name != "glue/sst2" or kwargs.get("tokenizer")):
        task = data_lib.glue.GLUE_TASKS[name.split("/")[1]]
        max_len = int(_loader_default(data_lib.glue.load_glue, "max_len", kwargs))
        return (max_len,), jnp.int32, task.num_classes
    if name in _TEXT_DATASETS:
        return (int(_loader_default(data_lib.tfds.load_text, "max_len", kwargs)),), jnp.int32, 2
    if name == "c4":
        seq_len = int(_loader_default(data_lib.tfds.load_c4, "seq_len", kwargs))
        vocab = data_lib.tfds.BYTE_VOCAB_SIZE
        if kwargs.get("tokenizer"):
            from fedorth.data.tokenizer import load_tokenizer

            vocab = load_tokenizer(kwargs["tokenizer"]).vocab_size
        return (seq_len + 1,), jnp.int32, vocab
    if name == "synthetic":
        dim = int(_loader_default(data_lib.load_synthetic, "dim", kwargs))
        classes = int(_loader_default(data_lib.load_synthetic, "num_classes", kwargs))
        return (dim,), jnp.float32, classes
    valid = sorted(
        [
            *IMAGE_SHAPES,
            *_TEXT_DATASETS,
            "c4",
            "synthetic",
            "shakespeare",
            "stackoverflow",
            "stackoverflow_tags",
        ]
    )
    raise ValueError(f"data.name={name!r} has no known input shape; valid: {valid}.")


@functools.lru_cache(maxsize=64)
def _model_shapes(model_json: str, shape: tuple[int, ...], dtype, num_classes: int):
    """(model, param shapes, model-state shapes): a pure function of the model config and input
    shape (shapes do not depend on the init key), cached because many presets share a model."""
    config = ml_collections.ConfigDict({"model": json.loads(model_json)})
    model = build_model(config, types.SimpleNamespace(num_classes=num_classes))
    example = jax.ShapeDtypeStruct((2, *shape), dtype)
    params, model_state = jax.eval_shape(model.init, jax.random.key(0), example)
    return model, params, model_state


@dataclasses.dataclass
class DryBuild:
    """A run's objects with shapes only (``jax.ShapeDtypeStruct`` leaves), no data loaded."""

    config: ml_collections.ConfigDict
    model: models.Model
    algorithm: fed.FedAlgorithm
    round_config: fed.RoundConfig
    round_fn: fed.RoundFn
    input_shape: tuple[int, ...]
    params: Any
    model_state: Any
    server: fed.ServerState


def dry_build(config: ml_collections.ConfigDict) -> DryBuild:
    """Checks that ``config`` builds, without loading data or computing anything.

    Builds the algorithm, the model (parameter shapes by ``jax.eval_shape`` of its ``init`` on
    the dataset's input shape, :func:`input_spec`), the round config and round function (not
    compiled), and the shapes of the initial server state (``jax.eval_shape`` of
    ``fed.init_server``: optimizer, control-variate and per-client states). Paper presets whose
    data is not prepared on this machine can be checked this way.
    """
    algorithm = fed.get_algorithm(
        config.fed.algorithm, _to_dict(config.optim), **_to_dict(config.fed.get("options"))
    )
    shape, dtype, num_classes = input_spec(
        config.data.name, _to_dict(config.data.get("dataset_kwargs"))
    )
    if image_size(config):  # batches are resized on device before the model (make_batch_fn)
        shape = (image_size(config), image_size(config), *shape[2:])
    model_json = json.dumps(_to_dict(config.model), sort_keys=True, default=str)
    model, params, model_state = _model_shapes(model_json, shape, jnp.dtype(dtype), num_classes)
    num_clients = int(config.data.num_clients)
    round_config = make_round_config(config)
    round_fn = fed.make_round_fn(
        algorithm, model.loss_fn, make_batch_fn(config), round_config, params=params
    )
    server = jax.eval_shape(
        lambda p, s, k: fed.init_server(
            algorithm, p, s, num_clients=num_clients, key=k, privacy=round_config.privacy
        ),
        params,
        model_state,
        run_key(config),
    )
    return DryBuild(
        config, model, algorithm, round_config, round_fn, shape, params, model_state, server
    )


def refuse_stream(experiment: Experiment) -> Experiment:
    """``experiment``, unless its training clients are streamed (``data.stream``): a sweep's
    replicas each hold their data loaded whole.

    Raises:
      ConfigError: one line naming ``data.stream`` and the fix.
    """
    if experiment.stream is None:
        return experiment
    experiment.stream.close()
    raise ConfigError(
        f"data.stream streams data.name={experiment.config.data.name!r} (its training clients "
        "are read per round), and a sweep's replicas hold their data loaded whole: sweep it "
        "with --config.data.stream=false if the replicas fit in memory, or run each setting "
        "as its own run (experiments.main)."
    )


def run_key(config: ml_collections.ConfigDict) -> jax.Array:
    """The server state's key (``ServerState.key``, fixed for the run): it drives sampling,
    batches and dropout."""
    _, key = jax.random.split(jax.random.key(int(config.seed)))
    return key


def round_feed(experiment: Experiment):
    """The :class:`fedorth.train.feed.RoundFeed` of a run: ``feed(r)`` is what round ``r``
    reads (``experiment.data``, or a streamed round's sampled clients, the next round's
    prefetched with ``data.prefetch``). The rounds' clients come from :func:`run_key`, made
    here on the host (every process of a run makes the same)."""
    config = experiment.config
    return feed.RoundFeed(
        experiment.data,
        experiment.stream,
        run_key(config),
        experiment.round_config.num_clients,
        experiment.round_config.clients_per_round,
        prefetch=bool(config.data.get("prefetch", True)),
        place=experiment.round_fn.place,
        rounds=int(config.fed.rounds),
    )


def _init_server(experiment: Experiment, *, stacked: bool) -> fed.ServerState:
    """The server state of round 0 computed eagerly; ``stacked=False``: one client's state in
    ``clients`` (the template of a client-state store)."""
    return fed.init_server(
        experiment.algorithm,
        experiment.init_params,
        experiment.init_model_state,
        num_clients=experiment.round_config.num_clients,
        key=run_key(experiment.config),
        privacy=experiment.round_config.privacy,
        stacked=stacked,
    )


def init_server(experiment: Experiment) -> fed.ServerState:
    """The server state of round 0; its key drives sampling, batches and dropout. With a
    client-state store (:func:`with_client_store`) its ``clients`` is None: the store has them."""
    stacked = experiment.client_store is None

    def init_server_state(params, model_state):
        return fed.init_server(
            experiment.algorithm,
            params,
            model_state,
            num_clients=experiment.round_config.num_clients,
            key=run_key(experiment.config),
            privacy=experiment.round_config.privacy,
            stacked=stacked,
        )

    arguments = (experiment.init_params, experiment.init_model_state)
    shapes = jax.eval_shape(init_server_state, *arguments)
    num_clients = experiment.round_config.num_clients
    try:
        _check_state_fits(shapes, num_clients)
        server = eager_jit.jit_op_by_op(init_server_state)(*arguments)
    except jax.errors.JaxRuntimeError as error:
        if not fed_memory.is_out_of_memory(error):
            raise
        raise _state_out_of_memory(shapes, num_clients, fed_memory.available_host_bytes()) from None
    if experiment.client_store is not None:
        server = server.replace(clients=None)
    return experiment.round_fn.place(server)


def _state_bytes(shapes) -> tuple[int, int]:
    """Bytes of a server state of ``shapes`` (``jax.eval_shape``'s), and of its per-client part."""

    def size(tree) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "size"))

    key_bytes = jax.eval_shape(jax.random.key_data, shapes.key)
    whole = size(shapes.replace(key=key_bytes))
    return whole, size(shapes.clients)


def _state_out_of_memory(shapes, num_clients: int, available: int | None):
    whole, clients = _state_bytes(shapes)
    message = fed_memory.state_out_of_memory_message(
        whole, clients, num_clients, jax.devices()[0], available
    )
    return fed.RoundOutOfMemoryError(message)


def _check_state_fits(shapes, num_clients: int) -> None:
    """On the CPU backend, refuses in one line a server state larger than what the host can still
    allocate: XLA:CPU may abort the process (``std::bad_alloc``) instead of raising."""
    if jax.default_backend() != "cpu":
        return
    available = fed_memory.available_host_bytes()
    if available is not None and _state_bytes(shapes)[0] > available:
        raise _state_out_of_memory(shapes, num_clients, available)


def with_client_store(experiment: Experiment, workdir: pathlib.Path) -> Experiment:
    """``experiment`` with its clients' states where ``fed.client_state`` says
    (``fedorth.fed.client_store``); ``auto`` prints its choice and estimate in one line.

    Unchanged for ``device`` and for algorithms that keep no per-client state. ``host`` and
    ``disk`` (folder ``fed.client_state_dir``, default ``<workdir>/client_state``) get a store
    and a round that reads and writes the sampled clients' rows in it.
    """
    config = experiment.config
    kind = config.fed.get("client_state", "auto")
    template = jax.eval_shape(lambda: _init_server(experiment, stacked=False).clients)
    if template is None or kind == "device":
        return experiment
    n = experiment.round_config.num_clients
    directory = pathlib.Path(config.fed.get("client_state_dir") or workdir / "client_state")
    if kind == "auto":
        kind, line = client_store_lib.choose(
            n,
            client_store_lib.bytes_per_client(template),
            device_free=client_store_lib.device_free_bytes(),
            host_free=client_store_lib.host_available_bytes(),
            disk_free=client_store_lib.disk_free_bytes(directory),
            directory=directory,
        )
        print(line, file=sys.stderr)
        if kind == "device":
            return experiment
    if jax.process_count() > 1:
        raise ConfigError(
            f"fed.client_state={kind!r} keeps the clients' states in one process; a run of "
            f"{jax.process_count()} processes keeps them on the devices: "
            "--config.fed.client_state=device."
        )
    store = stored_round.make_store(
        kind, _init_server(experiment, stacked=False).clients, n, directory
    )
    round_config = dataclasses.replace(experiment.round_config, client_rows=True)
    inner = fed.make_round_fn(
        experiment.algorithm,
        experiment.model.loss_fn,
        make_batch_fn(config),
        round_config,
        params=experiment.init_params,
    )
    round_fn = stored_round.StoredRoundFn(inner, store, n, round_config.clients_per_round)
    return dataclasses.replace(
        experiment, round_config=round_config, round_fn=round_fn, client_store=store
    )


def make_eval_fn(experiment: Experiment):
    """``eval_fn(params, model_state) -> {test_loss, test_accuracy[, test_auc]}`` on the test split
    (``{test_loss, test_recall_at_5}`` for a multi-label model).

    ``test_auc`` (exact ROC AUC) appears when the model's ``eval_fn`` returns per-example scores
    under ``"per_example"`` (``fedorth.models.auc``). With a validation split
    (``data.validation_fraction``) the same metrics of it come as ``val_loss``,
    ``val_accuracy`` (``val_auc``). With ``eval_per_client=True`` (a test split whose examples
    have clients, ``FederatedData.test_client``) the loss and accuracy of each test client
    are summarized over the clients (:func:`client_metrics`).
    """
    batch_size = int(experiment.config.get("eval_batch_size", 256))
    fed_data = experiment.data
    num_batches = data_lib.num_test_batches(fed_data, batch_size)
    size = image_size(experiment.config)

    def resize_batch(batch):
        if not size:
            return batch
        return {**batch, "x": randaugment.resize(batch["x"], size)}

    model = experiment.model

    @jax.jit
    def eval_fn(params, model_state, fed_data):
        def one(index):
            return model.eval_fn(
                params, model_state, resize_batch(data_lib.test_batch(fed_data, index, batch_size))
            )

        outs = jax.lax.map(one, jnp.arange(num_batches))
        # Per-example outputs (the AUC model's scores, fedorth.models.auc) are kept whole.
        per_example = outs.pop("per_example", None)
        sums = jax.tree.map(lambda x: jnp.sum(x, axis=0), outs)
        count = jnp.maximum(sums["count"], 1.0)
        out = {"test_loss": sums["loss_sum"] / count}
        if "correct" in sums:  # a model with pad_id counts the accuracy over unpadded targets
            scored = jnp.maximum(sums.get("accuracy_count", sums["count"]), 1.0)
            out["test_accuracy"] = sums["correct"] / scored
        if "recall_hits" in sums:  # a multi-label model: recall@5 pooled over the examples
            out["test_recall_at_5"] = sums["recall_hits"] / jnp.maximum(sums["recall_count"], 1.0)
        if per_example is not None:
            out["per_example"] = per_example
        return out

    def evaluate_split(params, model_state, data):
        out = eval_fn(params, model_state, data)
        if "per_example" in out:
            from fedorth.models.auc import roc_auc  # exact ROC AUC over the whole test split

            examples = jax.device_get(out.pop("per_example"))
            out["test_auc"] = roc_auc(examples["score"], examples["label"], mask=examples["mask"])
        return out

    validation = None
    if fed_data.x_val is not None:  # evaluated like the test split (a second compilation)
        validation = fed_data.replace(x_test=fed_data.x_val, y_test=fed_data.y_val)

    per_client = None
    if experiment.config.get("eval_per_client", False):
        per_client = make_client_sums_fn(experiment, batch_size, resize_batch)

    def evaluate(params, model_state):
        out = evaluate_split(params, model_state, fed_data)
        if validation is not None:
            held = evaluate_split(params, model_state, validation)
            out.update({"val" + k[len("test") :]: v for k, v in held.items()})
        if per_client is not None:
            out.update(client_metrics(jax.device_get(per_client(params, model_state, fed_data))))
        return out

    return evaluate


PER_CLIENT_DATASETS = (
    "emnist, shakespeare, stackoverflow, stackoverflow_tags, cifar100_pachinko, parquet"
)


def make_client_sums_fn(experiment: Experiment, batch_size: int, resize_batch):
    """``sums(params, model_state, data) -> {"loss_sum", "correct", "count"}``, each ``[C]``:
    the evaluation sums of each test client (``FederatedData.test_client``), example by
    example (the model's ``eval_fn`` vmapped over batches of one), so that the sums are those
    of the whole-split evaluation, split by client."""
    fed_data = experiment.data
    if fed_data.test_client is None:
        raise ConfigError(
            f"eval_per_client=True needs a test split whose examples have clients; "
            f"data.name={experiment.config.data.name!r} has none (datasets with them: "
            f"{PER_CLIENT_DATASETS}): set eval_per_client=False."
        )
    num_clients = int(jax.device_get(jnp.max(fed_data.test_client))) + 1
    num_batches = data_lib.num_test_batches(fed_data, batch_size)
    num_test = fed_data.x_test.shape[0]
    model = experiment.model
    keys = ("loss_sum", "correct", "count")
    if getattr(model, "pad_id", None) is not None and model.task == "lm":
        keys += ("accuracy_count",)
    if getattr(model, "task", None) == "multilabel":
        keys = ("loss_sum", "count", "recall_hits", "recall_count")

    @jax.jit
    def sums(params, model_state, data):
        def step(carry, index):
            batch = resize_batch(data_lib.test_batch(data, index, batch_size))
            frozen = batch.pop("frozen", None)

            def one(example):
                single = {k: v[None] for k, v in example.items()}
                if frozen is not None:
                    single["frozen"] = frozen
                return model.eval_fn(params, model_state, single)

            outs = jax.vmap(one)(batch)
            rows = index * batch_size + jnp.arange(batch_size, dtype=jnp.int32)
            owner = data.test_client[jnp.minimum(rows, num_test - 1)]
            carry = {
                k: carry[k]
                + jax.ops.segment_sum(
                    outs.get(k, jnp.zeros(batch_size)), owner, num_segments=num_clients
                )
                for k in keys
            }
            return carry, None

        zeros = {k: jnp.zeros(num_clients, jnp.float32) for k in keys}
        carry, _ = jax.lax.scan(step, zeros, jnp.arange(num_batches, dtype=jnp.int32))
        return carry

    return sums


def client_metrics(sums: dict[str, Any]) -> dict[str, float]:
    """Mean and spread over the test clients of each client's loss and accuracy.

    Client ``c``'s loss is ``loss_sum[c] / count[c]`` and its accuracy ``correct[c] / count[c]``
    (``correct[c] / accuracy_count[c]`` for a model with ``pad_id``; clients without test
    examples are left out); each is summarized by its unweighted mean
    over clients, standard deviation (``ddof=0``), and 10th and 90th percentiles:
    ``test_loss_client_mean``, ``test_loss_client_std``, ``test_loss_client_p10``,
    ``test_loss_client_p90`` and the same for ``test_accuracy_client_*`` (a multi-label model's
    ``recall_hits[c] / recall_count[c]``: ``test_recall_at_5_client_*``), plus
    ``test_clients`` (how many clients were evaluated).
    """
    count = np.asarray(sums["count"], np.float64)
    present = count > 0
    if "recall_hits" in sums:  # a multi-label model: each client's recall@5
        recalled = np.maximum(np.asarray(sums["recall_count"], np.float64), 1.0)
        score = ("recall_at_5", "recall_hits", recalled)
    else:
        scored = np.maximum(np.asarray(sums.get("accuracy_count", count), np.float64), 1.0)
        score = ("accuracy", "correct", scored)
    out = {"test_clients": float(present.sum())}
    for name, key, denominator in (("loss", "loss_sum", count), score):
        values = np.asarray(sums[key], np.float64)[present] / denominator[present]
        out[f"test_{name}_client_mean"] = float(values.mean())
        out[f"test_{name}_client_std"] = float(values.std())
        out[f"test_{name}_client_p10"] = float(np.percentile(values, 10))
        out[f"test_{name}_client_p90"] = float(np.percentile(values, 90))
    return out


def condition_numbers(params) -> dict[str, float]:
    """Condition number ``sigma_max / sigma_min`` of each weight matrix (FedMuon (Liu et al.)
    Figure 4)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if leaf.ndim >= 2:
            mat = leaf.reshape(-1, leaf.shape[-1])
            s = jnp.linalg.svd(mat.astype(jnp.float32), compute_uv=False)
            out[jax.tree_util.keystr(path)] = float(s[0] / jnp.maximum(s[-1], 1e-30))
    return out
