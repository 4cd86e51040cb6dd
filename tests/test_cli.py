"""The command line of a new user: configs by name or path from any directory, clean one-line
errors, ``--list``, switching the optimizer (and its learning rate) and the algorithm, the
installed ``fedorth`` command, and the Python API's optimizer dict (every key used or rejected,
``learning_rate`` included).

The subprocess tests run ``python -m experiments.main`` from a temporary directory (not the
repository root), with ``PYTHONPATH`` at the repository so that a source checkout behaves like an
installed package, and the installed ``fedorth`` command from a directory holding its own
``configs/`` and ``experiments/`` packages.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from reliability_helpers import CONFIG_ARGUMENTS, assert_documented, config_argument_message

from fedorth import catalog, data, fed, models
from fedorth.fed import local
from fedorth.train import validate

REPO = pathlib.Path(__file__).resolve().parent.parent


def main(
    cwd: pathlib.Path, *args: str, module: str = "experiments.main"
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def soap_config() -> ml_collections.ConfigDict:
    """``fedpac_soap``'s default, locked as the command line's config is."""
    module = catalog.load_config_module(catalog.config_dir() / "fedpac_soap.py")
    config = module.get_config()
    config.lock()
    return config


def config_error(config) -> str:
    with pytest.raises(validate.ConfigError) as info:
        validate.validate(config)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# Switching the optimizer and the algorithm.


def test_optimizer_switch_drops_the_files_keys_and_keeps_typed_ones():
    config = soap_config()
    config.optim.name = "sgd"
    config.fed.algorithm = "fedpac"  # fedpac_soap runs SOAP only; fedpac takes any optimizer
    switch = {"optim.name": "sgd", "fed.algorithm": "fedpac"}
    dropped = validate.drop_foreign_keys(config, switch)
    # fedpac_soap.py sets b1, b2, precondition_frequency (SOAP's); SGD takes momentum/nesterov.
    assert dropped == {"optim.name": ["optim.b1", "optim.b2", "optim.precondition_frequency"]}
    # ns_dtype ("auto", kept by presets.set_optim) is a key every optimizer takes.
    assert sorted(config.optim.keys()) == [
        "learning_rate",
        "name",
        "ns_dtype",
        "schedule",
        "weight_decay",
    ]
    assert config.fed.options.beta == 0.5  # an option of fedpac too: kept
    validate.validate(config)

    config = soap_config()
    config.optim.name = "sgd"
    config.fed.algorithm = "fedpac"
    config.optim.b1 = 0.5
    dropped = validate.drop_foreign_keys(config, {**switch, "optim.b1": 0.5})
    assert dropped == {"optim.name": ["optim.b2", "optim.precondition_frequency"]}
    message = config_error(config)
    assert "optim.name='sgd' does not take optim.b1; its optim keys are [" in message, message
    assert "_sgd" not in message and "()" not in message, "an internal function name leaked"


def test_algorithm_switch_drops_the_files_options_and_keeps_typed_ones():
    config = soap_config()
    config.fed.algorithm = "fedavg"
    # fedpac_soap.py sets fed.options.aligned (FedPAC's Θ-only alignment) and beta.
    assert validate.drop_foreign_keys(config, {"fed.algorithm": "fedavg"}) == {
        "fed.algorithm": ["fed.options.aligned", "fed.options.beta"]
    }
    validate.validate(config)

    config = soap_config()
    config.fed.algorithm = "fedavg"
    kept = {"fed.algorithm": "fedavg", "fed.options.beta": 0.5}
    assert validate.drop_foreign_keys(config, kept) == {"fed.algorithm": ["fed.options.aligned"]}
    message = config_error(config)
    assert "fed.options has unknown keys ['beta']; valid keys: [" in message, message
    assert "()" not in message, "an internal function name leaked"


def test_algorithm_switch_keeps_the_server_optimizer():
    """DiLoCo's outer step on another algorithm (MuLoCo's is Local Muon's): switching
    fed.algorithm keeps fed.options.server_opt and its keys, which every algorithm takes."""
    module = catalog.load_config_module(catalog.config_dir() / "diloco.py")
    config = module.get_config()
    config.lock()
    config.fed.algorithm = "scaffold"
    assert validate.drop_foreign_keys(config, {"fed.algorithm": "scaffold"}) == {}
    assert dict(config.fed.options) == {
        "server_opt": "nesterov",
        "server_lr": 0.7,
        "server_momentum": 0.9,
    }
    validate.validate(config)


def test_no_switch_drops_nothing():
    config = soap_config()
    assert validate.drop_foreign_keys(config, {"fed.rounds": 3, "optim.b1": 0.9}) == {}
    assert config.optim.precondition_frequency == 10 and config.fed.options.beta == 0.5


@pytest.fixture(scope="module")
def switched_beside_a_users_configs(tmp_path_factory) -> subprocess.CompletedProcess:
    """``python -m experiments.main --config=fedpac_soap`` switched to SGD and FedAvg, from a
    user's project holding a ``configs/`` package of its own (``make_user_dir``, without its
    ``experiments/``: ``python -m`` would run the user's); fed.rounds=0 stops it at validation,
    after the switches."""
    user = make_user_dir(tmp_path_factory.mktemp("user"))
    shutil.rmtree(user / "experiments")
    return main(
        user,
        "--config=fedpac_soap",
        f"--workdir={user / 'w'}",
        "--config.optim.name=sgd",
        "--config.fed.algorithm=fedavg",
        "--config.fed.rounds=0",
    )


@pytest.mark.slow
def test_cli_switches_optimizer_and_algorithm_from_another_directory(
    switched_beside_a_users_configs,
):
    # The notes, one error line, exit 2.
    out = switched_beside_a_users_configs
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "note: --config.optim.name=sgd: the config file's ['optim.b1', 'optim.b2', "
        "'optim.precondition_frequency'] are not arguments of that optimizer and were dropped.",
        "note: --config.fed.algorithm=fedavg: the config file's ['fed.options.aligned', "
        "'fed.options.beta'] are not arguments of it and were dropped.",
        "note: --config.optim.name=sgd: optim.learning_rate=0.003 was the config file's rate for "
        "soap; using 0.1, sgd's rate for this setting (configs/local_sgd.py). Pass "
        "--config.optim.learning_rate to choose another.",
        "error: Invalid config:",
        "  fed.rounds=0 is out of range; valid: an integer >= 1.",
    ], out.stderr


# ---------------------------------------------------------------------------------------------
# The Python API: the optimizer dict.


def test_optimizer_dict_rejects_keys_of_another_optimizer_by_their_config_names():
    with pytest.raises(ValueError) as info:
        fed.get_algorithm("fedavg", {"name": "sgd", "b1": 0.9})
    assert str(info.value).startswith("optim.name='sgd' does not take optim.b1; its optim keys")
    with pytest.raises(ValueError, match=r"it does not take fed.options.gamma"):
        fed.get_algorithm("fedavg", {"name": "sgd"}, gamma=1.0)


def _one_round(optim: dict, learning_rate: float):
    data_ = {
        "H": np.eye(2)[None] * 1.0,
        "B": np.array([[[1.0], [2.0]]]),
        "c": np.zeros((1, 1)),
    }
    alg = fed.get_algorithm("fedavg", optim)
    config = fed.RoundConfig(
        num_clients=1, clients_per_round=1, local_steps=1, learning_rate=learning_rate
    )
    round_fn = fed.make_round_fn(
        alg,
        lambda p, s, b, k: (
            0.5 * jnp.sum((p["w"] - b["B"]) * (b["H"] @ (p["w"] - b["B"]))),
            (s, {}),
        ),
        lambda d, i, k: jax.tree.map(lambda x: x[i], d),
        config,
    )
    server = fed.init_server(
        alg, {"w": jnp.zeros((2, 1))}, {}, num_clients=1, key=jax.random.key(0)
    )
    server, _ = round_fn(server, jax.tree.map(jnp.asarray, data_))
    return np.asarray(server.params["w"])


def test_learning_rate_of_the_optimizer_dict_is_used_or_rejected():
    optim = {"name": "sgd", "learning_rate": 100.0}
    # A contradicting RoundConfig.learning_rate: refused, naming both.
    with pytest.raises(ValueError) as info:
        _one_round(optim, 1e-3)
    message = str(info.value)
    assert "{'learning_rate': 100.0}" in message and "RoundConfig.learning_rate=0.001" in message
    # The same learning rate: one SGD step from w = 0 on 0.5 |w - B|^2 is w = 0 - 100 (0 - B).
    w = _one_round(optim, 100.0)
    np.testing.assert_allclose(w, 100.0 * np.array([[1.0], [2.0]]), rtol=1e-6)
    # A schedule in the dict with a constant RoundConfig learning rate: refused too.
    with pytest.raises(ValueError, match="the round's learning rate is RoundConfig.learning_rate"):
        _one_round({"name": "sgd", "learning_rate": 0.1, "schedule": "cosine"}, 0.1)


# ---------------------------------------------------------------------------------------------
# Configs by name or path, from any directory; clean one-line errors.


def test_config_by_name_and_by_path_resolve_to_the_package_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = str(catalog.config_dir() / "fedpac_soap.py")
    assert catalog.resolve_config("fedpac_soap") == expected
    assert catalog.resolve_config("configs/fedpac_soap.py") == expected
    assert catalog.resolve_config("fedpac_soap:cifar100_vit") == expected + ":cifar100_vit"
    assert catalog.resolve_config(expected) == expected


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("configs/nope.py", "--config=configs/nope.py: no config file 'configs/nope.py'"),
        ("nope", "--config=nope: no config file 'nope'"),
        ("configs/base.py", "base.py is not a config (no get_config(arg=None);"),
        ("presets", "presets.py is not a config"),
        ("minimax_auc", "minimax_auc.py is not a config"),
        (
            "fedpac_soap:nope",
            "config 'fedpac_soap' has no preset 'nope'; its presets: c4_llama130m",
        ),
        (  # the minimax configs' presets live in configs/minimax_auc.py
            "fed_nsgda_m:sst2_homo_p5",
            "config 'fed_nsgda_m' has no preset 'sst2_homo_p5'; its presets: sentiment140_",
        ),
    ],
)
def test_bad_config_argument_is_one_line(spec, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(catalog.ConfigArgumentError) as info:
        catalog.resolve_config(spec)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "spec", ["configs/nope.py", "configs/base.py", "fedpac_soap:nope", "fedmuon_da:yelp_p4"]
)
def test_cli_bad_config_argument_is_one_clean_line_exit_2(spec, tmp_path, monkeypatch):
    """Answered before fedorth and JAX load (about 1 s of the process's time)."""
    out = main(tmp_path, f"--config={spec}", f"--workdir={tmp_path / 'w'}")
    assert out.returncode == 2, out.stderr
    monkeypatch.chdir(tmp_path)
    with pytest.raises(catalog.ConfigArgumentError) as info:
        catalog.resolve_config(spec)
    assert out.stderr.splitlines() == [f"error: {info.value}"], out.stderr


def test_config_argument_errors_are_documented(tmp_path):
    for description, spec in CONFIG_ARGUMENTS.items():
        assert_documented(description, config_argument_message(spec), tmp_path)


def test_configs_are_a_package_listed_in_setup_cfg():
    """The wheel carries the configs (``import configs.presets`` works when installed)."""
    import configparser

    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    assert "configs" in setup["options.packages.find"]["include"].split()
    assert (REPO / "configs" / "__init__.py").is_file()


@pytest.mark.slow
def test_cli_list_names_every_algorithm_config_model_dataset_and_optimizer(tmp_path):
    out = main(tmp_path, "--list")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    sections = [
        "Algorithms (",
        "Configs (",
        "Models (",
        "Datasets (",
        "Optimizers (",
    ]
    assert all(s in text for s in sections), text[:500]
    names = {
        line.split()[0] for line in text.splitlines() if line.startswith("  ") and line[2] != " "
    }
    expected = {
        *fed.ALGORITHMS,
        *catalog.config_names(),
        *models.MODELS,
        *data.DATASETS,
        *local.DIRECTIONS,
    }
    assert expected <= names, sorted(expected - names)
    assert len(catalog.config_names()) >= 40
    assert max(map(len, text.splitlines())) <= catalog.WIDTH, "a line is not wrapped"
    # Every preset of every config, under its config and in its paper's group.
    blocks = re.split(r"\n  (?=\S)", text.split("\nConfigs (")[1].split("\n\nModels (")[0])
    listed = {block.split()[0]: block for block in blocks[1:]}
    assert sorted(listed) == catalog.config_names()
    directory = catalog.config_dir()
    for name in catalog.config_names():
        presets = catalog.presets_of(catalog.load_config_module(directory / f"{name}.py")) or []
        words = set(re.findall(r"[\w.]+", listed[name]))
        assert not set(presets) - words, (name, sorted(set(presets) - words))
        groups = catalog.preset_groups(presets)
        assert catalog.OTHER_PRESETS not in groups, (name, groups.get(catalog.OTHER_PRESETS))
        for title in groups:
            assert f"presets, {title}:" in listed[name], (name, title)
    assert (
        "presets, Fed minimax (Zhang & Gao) Sec. 5: sentiment140_hetero_p16,"
        in listed["fed_nsgda_m"]
    )
    assert "FedPAC (Liu et al.) Table 3: c4_llama130m, c4_llama350m, c4_llama60m" in " ".join(
        listed["fedpac_soap"].split()
    )
    assert not re.search(r"\bthe seeds?\b|\b00\d\b", text, re.I), "the papers by name"


# ---------------------------------------------------------------------------------------------
# The installed `fedorth` command, from a directory holding its own configs/ and experiments/.


def fedorth_command() -> str:
    beside = pathlib.Path(sys.executable).parent / "fedorth"
    found = str(beside) if beside.is_file() else shutil.which("fedorth")
    if found is None:
        pytest.skip("the fedorth command is not installed (pip install -e .)")
    return found


def make_user_dir(folder: pathlib.Path) -> pathlib.Path:
    """A user's project in ``folder``: packages named configs and experiments of its own, and a
    config of its own that imports the shipped configs.base and a neighbour."""
    for package in ("configs", "experiments"):
        (folder / package).mkdir()
        (folder / package / "__init__.py").write_text("")
    (folder / "configs" / "lab.py").write_text("ROUNDS = 3\n")
    (folder / "configs" / "mine.py").write_text(
        "from configs import base, lab\n\n\ndef get_config(arg=None):\n"
        "    config = base.get_base_config()\n    config.fed.rounds = lab.ROUNDS\n"
        "    return config\n"
    )
    return folder


@pytest.fixture
def user_dir(tmp_path) -> pathlib.Path:
    return make_user_dir(tmp_path)


def fedorth(cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [fedorth_command(), *args]
    return subprocess.run(
        command, cwd=cwd, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


@pytest.mark.slow  # four processes, three of them 3-8 s each (JAX's import)
def test_fedorth_command_finds_the_shipped_configs_beside_a_users_folders(user_dir):
    out = fedorth(user_dir, "--help")
    assert out.returncode == 0 and "commands:" in out.stdout, out.stderr
    for command in ("run", "list", "config", "sweep", "report", "prepare"):
        assert f"\n  {command} " in out.stdout, command
    # `config` prints what config.json would hold; `run` resolves the same file and stops at
    # validation (fed.rounds=0) before compiling anything.
    out = fedorth(user_dir, "config", "fedpac_soap:cifar100_resnet18")
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    shipped = catalog.load_config_module(catalog.config_dir() / "fedpac_soap.py")
    assert printed == json.loads(
        json.dumps(shipped.get_config("cifar100_resnet18").to_dict(), default=str)
    )
    out = fedorth(
        user_dir, "run", "--config=fedpac_soap", f"--workdir={user_dir / 'w'}",
        "--config.fed.rounds=0",
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "error: Invalid config:",
        "  fed.rounds=0 is out of range; valid: an integer >= 1.",
    ], out.stderr
    # The user's own config imports the shipped configs.base and its neighbour.
    out = fedorth(user_dir, "config", "configs/mine.py", "--config.seed=7")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["fed"]["rounds"] == 3 and json.loads(out.stdout)["seed"] == 7


@pytest.mark.slow
def test_python_m_experiments_main_beside_a_users_configs_folder(switched_beside_a_users_configs):
    """``python -m experiments.main`` (the documented interface) with a ``configs/`` package in
    the current directory still runs the shipped configs: the switches drop the shipped
    fedpac_soap.py's keys, and its values are validated."""
    out = switched_beside_a_users_configs
    assert out.returncode == 2, out.stderr
    assert "the config file's ['optim.b1', 'optim.b2', 'optim.precondition_frequency']" in (
        out.stderr
    )
    assert out.stderr.splitlines()[-1].startswith("  fed.rounds=0"), out.stderr


# ---------------------------------------------------------------------------------------------
# Switching the optimizer: a learning rate the user did not type follows the optimizer.


def local_rate(optimizer: str, preset: str | None = None) -> float:
    module = catalog.load_config_module(catalog.config_dir() / f"local_{optimizer}.py")
    return module.get_config(preset).optim.learning_rate


def switched(spec: str, overrides: dict) -> tuple[ml_collections.ConfigDict, list[str]]:
    """``spec``'s config with the command line's ``overrides`` and switches applied, as
    ``experiments.main`` and ``fedorth config`` apply them."""
    resolved = catalog.resolve_config(spec)
    path, _, preset = resolved.partition(":")
    config = catalog.load_config_module(pathlib.Path(path)).get_config(preset or None)
    config.lock()
    for key, value in overrides.items():
        *parents, name = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[name] = value
    return config, catalog.apply_switches(config, overrides, resolved)


LMO_REFUSED = (
    "--config.optim.name=lmo: optim.learning_rate=0.1 is the config file's rate for sgd, and no "
    "config gives lmo's rate for this setting: pass --config.optim.learning_rate=VALUE."
)


def test_optimizer_switch_takes_the_rate_of_the_same_preset_keeps_a_typed_one_or_refuses():
    switch = {"fed.algorithm": "fedpac_soap", "optim.name": "soap"}
    # A paper preset: the same paper's SOAP rate for that setting (FedPAC Table 8).
    config, notes = switched("fedavg:cifar100_resnet18", switch)
    assert config.optim.learning_rate == local_rate("soap", "cifar100_resnet18") != 0.1
    assert "soap's rate for preset 'cifar100_resnet18' (configs/local_soap.py)" in notes[-1]
    # A typed rate is kept, without a note.
    config, notes = switched("fedavg", {**switch, "optim.learning_rate": 0.01})
    assert config.optim.learning_rate == 0.01 and not any("learning_rate" in n for n in notes)
    # The same optimizer: nothing to replace.
    config, notes = switched("fedavg", {"optim.name": "sgd"})
    assert config.optim.learning_rate == 0.1 and notes == []
    # No config gives the new optimizer's rate for the setting: refused with the fix.
    with pytest.raises(catalog.ConfigArgumentError) as info:
        switched("fedavg", {"optim.name": "lmo"})
    assert str(info.value) == LMO_REFUSED


@pytest.mark.slow  # two processes, 3-8 s each
def test_optimizer_switch_on_the_command_line(tmp_path):
    """FedAvg's config switched to FedPAC_SOAP runs SOAP at SOAP's rate, with a note
    (``--dry_run`` prints what the run would use, without a --workdir); a refused switch stops
    the run with one line."""
    out = main(
        tmp_path, "--config=fedavg", "--config.fed.algorithm=fedpac_soap",
        "--config.optim.name=soap", "--dry_run",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["optim"]["learning_rate"] == local_rate("soap") == 0.003
    assert out.stderr.splitlines() == [
        "note: --config.optim.name=soap: optim.learning_rate=0.1 was the config file's rate for "
        "sgd; using 0.003, soap's rate for this setting (configs/local_soap.py). Pass "
        "--config.optim.learning_rate to choose another."
    ], out.stderr
    out = main(
        tmp_path, "--config=fedavg", f"--workdir={tmp_path / 'w'}", "--config.optim.name=lmo"
    )
    assert out.returncode == 2 and out.stderr.splitlines() == [f"error: {LMO_REFUSED}"], out.stderr


# ---------------------------------------------------------------------------------------------
# Help, the "Finished" line, the papers credited.


def command(cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """The ``fedorth`` command of this checkout (``fedorth.cli``, what the console script
    runs), in a real process."""
    return main(cwd, *args, module="fedorth.cli")


@pytest.mark.parametrize(
    "name, flags",
    [
        ("run", ["--config", "--workdir", "--overwrite", "--distributed", "--dry_run", "--list"]),
        ("sweep", ["--config", "--workdir", "--overwrite", "--replica_chunk_size"]),
    ],
)
def test_run_and_sweep_help_list_their_flags(tmp_path, name, flags):
    for option in ("--help", "-h"):
        out = command(tmp_path, name, option)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: fedorth {name} --config=NAME[:PRESET]"), out.stdout
        for flag in flags:
            assert f"  {flag}:" in out.stdout or f"  --[no]{flag[2:]}:" in out.stdout, flag
        assert not list(tmp_path.iterdir()), "help writes nothing"


def test_list_help_says_what_list_prints(tmp_path):
    out = command(tmp_path, "list", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: fedorth list\n"), out.stdout
    assert "Takes no arguments." in out.stdout
    out = command(tmp_path, "list", "extra")
    assert out.returncode == 2 and out.stderr.startswith("error: fedorth list takes no arguments")


def test_finished_line_gives_every_path_as_the_workdir_was_typed(tmp_path):
    out = main(
        tmp_path,
        "--config=fedavg",
        "--config.data.num_clients=4",
        "--config.fed.clients_per_round=2",
        "--config.fed.local_steps=1",
        "--config.model.hidden_sizes=8,",
        "--config.fed.rounds=1",
        "--workdir=runs/tiny",
    )
    assert out.returncode == 0, out.stderr
    finished = [line for line in out.stderr.splitlines() if line.startswith("Finished round 1")]
    assert len(finished) == 1, out.stderr
    paths = re.findall(r"(?:in|checkpoint) (\S+?)[,.]?(?=,|\.$| )", finished[0])
    assert paths == [
        "runs/tiny/metrics.jsonl",
        "runs/tiny/curves.png",
        "runs/tiny/tensorboard",
        "runs/tiny/checkpoints/1",
    ], finished[0]


def test_list_credits_each_algorithm_to_the_paper_its_config_cites():
    """The ``--list`` line of an algorithm is its ``paper`` (one place); the config of that
    algorithm cites the same authors and year in its docstring's first line."""
    text = catalog.listing(catalog.config_dir())
    algorithms = text.split("\nConfigs (")[0]
    for config in catalog.configs(catalog.config_dir()):
        cited = re.search(r"([A-Z][A-Za-z-]+ (?:et al\.|& [A-Z][a-z]+) \d{4})", config["about"])
        if cited is None:
            continue
        block = re.search(rf"\n  {config['algorithm']} +(.+(?:\n {{25}}.+)*)", algorithms)
        assert block, config["algorithm"]
        credit = " ".join(block.group(1).split())
        if config["server_opt"]:  # FedYogi, DiLoCo, ...: the server optimizer's paper
            assert f"fed.options.server_opt={config['server_opt']}" in text, config["name"]
            credit = fed.update.SERVER_OPTIMIZER_PAPERS[config["server_opt"]]
        assert cited.group(1) in credit, (config["name"], cited.group(1), credit)
    fedavgm = fed.get_algorithm("fedavgm", {"name": "sgd"}).paper
    assert fedavgm.startswith("Hsu et al. 2019") and "McMahan" not in fedavgm, fedavgm
