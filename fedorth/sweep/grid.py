"""A sweep's grid: which config keys vary, their values, and the replicas they make.

A grid maps config keys to lists of values; its replicas are the Cartesian product, in the
order the keys were given (the last key varies fastest). Two kinds of keys may vary:

* **built** keys, read when a run is built: ``seed`` (model init, client sampling,
  mini-batches, dropout and the data partition) and ``data.alpha`` (the Dirichlet
  concentration of the partition). Each replica builds its own data and initial state, exactly
  as its single run does;
* **traced** keys: float hyperparameters of ``optim`` (the learning rate, Adam's ``b1``,
  Muon's ``beta``, ...) and ``fed.options`` (the server step ``server_lr``, ...). They enter
  the compiled round as arrays, one value per replica, so no value compiles a round of its
  own. Whether fedorth's code can take a key as an array is checked by tracing the round
  (:mod:`fedorth.sweep.replicas`); a key it reads as a Python number is refused there.

Keys that change the shapes of the compiled round (the model, ``S``, ``K``, the batch size,
the number of clients, the dataset) cannot vary within one sweep, nor can keys that change
its structure (algorithm, optimizer, strategy, number of rounds): run one sweep per value.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

BUILT_KEYS = ("seed", "data.alpha")
"""Keys each replica builds its run with (data, initial state); the rest of a grid is traced."""

TRACED_SECTIONS = ("optim.", "fed.options.")
"""Float keys under these sections may be traced (if the round's code takes them as arrays)."""

SHAPE_KEYS = (
    "data.name",
    "data.num_clients",
    "data.image_size",
    "fed.batch_size",
    "fed.clients_per_round",
    "fed.local_steps",
)
SHAPE_SECTIONS = ("model.", "data.dataset_kwargs.")
"""Keys (and sections) that change the shapes of the compiled round."""


class SweepError(ValueError):
    """A sweep's grid or settings are invalid; the message names the key and the fix."""


def get_key(config: ml_collections.ConfigDict, key: str) -> Any:
    """``config`` at the dotted ``key`` (KeyError if absent)."""
    node: Any = config
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def set_key(tree: Any, key: str, value: Any) -> None:
    """Sets the dotted ``key`` of a nested dict or ConfigDict ``tree`` to ``value``."""
    *parents, last = key.split(".")
    node = tree
    for part in parents:
        node = node[part]
    node[last] = value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind(config: ml_collections.ConfigDict, key: str) -> str:
    """``"built"`` or ``"traced"``; raises SweepError naming the key otherwise."""
    if key in SHAPE_KEYS or key.startswith(SHAPE_SECTIONS):
        raise SweepError(
            f"sweep.{key} changes the shapes of the compiled round, so its values cannot share "
            f"one sweep: run one sweep per value (--config.{key}=VALUE)."
        )
    try:
        current = get_key(config, key)
    except KeyError:
        raise SweepError(
            f"sweep.{key}: the config has no key {key!r}; sweepable keys of this config: "
            f"{sweepable_keys(config)}."
        ) from None
    if key in BUILT_KEYS:
        return "built"
    if key.startswith(TRACED_SECTIONS) and _is_real(current) and not _is_int(current):
        return "traced"
    raise SweepError(
        f"sweep.{key} is not sweepable (a sweep varies seed, data.alpha and the float "
        f"hyperparameters of optim and fed.options): run one sweep per value "
        f"(--config.{key}=VALUE); sweepable keys of this config: {sweepable_keys(config)}."
    )


def sweepable_keys(config: ml_collections.ConfigDict) -> list[str]:
    """The keys of ``config`` a grid may name (before the round's tracing check)."""
    keys = [k for k in BUILT_KEYS if _has(config, k)]
    for section in ("optim", "fed.options"):
        try:
            node = get_key(config, section)
        except KeyError:
            continue
        for name, value in node.items():
            if _is_real(value) and not _is_int(value):
                keys.append(f"{section}.{name}")
    return keys


def _has(config, key: str) -> bool:
    try:
        get_key(config, key)
    except KeyError:
        return False
    return True


def _convert(key: str, value: Any, integer: bool) -> int | float:
    """One grid value of ``key``, from a string (command line) or a number (config file)."""
    expected = "an int" if integer else "a number"
    example = "42,43" if integer else "1e-3,3e-3"
    if isinstance(value, str):
        try:
            return int(value) if integer else float(value)
        except ValueError:
            pass
    elif integer and _is_int(value):
        return int(value)
    elif not integer and _is_real(value):
        return float(value)
    raise SweepError(
        f"sweep.{key}: {value!r} is not {expected}; give comma-separated values, e.g. "
        f"--sweep.{key}={example}."
    )


class Grid:
    """Config keys and their values; :meth:`replicas` is their product.

    Args:
      config: the base config (the sweep's replicas are copies of it).
      values: ``{dotted key: values}``; a value list may be a comma-separated string.
    """

    def __init__(self, config: ml_collections.ConfigDict, values: Mapping[str, Any]):
        if not values:
            raise SweepError(
                "the sweep has no grid: pass --sweep.KEY=v1,v2 (e.g. --sweep.seed=42,43,44) or "
                "give the config a `sweep` section."
            )
        self.config = config
        self.values: dict[str, list[int | float]] = {}
        self.kinds: dict[str, str] = {}
        for key, given in values.items():
            if isinstance(given, str):
                given = [v.strip() for v in given.split(",") if v.strip()]
            elif _is_real(given):
                given = [given]
            given = list(given)
            if not given:
                raise SweepError(
                    f"sweep.{key} is empty: give at least one value, e.g. --sweep.{key}="
                    f"{'42,43' if key == 'seed' else '1e-3,3e-3'}."
                )
            self.kinds[key] = _kind(config, key)
            converted = [_convert(key, v, key == "seed") for v in given]
            if len(set(converted)) != len(converted):
                raise SweepError(f"sweep.{key} repeats a value ({given}): give each once.")
            self.values[key] = converted
        self.shard = (0, 1)

    @property
    def traced_keys(self) -> list[str]:
        return [k for k, kind in self.kinds.items() if kind == "traced"]

    @property
    def count(self) -> int:
        """The number of replicas (without making them)."""
        index, count = self.shard
        return len(range(index, math.prod(len(v) for v in self.values.values()), count))

    def sliced(self, index: int, count: int) -> Grid:
        """Slice ``index`` of ``count`` (``--sweep.shard=index/count``): replicas ``index``,
        ``index + count``, ... of the grid with its keys and their values sorted, so that jobs
        given the same grid in another order of flags or values hold the same slices."""
        total = math.prod(len(v) for v in self.values.values())
        if not 0 <= index < count:
            raise SweepError(
                f"--sweep.shard={index}/{count}: the slice index is 0 to {count - 1} "
                f"(--sweep.shard=i/n: job i of n)."
            )
        if index >= total:
            raise SweepError(
                f"--sweep.shard={index}/{count} lies outside the grid of {total} replicas (job "
                f"{index} would hold none): use at most {total} jobs, --sweep.shard=i/{total}."
            )
        grid = copy.copy(self)
        grid.shard = (index, count)
        return grid

    def reordered(self, keys: Sequence[str]) -> Grid:
        """The same grid with its keys in the order ``keys`` (the same set of keys): the order
        of the replicas and of the parts of their folder names."""
        grid = copy.copy(self)
        grid.values = {key: self.values[key] for key in keys}
        grid.kinds = {key: self.kinds[key] for key in keys}
        return grid

    def samples(self) -> list[dict[str, int | float]]:
        """The first replica and, per key, the replicas with its smallest and largest value (the
        others at their first): what checking every value against the config's ranges needs,
        in at most ``1 + 2 * keys`` replicas rather than their product."""
        first = {key: values[0] for key, values in self.values.items()}
        out = [first]
        for key, values in self.values.items():
            for value in (min(values), max(values)):
                if value != first[key] and {**first, key: value} not in out:
                    out.append({**first, key: value})
        return out

    def replicas(self) -> list[dict[str, int | float]]:
        """One ``{key: value}`` per replica (the product of the value lists; of a slice, its
        replicas in that order)."""
        keys = list(self.values)
        combos = itertools.product(*self.values.values())
        replicas = [dict(zip(keys, combo, strict=True)) for combo in combos]
        index, count = self.shard
        if count == 1:
            return replicas
        ordered = sorted(keys)
        canonical = itertools.product(*(sorted(self.values[key]) for key in ordered))
        held = {tuple(combo) for combo in itertools.islice(canonical, index, None, count)}
        return [r for r in replicas if tuple(r[key] for key in ordered) in held]

    def replica_config(self, values: Mapping[str, Any]) -> ml_collections.ConfigDict:
        """The base config with a replica's values: the config of its single run."""
        config = copy.deepcopy(self.config)
        for key, value in values.items():
            set_key(config, key, value)
        return config

    def to_dict(self) -> dict[str, list[int | float]]:
        return {k: list(v) for k, v in self.values.items()}


def replica_name(values: Mapping[str, Any]) -> str:
    """The folder name of a replica: ``key=value`` pairs joined by commas."""
    return ",".join(f"{key}={value!r}" for key, value in values.items())


def parse_shard(text: str) -> tuple[int, int]:
    """``--sweep.shard=i/n``'s ``(i, n)``: job ``i`` of ``n`` independent jobs of one grid."""
    index, slash, count = text.partition("/")
    if not (slash and index.strip().isdigit() and count.strip().isdigit() and int(count) >= 1):
        raise SweepError(
            f"--sweep.shard={text}: give the job's slice as i/n, job i of n jobs (0 <= i < n), "
            "e.g. --sweep.shard=0/4."
        )
    return int(index), int(count)


def parse_devices_per_replica(text: str) -> int:
    """``--sweep.devices_per_replica=k``: a count of devices >= 1."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise SweepError(
            f"--sweep.devices_per_replica={text}: give the devices that run one replica's "
            "clients, a whole number >= 1 (e.g. --sweep.devices_per_replica=2)."
        )
    return count


def parse_sweep_argv(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Splits ``--sweep.KEY=VALUES`` arguments from ``argv``.

    Returns:
      ``(the other arguments, {KEY: "VALUES"})``.
    """
    rest, grid = [], {}
    for arg in argv:
        if arg.startswith("--sweep."):
            key, eq, value = arg[len("--sweep.") :].partition("=")
            if not eq:
                raise SweepError(f"{arg}: give the values after '=', e.g. --sweep.{key}=1e-3,3e-3.")
            grid[key] = value
        else:
            rest.append(arg)
    return rest, grid


def config_section(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The grid a config file declares in its ``sweep`` section (dotted keys), or ``{}``."""
    section = config.get("sweep")
    if section is None:
        return {}

    def flatten(node, prefix):
        out = {}
        for name, value in node.items():
            if hasattr(value, "items"):
                out.update(flatten(value, f"{prefix}{name}."))
            else:
                out[f"{prefix}{name}"] = value
        return out

    return flatten(section, "")
