"""Configs by name or path (``--config``) and ``python -m experiments.main --list``.

Everything is read from the registries (``fed.ALGORITHMS``, ``models.MODELS``,
``data.DATASETS``, ``fed.local.DIRECTIONS``) and the ``configs`` package, so the listing cannot
drift from the code; only the optimizers' and datasets' sources are written here.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import pathlib
import re
import sys
import textwrap
import types
from collections.abc import Sequence
from typing import Any

_ROOT = pathlib.Path(__file__).resolve().parent.parent  # site-packages, or the source tree

NOT_CONFIGS = ("__init__", "base", "presets")
"""Files of the ``configs`` package that are not configs (shared defaults and settings)."""


def shipped_package(name: str) -> types.ModuleType:
    """The top-level package ``name`` (``configs`` or ``experiments``) shipped with fedorth.

    The wheel installs ``configs`` and ``experiments`` beside ``fedorth`` (and a source tree
    holds them beside it too). ``import configs`` from a directory with its own ``configs/``
    would find that folder first (Python puts the current directory first on ``sys.path`` for
    ``python -m``); this binds ``sys.modules[name]`` to the shipped package instead, so that the
    configs' own ``from configs import base`` resolve to it as well.

    Raises:
      ModuleNotFoundError: no such package beside ``fedorth`` (an installation without it).
    """
    folder = _ROOT / name
    module = sys.modules.get(name)
    if module is not None and folder in {
        pathlib.Path(entry).resolve() for entry in getattr(module, "__path__", [])
    }:
        return module
    init = folder / "__init__.py"
    if not init.is_file():
        raise ModuleNotFoundError(f"fedorth's {name!r} package is not installed beside it ({init})")
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]  # another folder of that name, imported first
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def config_dir() -> pathlib.Path:
    """The folder of the ``configs`` package shipped with fedorth (installed beside it, or the
    source tree's), whatever the current directory holds: a user's own ``configs/`` folder does
    not hide it (:func:`shipped_package`)."""
    return pathlib.Path(shipped_package("configs").__file__).parent


def config_names() -> list[str]:
    """The names ``--config`` accepts (the config files of the ``configs`` package)."""
    return sorted(
        p.stem
        for p in config_dir().glob("*.py")
        if p.stem not in NOT_CONFIGS and "def get_config(arg" in p.read_text()
    )


class ConfigArgumentError(ValueError):
    """``--config`` names no config file, a file that is not a config, or an unknown preset."""


def resolve_config(spec: str) -> str:
    """``--config``'s value with its file resolved: a name or a path, then ``[:preset]``.

    Args:
      spec: ``NAME``, ``NAME:preset``, ``PATH`` or ``PATH:preset``.

    Returns:
      ``PATH[:preset]`` with an existing path.

    Raises:
      ConfigArgumentError: no such config, a file that is not a config (``configs/base.py``), or
        a preset the config does not have; one line saying what is valid.
    """
    where, sep, preset = spec.partition(":")
    path = pathlib.Path(where).expanduser()
    directory = config_dir()
    candidates = [path]
    if path.suffix != ".py" and len(path.parts) == 1:
        candidates.append(directory / f"{where}.py")  # a name
    if path.suffix == ".py" and path.parent.name == "configs":
        candidates.append(directory / path.name)  # configs/x.py from another directory
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise ConfigArgumentError(
            f"--config={spec}: no config file {where!r} (looked for "
            f"{', '.join(str(p) for p in candidates)}). Configs: {', '.join(config_names())} "
            "(python -m experiments.main --list)."
        )
    module = None
    if not (found.parent.resolve() == directory.resolve() and found.stem in NOT_CONFIGS):
        _add_config_root(found)
        module = load_config_module(found)
    if not is_config(module):
        raise ConfigArgumentError(
            f"--config={spec}: {found} is not a config (no get_config(arg=None); configs/base.py "
            "holds the defaults every config shares, configs/presets.py the papers' settings). "
            f"Configs: {', '.join(config_names())}."
        )
    presets = presets_of(module)
    if preset and presets is not None and preset not in presets:
        raise ConfigArgumentError(
            f"--config={spec}: config {found.stem!r} has no preset {preset!r}; its presets: "
            f"{', '.join(sorted(presets)) or '(none)'} (or none: the CPU default)."
        )
    return str(found) + sep + preset


def presets_of(module) -> list[str] | None:
    """The preset names of config ``module`` (None where it does not declare them): its
    ``PRESETS``, or those of the shared settings module it delegates to (the minimax configs
    take configs/minimax_auc.py's)."""
    presets = getattr(module, "PRESETS", None)
    if presets is None:
        shared = [
            value
            for value in vars(module).values()
            if inspect.ismodule(value)
            and value.__name__.startswith("configs.")
            and not is_config(value)
            and getattr(value, "PRESETS", None) is not None
        ]
        if len(shared) == 1:
            presets = shared[0].PRESETS
    return None if presets is None else sorted(presets)


def load_config_module(path: pathlib.Path):
    """The module of config file ``path`` (loaded by path, as ``config_flags`` does)."""
    spec = importlib.util.spec_from_file_location(f"_fedorth_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a syntax error, a NameError at the file's top level
        from fedorth.train.validate import config_file_error

        raise ConfigArgumentError(
            config_file_error(str(path), error) or f"--config={path}: {error!r}"
        ) from None
    return module


def is_config(module) -> bool:
    """Whether ``module`` is a config: a ``get_config`` callable with at most one argument."""
    fn = getattr(module, "get_config", None)
    if not callable(fn):
        return False
    required = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return len(required) <= 1


def _add_config_root(path: pathlib.Path) -> None:
    """Lets a user's config file in a folder of their own named ``configs`` import both the
    shipped modules (``from configs import base, presets``) and its neighbours: the folder joins
    the shipped package's search path, after the shipped files."""
    shipped = config_dir()
    package = sys.modules["configs"]
    folder = str(path.parent.resolve())
    if path.parent.name == "configs" and path.parent.resolve() != shipped.resolve():
        if folder not in package.__path__:
            package.__path__.append(folder)


def resolve_config_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``--config=NAME[:preset]`` (or ``--config NAME``) resolved to a path."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            out[i] = "--config=" + resolve_config(arg[len("--config=") :])
        elif arg == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1])
    return out


def apply_switches(config, overrides: dict[str, Any], spec: str) -> list[str]:
    """Applies the command line's switches of model, optimizer and algorithm to ``config``.

    ``fedorth.train.validate.drop_foreign_keys`` drops the config file's keys the new choice
    does not take. A learning rate is tuned for one optimizer, so when ``--config.optim.name``
    changes the file's optimizer and ``--config.optim.learning_rate`` is not typed, the learning
    rate becomes the new optimizer's for the same setting: the one its ``local_NAME`` config
    gives the same preset (the papers' rates; without a preset, the embedded default's).

    Args:
      config: the parsed, locked config; changed in place.
      overrides: the ``--config.*`` values (``config_flags.get_override_values``).
      spec: the resolved ``--config`` value, ``PATH[:preset]``.

    Returns:
      The ``note:`` lines to print.

    Raises:
      ConfigArgumentError: the optimizer changed, its learning rate was not typed, and no
        ``local_NAME`` config has the preset: one line asking for
        ``--config.optim.learning_rate``.
    """
    from fedorth.train import validate

    dropped = validate.drop_foreign_keys(config, overrides)
    notes = validate.switch_notes(config, dropped)
    from fedorth.fed import local

    new = overrides.get("optim.name")
    if new not in local.DIRECTIONS or "optim.learning_rate" in overrides or "optim" not in config:
        return notes  # no switch, a typed rate, or an unknown name (validate names the valid)
    path, _, preset = spec.partition(":")
    file_config = load_config_module(pathlib.Path(path)).get_config(preset or None)
    old, rate = file_config.optim.get("name"), file_config.optim.get("learning_rate")
    if new == old or rate is None:
        return notes
    source = config_dir() / f"local_{new}.py"
    module = load_config_module(source) if source.is_file() else None
    if module is None or (preset and preset not in (presets_of(module) or [])):
        raise ConfigArgumentError(
            f"--config.optim.name={new}: optim.learning_rate={rate} is the config file's rate "
            f"for {old}, and no config gives {new}'s rate for "
            f"{'preset ' + repr(preset) if preset else 'this setting'}: pass "
            "--config.optim.learning_rate=VALUE."
        )
    config.optim.learning_rate = module.get_config(preset or None).optim.learning_rate
    notes.append(
        f"note: --config.optim.name={new}: optim.learning_rate={rate} was the config file's rate "
        f"for {old}; using {config.optim.learning_rate}, {new}'s rate for "
        f"{'preset ' + repr(preset) if preset else 'this setting'} (configs/{source.name}). "
        "Pass --config.optim.learning_rate to choose another."
    )
    return notes


# The local optimizers' own papers (fedorth.fed.local.DIRECTIONS).
OPTIMIZER_PAPERS = {
    "sgd": "SGD, heavy-ball or Nesterov momentum",
    "adamw": "AdamW (Loshchilov & Hutter 2019), decoupled weight decay",
    "muon": "Muon (Jordan et al. 2024); FedMuon (Liu et al.) Alg. 2, FedPAC (Liu et al.) Alg. 6-7",
    "soap": "SOAP (Vyas et al. 2024); FedPAC (Liu et al.) Alg. 4-5",
    "sophia": "Sophia (Liu et al. 2023); FedPAC (Liu et al.) Alg. 8-9",
    "lmo": "LMO steps (spectral, Frobenius, sign); FedMuon-LMO (bias-corrected LMO) Alg. 1-2",
}

# Where each dataset comes from (fedorth.data.DATASETS); the configs using it are listed too.
DATASET_SOURCES = {
    "digits": "scikit-learn's 8x8 digits, embedded (no download): every config's CPU default",
    "synthetic": "synthetic Gaussian classes, embedded (no download)",
    "zipf_sentiment": "Zipf-distributed sentiment task, generated (no download)",
    "mnist": "MNIST (TFDS)",
    "fashion_mnist": "Fashion-MNIST (TFDS)",
    "cifar10": "CIFAR-10 (TFDS)",
    "cifar100": "CIFAR-100 (TFDS)",
    "glue/sst2": "GLUE SST-2 (TFDS)",
    "sentiment140": "Sentiment140 (TFDS)",
    "yelp_polarity_reviews": "Yelp polarity reviews (TFDS)",
    "c4": "C4 en (TFDS), byte tokens",
    "tiny_imagenet": "Tiny ImageNet 200 (the extracted tiny-imagenet-200/ folder)",
    "emnist": "EMNIST-62 by writer, 3,400 clients (TFF's .h5 or FedJAX's .sqlite)",
    "shakespeare": "Shakespeare next character by role, 715 clients (TFF .h5, FedJAX .sqlite)",
    "stackoverflow": "StackOverflow next word by user, 342,477 clients (TFF .h5, FedJAX .sqlite)",
    "stackoverflow_tags": "StackOverflow tags from a bag of words by user, the same files",
    "cifar100_pachinko": "CIFAR-100 by Pachinko allocation, 500 clients (TFF .h5, FedJAX .sqlite)",
    "parquet": "parquet files with a client column (flwr-datasets, Hugging Face hub)",
}


def apply_command_line_switches(config, config_flag) -> None:
    """:func:`apply_switches` with the overrides of a ``--config`` flag (``flags.FLAGS["config"]``).

    Prints each note; a refused switch prints its one line and exits with code 2.
    """
    from ml_collections import config_flags

    overrides = config_flags.get_override_values(config_flag)
    spec = config_flags.get_config_filename(config_flag)
    try:
        notes = apply_switches(config, overrides, spec)
    except ConfigArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for note in notes:
        print(note, file=sys.stderr)


def _first_line(obj: Any) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return " ".join(doc.split("\n\n")[0].split()) if doc else ""


def configs(config_dir: pathlib.Path) -> list[dict[str, Any]]:
    """One dict per config file: name, algorithm, optimizer, server optimizer (or None),
    dataset, description and presets."""
    out = []
    for path in sorted(config_dir.glob("*.py")):
        if path.stem in NOT_CONFIGS:
            continue
        module = load_config_module(path)
        if not is_config(module):
            continue
        config = module.get_config()
        presets = presets_of(module) or []
        datasets = {config.data.name}
        for preset in presets:
            datasets.add(module.get_config(preset).data.name)
        out.append(
            {
                "name": path.stem,
                "algorithm": config.fed.algorithm,
                "optimizer": config.optim.name,
                "server_opt": config.fed.get("options", {}).get("server_opt"),
                "about": _first_line(module),
                "presets": presets,
                "datasets": sorted(datasets),
            }
        )
    return out


def _algorithm_paper(name: str, optim: dict[str, Any] | None) -> str:
    from fedorth import fed

    tries = [optim] if optim else []
    tries += [{"name": n} for n in ("sgd", "muon", "soap", "sophia", "adamw", "lmo")]
    for optim_ in tries:
        try:
            return fed.get_algorithm(name, optim_).paper
        except (ValueError, TypeError, KeyError):
            continue
    return ""


# The papers' tables and figures, by preset name (configs/presets.py builds the names); the
# first pattern that matches a preset names its group in --list.
PRESET_GROUPS = (
    (r"(cifar100|tiny_imagenet)_(resnet18|vit)(_dir0\.05)?$", "FedPAC (Liu et al.) Table 1"),
    (r"(cifar100|tiny_imagenet)_(resnet18|vit)_(dir0\.5|iid)$", "FedPAC (Liu et al.) Tables 12-13"),
    (r"vit_base_", "FedPAC (Liu et al.) Table 2, fine-tuning"),
    (r"c4_llama", "FedPAC (Liu et al.) Table 3"),
    (r"fedmuon_liu_cifar100_", "FedMuon (Liu et al.) Table 2"),
    (r"fedmuon_liu_fig4_", "FedMuon (Liu et al.) Fig. 4"),
    (r"fedmuon_liu_table5_", "FedMuon (Liu et al.) Table 5"),
    (r"fedmuon_liu_table6_", "FedMuon (Liu et al.) Table 6"),
    (r"fedmuon_liu_table7_", "FedMuon (Liu et al.) Table 7"),
    (r"swin_t_", "FedMuon (Liu et al.) Table 3, fine-tuning"),
    (r"roberta_lora_", "FedMuon (Liu et al.) Table 4, fine-tuning"),
    (r"fedmuon_lmo_", "FedMuon-LMO (bias-corrected LMO) Sec. 7.1, App. G"),
    (r"fedmuon_zg_", "FedMuon (Zhang & Gao) Sec. 7"),
    (r"(sentiment140|sst2|yelp)_(homo|hetero)_p\d+$", "Fed minimax (Zhang & Gao) Sec. 5"),
    (r"muon_reference$", "Muon (Jordan et al.)'s own step, on the embedded data"),
    (r"reddi_", "Reddi et al. 2021, natural clients"),
)
OTHER_PRESETS = "other settings"  # tests/test_cli.py asks for a group for every preset


def preset_groups(presets: list[str]) -> dict[str, list[str]]:
    """``presets`` grouped by the paper and table they reproduce (:data:`PRESET_GROUPS`), in
    that order; presets no pattern matches go to :data:`OTHER_PRESETS`, last."""
    groups: dict[str, list[str]] = {title: [] for _, title in PRESET_GROUPS}
    groups[OTHER_PRESETS] = []
    for preset in presets:
        title = next((t for pattern, t in PRESET_GROUPS if re.match(pattern, preset)), None)
        groups[title or OTHER_PRESETS].append(preset)
    return {title: names for title, names in groups.items() if names}


WIDTH = 100  # --list's line width
_INDENT = " " * 25  # under a name column of 22 characters


def _wrapped(first: str, text: str, indent: str = _INDENT) -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )


def listing(config_dir: pathlib.Path) -> str:
    """The text ``--list`` prints."""
    from fedorth import data, fed, models
    from fedorth.fed import local

    found = configs(config_dir)
    optim_of = {}
    for c in found:
        optim_of.setdefault(c["algorithm"], {"name": c["optimizer"]})
    lines = ["Algorithms (--config.fed.algorithm; fedorth.fed.ALGORITHMS):"]
    for name in sorted(fed.ALGORITHMS):
        paper = _algorithm_paper(name, optim_of.get(name))
        lines += _wrapped(f"  {name:22s} ", paper) or [f"  {name}"]
    lines.append("")
    lines.append("Configs (--config=NAME or --config=NAME:PRESET; the configs package):")
    for c in found:
        lines += _wrapped(
            f"  {c['name']:22s} ",
            f"fed.algorithm={c['algorithm']} optim.name={c['optimizer']}"
            + (f" fed.options.server_opt={c['server_opt']}" if c["server_opt"] else "")
            + f": {c['about']}",
        )
        lines += _wrapped(_INDENT, f"datasets: {', '.join(c['datasets'])}")
        for title, names in preset_groups(c["presets"]).items():
            lines += _wrapped(_INDENT, f"presets, {title}: {', '.join(names)}", _INDENT + "  ")
    lines.append("")
    lines.append("Models (--config.model.name; fedorth.models.MODELS):")
    for name, fn in models.MODELS.items():
        lines += _wrapped(f"  {name:22s} ", _first_line(fn)) or [f"  {name}"]
    lines.append("")
    lines.append("Datasets (--config.data.name; fedorth.data.DATASETS):")
    users: dict[str, list[str]] = {}
    for c in found:
        for d in c["datasets"]:
            users.setdefault(d, []).append(c["name"])
    for name in data.DATASETS:
        used = users.get(name, [])
        shown = ", ".join(used[:4]) + (f" and {len(used) - 4} more" if len(used) > 4 else "")
        lines += _wrapped(
            f"  {name:22s} ",
            DATASET_SOURCES.get(name, _first_line(data.DATASETS[name]))
            + (f"; configs: {shown}" if used else ""),
        )
    lines.append("")
    lines.append("Optimizers (--config.optim.name; fedorth.fed.local.DIRECTIONS):")
    for name in local.DIRECTIONS:
        lines += _wrapped(f"  {name:22s} ", OPTIMIZER_PAPERS.get(name, "")) or [f"  {name}"]
        lines += _wrapped(_INDENT, f"keys: {', '.join(local.direction_keywords(name))}")
    lines.append("")
    lines.append("Papers: docs/PAPERS.md.")
    return "\n".join(lines)


def _config_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def print_config(name: str, overrides_argv: Sequence[str]) -> int:
    """Prints the config ``--config=name`` with ``overrides_argv`` (``--config.KEY=VALUE``)
    gives a run, as JSON (what the run's ``config.json`` would hold), after the switches and the
    validation; the switches' notes go to stderr. Returns the exit code (2: a one-line error)."""
    from absl import flags
    from ml_collections import config_flags

    try:
        spec = resolve_config(name)
    except ConfigArgumentError as e:
        return _config_error(str(e))
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", lock_config=True, flag_values=values)
    command = ["fedorth config", f"--config={spec}", *list(overrides_argv)]
    try:
        values(command)
    except flags.Error as e:
        return _config_error(str(e))
    except Exception as e:  # the config file's get_config, or an override
        from fedorth.train import validate

        message = validate.config_file_error(spec, e)
        if message is None and isinstance(e, AttributeError | KeyError):
            message = validate.unknown_override_message(command) or f"invalid override: {e!r}"
        if message is None:
            raise
        return _config_error(message)
    from fedorth.train import validate

    config = values.config
    try:
        notes = apply_switches(config, config_flags.get_override_values(values["config"]), spec)
        validate.validate(config)
    except (ConfigArgumentError, validate.ConfigError) as e:
        return _config_error(str(e))
    for note in notes:
        print(note, file=sys.stderr)
    print(json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str))
    return 0
