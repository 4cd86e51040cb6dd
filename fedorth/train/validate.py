"""Checks a run's config before anything is loaded or compiled.

``validate(config)`` raises :class:`ConfigError` (a ``ValueError``) listing every problem it finds,
one per line. Each line names the field, the value and what is valid:

* unknown names (``fed.algorithm``, ``optim.name``, ``model.name``, ``data.name``,
  ``data.partition``, ``fed.strategy``, ``optim.schedule``) list the valid choices;
* out-of-range values name the valid range (``fed.clients_per_round`` in ``[1, data.num_clients]``,
  ``optim.learning_rate > 0``, Dirichlet ``data.alpha > 0``, ``alpha``/``beta`` options in
  ``[0, 1]``, ...);
* unknown keyword options of the model, dataset loader, partitioner, algorithm or optimizer
  list the accepted ones;
* the environment's ``FEDORTH_LAPACK_THREADS`` (``fedorth.optim.linalg.host_threads``), read
  when a round is lowered, is checked with them.

Unknown *config keys* given on the command line are rejected earlier, by the locked config of
``experiments/main.py``; a config file that fails to load is one line naming its file and line
(:func:`config_file_error`). The files a config names (``model.pretrained``,
``data.dataset_kwargs.tokenizer``) are checked by :func:`fedorth.train.builders.check_files`
before the data are loaded, and the checks that need the data (no more clients than examples,
every client non-empty) run when the data are built (``fedorth.data.DataConfigError``); all name
the key and the fix. :class:`ConfigError` is :class:`fedorth.train.builders.ConfigError`, which
both raise.

Batch-size rule: the engine's sampler (``fedorth.data.sample_batch``) draws each local
mini-batch uniformly **with replacement** from the client's examples, so ``fed.batch_size`` may
exceed a client's size; only ``fed.batch_size >= 1`` is required.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import numpy as np
from absl import flags

from fedorth import data as data_lib
from fedorth import fed, models
from fedorth.fed import client_store, local
from fedorth.models.layers import MODEL_DTYPES
from fedorth.optim import linalg
from fedorth.optim.newton_schulz import NS_DTYPES
from fedorth.train import builders, privacy, trackers
from fedorth.train.builders import ConfigError

_UNIT_OPTIONS = ("alpha", "beta")  # algorithm weights: a convex combination, in [0, 1]
_DECAYS = ("b1", "b2", "shampoo_beta")  # Adam-style decays: 1 would divide by 1 - b^t = 0
_MOMENTA = ("beta", "momentum")  # momentum coefficients of the local optimizers
_TOP_LEVEL_INTS = {"eval_every": 0, "checkpoint_every": 0, "eval_batch_size": 1}


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _as_dict(section: Any) -> dict[str, Any]:
    if section is None:
        return {}
    if isinstance(section, ml_collections.ConfigDict):
        return section.to_dict()
    return dict(section)


def _accepted_keywords(fn: Callable, skip: tuple[str, ...]) -> list[str] | None:
    """Keyword names ``fn`` accepts (``None`` if it takes ``**kwargs``)."""
    fn = inspect.unwrap(fn)
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return sorted(
        p.name
        for p in params
        if p.name not in skip and p.kind is not inspect.Parameter.VAR_POSITIONAL
    )


class _Checker:
    """Collects one message per problem."""

    def __init__(self):
        self.errors: list[str] = []

    def fail(self, message: str) -> None:
        self.errors.append(message)

    def choice(self, field: str, value: Any, choices) -> bool:
        if isinstance(value, str) and value in choices:
            return True
        self.fail(f"{field}={value!r} is unknown; valid choices: {sorted(choices)}.")
        return False

    def integer(
        self, field: str, value: Any, low: int, high: int | None = None, why: str = ""
    ) -> bool:
        if _is_int(value) and value >= low and (high is None or value <= high):
            return True
        valid = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        kind = "" if _is_int(value) else f" (a {type(value).__name__})"
        self.fail(f"{field}={value!r}{kind} is out of range; valid: {valid}{why}.")
        return False

    def real(
        self,
        field: str,
        value: Any,
        *,
        low: float,
        high: float = math.inf,
        low_open: bool = False,
        high_open: bool = False,
        why: str = "",
    ) -> bool:
        ok = _is_real(value) and math.isfinite(float(value))
        if ok:
            v = float(value)
            ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        if ok:
            return True
        if high == math.inf:
            valid = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            left, right = "(" if low_open else "[", ")" if high_open else "]"
            valid = f"a number in {left}{low:g}, {high:g}{right}"
        self.fail(f"{field}={value!r} is out of range; valid: {valid}{why}.")
        return False

    def keywords(self, field: str, given: Mapping[str, Any], fn: Callable, skip=()) -> None:
        accepted = _accepted_keywords(fn, tuple(skip))
        if accepted is None:
            return
        unknown = sorted(set(given) - set(accepted))
        if unknown:
            self.fail(f"{field} has unknown keys {unknown}; valid keys: {accepted}.")


def _check_data(c: _Checker, config) -> None:
    cfg = config.data
    name = cfg.get("name")
    if c.choice("data.name", name, data_lib.DATASETS):
        c.keywords(
            "data.dataset_kwargs",
            _as_dict(cfg.get("dataset_kwargs")),
            data_lib.DATASETS[name],
            skip=("data_dir", "seed", "num_clients", "stream"),
        )
        partition = cfg.get("partition", "iid")
        if data_lib.has_natural_clients(name) and partition != "natural":
            c.fail(data_lib.natural_partition_message(name, partition))
    c.integer("data.num_clients", cfg.get("num_clients"), 1)
    try:
        mode = data_lib.stream_lib.stream_mode(cfg.get("stream", "auto"))
    except data_lib.DataConfigError as e:
        c.fail(str(e))
    else:
        if mode is True and name in data_lib.DATASETS and not data_lib.has_natural_clients(name):
            c.fail(data_lib.not_streamed_message(name))
    if cfg.get("image_size") is not None:
        c.integer(
            "data.image_size",
            cfg.image_size,
            0,
            why=" (the side batches are resized to on device; 0: the data's own size)",
        )
    if cfg.get("validation_fraction"):
        c.real(
            "data.validation_fraction", cfg.validation_fraction, low=0.0, high=1.0, high_open=True
        )
    partition = cfg.get("partition", "iid")
    if c.choice("data.partition", partition, data_lib.PARTITIONERS):
        kwargs = _as_dict(cfg.get("partition_kwargs"))
        c.keywords(
            "data.partition_kwargs",
            kwargs,
            data_lib.PARTITIONERS[partition],
            skip=("labels", "num_clients", "seed", "alpha"),
        )
        if partition.startswith("dirichlet"):
            alpha = cfg.get("alpha", kwargs.get("alpha"))
            c.real(
                "data.alpha",
                alpha,
                low=0.0,
                low_open=True,
                why=f" (the Dirichlet concentration of partition {partition!r})",
            )


# Keys of config.model that the builder reads itself instead of passing them to the model
# (the lora_* keys wrap any model in fedorth.models.lora; lora_rank 0 = off).
_BUILDER_MODEL_KEYS = (
    "name",
    "task",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "lora_trainable",
)


def _check_model(c: _Checker, config) -> None:
    kwargs = _as_dict(config.model)
    name = kwargs.get("name")
    if c.choice("model.name", name, models.MODELS):
        for key in _BUILDER_MODEL_KEYS:
            kwargs.pop(key, None)
        c.keywords("model", kwargs, models.MODELS[name])
    # Every model takes `dtype` (mixed precision, fedorth.models.layers.compute_dtype).
    c.choice("model.dtype", kwargs.get("dtype", "float32"), MODEL_DTYPES)
    if "hidden_sizes" in kwargs:
        sizes = kwargs["hidden_sizes"]
        sizes = tuple(sizes) if isinstance(sizes, list | tuple) else (sizes,)
        if not all(_is_int(size) and size >= 1 for size in sizes):
            c.fail(
                f"model.hidden_sizes={sizes!r} is out of range; valid: a tuple of integers >= 1 "
                "(the widths of the hidden layers), e.g. (128, 128)."
            )


def _check_optim(c: _Checker, config) -> bool:
    optim = _as_dict(config.optim)
    name_ok = c.choice("optim.name", optim.get("name"), local.DIRECTIONS)
    rounds = config.fed.get("rounds")
    c.real("optim.learning_rate", optim.get("learning_rate"), low=0.0, low_open=True)
    schedule = optim.get("schedule", "constant")
    c.choice("optim.schedule", schedule, builders.SCHEDULES)
    c.real("optim.weight_decay", optim.get("weight_decay", 0.0), low=0.0)
    if "ns_dtype" in optim:  # Newton-Schulz matmul dtype (fedorth.optim.newton_schulz)
        c.choice("optim.ns_dtype", optim["ns_dtype"], NS_DTYPES)
    if "warmup_rounds" in optim:
        c.integer("optim.warmup_rounds", optim["warmup_rounds"], 0)
    if optim.get("final_lr_ratio") is not None:
        c.real("optim.final_lr_ratio", optim["final_lr_ratio"], low=0.0, high=1.0)
    for i, boundary in enumerate(optim.get("step_rounds", ()) or ()):
        c.integer(f"optim.step_rounds[{i}]", boundary, 1, rounds if _is_int(rounds) else None)
    for key in _DECAYS:
        if optim.get(key) is not None:
            c.real(f"optim.{key}", optim[key], low=0.0, high=1.0, high_open=True)
    for key in _MOMENTA:
        if optim.get(key) is not None:
            c.real(f"optim.{key}", optim[key], low=0.0, high=1.0)
    return name_ok


def _check_fed(c: _Checker, config) -> None:
    cfg = config.fed
    num_clients = config.data.get("num_clients")
    c.choice("fed.algorithm", cfg.get("algorithm"), fed.ALGORITHMS)
    c.integer("fed.rounds", cfg.get("rounds"), 1)
    high = num_clients if _is_int(num_clients) and num_clients >= 1 else None
    c.integer(
        "fed.clients_per_round",
        cfg.get("clients_per_round"),
        1,
        high,
        why=" (<= data.num_clients: clients are sampled without replacement)" if high else "",
    )
    c.integer("fed.local_steps", cfg.get("local_steps"), 1)
    c.integer(
        "fed.batch_size",
        cfg.get("batch_size"),
        1,
        why=" (batches are drawn with replacement, so it may exceed a client's size)",
    )
    strategy = cfg.get("strategy", "auto")
    c.choice("fed.strategy", strategy, fed.STRATEGIES)
    c.choice("fed.aggregation", cfg.get("aggregation", "uniform"), fed.AGGREGATIONS)
    chunk = cfg.get("chunk_size")
    if strategy == "chunked":
        c.integer("fed.chunk_size", chunk, 1, why=" for strategy 'chunked'")
    c.choice("fed.client_state", cfg.get("client_state", "auto"), client_store.STORES)
    unroll = cfg.get("unroll", 1)
    if not isinstance(unroll, bool):
        c.integer("fed.unroll", unroll, 1, why=" (or True: fully unrolled)")
    for key, value in _as_dict(cfg.get("options")).items():
        if key in _UNIT_OPTIONS:
            c.real(f"fed.options.{key}", value, low=0.0, high=1.0)
        elif key == "server_lr" and value is not None:
            c.real("fed.options.server_lr", value, low=0.0, low_open=True)


def _check_top_level(c: _Checker, config) -> None:
    c.integer("seed", config.get("seed"), 0, 2**32 - 1)
    try:  # the environment's thread count of host LAPACK calls, read when a round is lowered
        linalg.host_threads()
    except ValueError as e:
        c.fail(str(e))
    for problem in trackers.check(config):
        c.fail(problem)
    for key, low in _TOP_LEVEL_INTS.items():
        if key in config:
            c.integer(key, config[key], low)


def _check_privacy(c: _Checker, config) -> None:
    """``config.dp`` (client-level differential privacy; fedorth.train.privacy)."""
    try:
        privacy.check(config)
    except ValueError as e:
        c.fail(str(e))


def _check_builds(c: _Checker, config) -> None:
    """Builds the optimizer and algorithm (Optax closures, nothing compiled) to run their checks."""
    name = config.fed.algorithm
    options = _as_dict(config.fed.get("options"))
    accepted = fed.algorithms.option_keywords(name)
    unknown = []
    if accepted is not None:  # the server optimizer's keys (server_opt) are every algorithm's
        unknown = sorted(set(options) - {*accepted, *fed.update.SERVER_OPTIMIZER_KEYS})
    if unknown:
        c.fail(f"fed.options has unknown keys {unknown}; valid keys: {accepted}.")
    if c.errors:
        return
    optim = _as_dict(config.optim)
    try:
        opt_name, _, hparams = local.split_optim(optim)
        local.direction(opt_name, **hparams)
    except (ValueError, TypeError) as e:
        c.fail(f"optim: {e}")
        return
    try:
        algorithm = fed.get_algorithm(name, optim, **options)
        builders.make_round_config(config).validate(algorithm)
    except ConfigError as e:  # a whole message of its own, naming its key
        c.fail(str(e))
    except (ValueError, TypeError) as e:
        c.fail(f"fed.algorithm={name!r} with fed.options={options}: {e}")


def _check_image_size(c: _Checker, config) -> None:
    """A model with learned positions (ViT-B/16, Swin-T) sees images of its ``image_size``."""
    name = config.model.name
    parameter = inspect.signature(models.MODELS[name]).parameters.get("image_size")
    if parameter is None:
        return
    expected = int(config.model.get("image_size", parameter.default))
    resized = int(config.data.get("image_size", 0) or 0)
    native = builders.IMAGE_SHAPES.get(config.data.name, ((None,), None))[0][0]
    side = resized or native
    if side is None or side == expected:
        return
    given = (
        f"data.image_size={resized}"
        if resized
        else f"data.name={config.data.name!r} has {side}x{side} images"
    )
    fix = f"set data.image_size={expected} (batches are resized on device)"
    if "image_size" in config.model:
        fix += f", or model.image_size={side} (then the checkpoint's positions do not fit)"
    c.fail(
        f"model.name={name!r} takes {expected}x{expected} images (its positions are learned "
        f"for that size), but {given}: {fix}."
    )


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks names and ranges of a run's config; nothing is loaded or compiled.

    Args:
      config: the run's config (sections of ``configs/base.py``).

    Raises:
      ConfigError: one line per problem, each naming the field, its value and the valid choices
        or range.
    """
    c = _Checker()
    for section in ("data", "model", "fed", "optim"):
        if config.get(section) is None:
            c.fail(f"config section {section!r} is missing (see configs/base.py).")
    if c.errors:
        raise ConfigError("Invalid config:\n  " + "\n  ".join(c.errors))
    _check_top_level(c, config)
    _check_data(c, config)
    _check_model(c, config)
    optim_ok = _check_optim(c, config)
    _check_fed(c, config)
    if not c.errors:
        _check_privacy(c, config)
    if not c.errors and optim_ok:
        # Only on an otherwise valid config, so each problem is reported once.
        _check_builds(c, config)
    if not c.errors:
        _check_image_size(c, config)
    if c.errors:
        raise ConfigError("Invalid config:\n  " + "\n  ".join(c.errors))


def _load_config_file(spec: str) -> ml_collections.ConfigDict:
    """``get_config([arg])`` of ``path[:arg]``, as ``config_flags.DEFINE_config_file`` loads it."""
    path, _, arg = spec.partition(":")
    module = runpy.run_path(path)
    return module["get_config"](arg) if arg else module["get_config"]()


def unknown_override_message(argv: list[str]) -> str | None:
    """Names the first ``--config.a.b=v`` of ``argv`` whose key the config file does not define.

    Args:
      argv: the command line (``sys.argv``), holding ``--config=path[:arg]``.

    Returns:
      A message naming the key, the closest valid keys and the valid keys at that level; ``None``
      if every override names an existing key (or the config file cannot be loaded).
    """
    specs = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    if not specs:
        return None
    try:
        config = _load_config_file(specs[-1])
    except Exception:  # noqa: BLE001 -- the flag parser reports a config file that fails
        return None
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[len("--config.") :].split("=", 1)[0]
        node, walked = config, []
        for part in path.split("."):
            keys = list(node.keys()) if isinstance(node, ml_collections.ConfigDict | dict) else []
            if part not in keys:
                where = "config." + ".".join(walked) if walked else "the config"
                close = difflib.get_close_matches(part, keys, n=1)
                hint = f" (did you mean {'.'.join([*walked, close[0]])!r}?)" if close else ""
                return (
                    f"--config.{path}: {where} has no key {part!r}{hint}; its keys are "
                    f"{sorted(keys)}. The config is locked: a new key must be added in the "
                    "config file (every field is listed in configs/base.py), not on the command "
                    "line."
                )
            node, walked = node[part], [*walked, part]
    return None


def _drop(config, section: str, keep, overrides: Mapping[str, Any]) -> list[str]:
    """Deletes the keys of ``config.<section>`` not in ``keep`` and not given on the command
    line; returns them, prefixed with the section, sorted."""
    node = config
    for part in section.split("."):
        node = node[part]
    dropped = sorted(k for k in node.keys() if k not in keep and f"{section}.{k}" not in overrides)
    with config.unlocked():
        for key in dropped:
            del node[key]
    return [f"{section}.{k}" for k in dropped]


def drop_foreign_keys(config, overrides: Mapping[str, Any]) -> dict[str, list[str]]:
    """Lets ``--config.model.name``, ``--config.optim.name`` and ``--config.fed.algorithm``
    switch the model, the optimizer and the algorithm of a config file.

    A config file sets the keyword arguments of its own model, optimizer and algorithm
    (``fedpac_soap.py``: ``optim.b1``, ``optim.precondition_frequency``, ``fed.options.beta``),
    and a locked config cannot lose keys on the command line, so without this a switch always
    ends in "unknown keys". When the switch's key is among the overrides, the file's keys the
    new choice does not take are dropped: ``model.*`` (``models.MODELS``' arguments),
    ``optim.*`` (``fedorth.fed.local.direction_keywords`` and the schedule keys every optimizer
    takes) and ``fed.options.*`` (``fed.algorithms.option_keywords``). Keys given on the
    command line are always kept (a wrong one is still reported by :func:`validate`); an unknown
    name drops nothing (``validate`` reports it).

    Args:
      config: the parsed (locked) config; changed in place.
      overrides: the command line's ``--config.*`` values as a flat dict (``"model.name"`` ->
        value), as ``ml_collections.config_flags.get_override_values`` returns them.

    Returns:
      ``{switched key: dropped keys}``, e.g. ``{"optim.name": ["optim.b1", "optim.b2"]}``, only
      for switches that dropped something.
    """
    out: dict[str, list[str]] = {}
    if "model.name" in overrides and "model" in config:
        fn = models.MODELS.get(config.model.get("name"))
        accepted = _accepted_keywords(fn, ()) if fn is not None else None
        if accepted is not None:
            out["model.name"] = _drop(config, "model", {*_BUILDER_MODEL_KEYS, *accepted}, overrides)
    if "optim.name" in overrides and "optim" in config:
        name = config.optim.get("name")
        if name in local.DIRECTIONS:
            keep = {*local.OPTIM_KEYS, *local.direction_keywords(name)}
            out["optim.name"] = _drop(config, "optim", keep, overrides)
    if "fed.algorithm" in overrides and "fed" in config and "options" in config.fed:
        name = config.fed.get("algorithm")
        if name in fed.ALGORITHMS:
            accepted = fed.algorithms.option_keywords(name)
            if accepted is not None:
                if config.fed.options.get("server_opt") is not None:
                    accepted = [*accepted, *fed.update.SERVER_OPTIMIZER_KEYS]
                out["fed.algorithm"] = _drop(config, "fed.options", set(accepted), overrides)
    return {k: v for k, v in out.items() if v}


def switch_notes(config, dropped: Mapping[str, list[str]]) -> list[str]:
    """One ``note:`` line per switch of :func:`drop_foreign_keys`, for the CLI's stderr."""
    what = {"model.name": "that model", "optim.name": "that optimizer", "fed.algorithm": "it"}
    notes = []
    for key, keys in dropped.items():
        node = config
        for part in key.split("."):
            node = node[part]
        notes.append(
            f"note: --config.{key}={node}: the config file's {keys} are not arguments of "
            f"{what[key]} and were dropped."
        )
    return notes


def drop_keys_of_another_model(config, overrides: Mapping[str, Any]) -> list[str]:
    """The ``model.*`` part of :func:`drop_foreign_keys` (only a ``model.name`` switch)."""
    only_model = {k: v for k, v in overrides.items() if k != "optim.name" and k != "fed.algorithm"}
    return drop_foreign_keys(config, only_model).get("model.name", [])


def config_file_error(spec: str, error: BaseException) -> str | None:
    """One line for an error raised by a config file's own code (a syntax error, a NameError in
    ``get_config``), naming the file and line; None when the error did not come from it.

    Args:
      spec: the ``--config`` value, ``path[:preset]``.
      error: the exception raised while loading the file or calling its ``get_config``.
    """
    path = spec.partition(":")[0]
    folder = os.path.dirname(os.path.realpath(path))

    def ours(filename: str | None) -> bool:  # the file, or a module beside it (configs/base.py)
        return bool(filename) and os.path.dirname(os.path.realpath(filename)) == folder

    if isinstance(error, SyntaxError) and ours(error.filename):
        where, what = f"{error.filename}, line {error.lineno}", f"SyntaxError: {error.msg}"
    else:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if ours(f.filename)]
        if not frames:
            return None
        frame = frames[-1]
        where = f"{frame.filename}, line {frame.lineno}, in {frame.name}"
        what = f"{type(error).__name__}: {error}"
    return (
        f"--config={spec}: the config file fails ({what}; {where}): fix it, or start from a "
        "shipped config (python -m experiments.main --list)."
    )


def flags_parser(argv: list[str]) -> list[str]:
    """``absl.app.run``'s flag parser, with a one-line error for a bad ``--config.*`` override.

    Without it, an override naming a key the locked config does not have ends in a traceback
    from ml_collections (``AttributeError: "'typo'"``).
    """
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}\nPass --helpfull to list the flags.", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # raised by the config file's get_config, or by an override
        spec = next((a[len("--config=") :] for a in argv if a.startswith("--config=")), "")
        message = config_file_error(spec, e) if spec else None
        if message is None and isinstance(e, AttributeError | KeyError):
            message = unknown_override_message(argv) or f"a --config.* override is invalid: {e!r}"
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
