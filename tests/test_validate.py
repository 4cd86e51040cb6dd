"""Config validation (``fedorth.train.validate``): unknown names list the valid choices,
out-of-range values name the field, the value and the valid range; every problem is reported at
once, before anything is loaded or compiled; unknown keys and another model on the command line.
The cases and their messages (docs/ERRORS.md's table) are tests/reliability_helpers.py's.
"""

from __future__ import annotations

import subprocess

import pytest
from reliability_helpers import (
    BAD_CONFIGS,
    CLI_TYPO,
    LAPACK_THREADS,
    REGISTRIES,
    REPO,
    assert_documented,
    cli,
    config_error,
    lapack_threads_message,
    soap_config,
    tiny_config,
    typo_key_message,
)

from configs import fedpac_soap
from fedorth import train
from fedorth.train import builders, validate


@pytest.mark.parametrize(("overrides", "expected"), BAD_CONFIGS, ids=lambda x: str(x)[:40])
def test_bad_config_is_rejected_with_field_value_and_valid_range(overrides, expected):
    message = config_error(overrides)
    assert message.startswith("Invalid config:\n  "), message
    expected = expected.format(**REGISTRIES)
    assert expected in message, f"expected {expected!r} in:\n{message}"
    assert len(message.splitlines()) == 2, f"one problem, one line:\n{message}"


def test_a_bad_lapack_thread_count_is_a_config_problem(tmp_path):
    """FEDORTH_LAPACK_THREADS is read when the round is lowered; the run checks it with the
    config, so a bad value is one line before anything is loaded or compiled."""
    message = lapack_threads_message()
    assert message.splitlines()[1:] == [
        "  FEDORTH_LAPACK_THREADS='many' must be a thread count >= 1 or 'auto' (the cores "
        "divided by the round's CPU devices)."
    ], message
    assert_documented(LAPACK_THREADS, message, tmp_path)


def test_every_problem_is_reported_at_once():
    message = config_error({"fed.rounds": 0, "optim.name": "adam", "eval_every": -1})
    assert len(message.splitlines()) == 4, message


def test_good_configs_pass():
    validate.validate(tiny_config())
    validate.validate(soap_config())
    for preset in ("cifar100_resnet18", "cifar100_vit", "tiny_imagenet_resnet18"):
        validate.validate(fedpac_soap.get_config(preset))


def test_run_validates_before_loading_or_compiling(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("build() ran before the config was validated")

    monkeypatch.setattr(builders, "build", fail)
    with pytest.raises(validate.ConfigError, match=r"fed\.local_steps=0"):
        train.run(tiny_config(**{"fed.local_steps": 0}), tmp_path / "w")
    assert not (tmp_path / "w").exists(), "nothing may be written for an invalid config"


def test_cli_rejects_unknown_config_key(tmp_path):
    out = subprocess.run(
        cli(tmp_path / "w", "--config.fed.typo=1"), cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    expected = typo_key_message(tmp_path / "w")
    assert expected in out.stderr, out.stderr
    assert "config.fed has no key 'typo'" in expected and "'local_steps'" in expected
    assert_documented(CLI_TYPO, expected, tmp_path)


def test_model_name_override_drops_the_files_keys_of_another_model():
    """--config.model.name=cnn on an MLP config: the file's hidden_sizes is dropped (a locked
    config cannot lose keys on the command line); keys given on the command line are kept and
    still checked; without a model.name override nothing changes."""
    config = tiny_config(**{"model.name": "cnn"})
    config.lock()
    assert validate.drop_keys_of_another_model(config, {"model.name": "cnn"}) == [
        "model.hidden_sizes"
    ]
    assert sorted(config.model.keys()) == ["dtype", "name"]  # every model takes dtype
    validate.validate(config)

    config = tiny_config(**{"model.name": "cnn"})
    kept = {"model.name": "cnn", "model.hidden_sizes": (3,)}
    assert validate.drop_keys_of_another_model(config, kept) == []
    assert "model has unknown keys ['hidden_sizes']" in config_error({"model.name": "cnn"})

    config = tiny_config()
    assert validate.drop_keys_of_another_model(config, {"fed.rounds": 2}) == []
    assert validate.drop_keys_of_another_model(config, {"model.name": "mlp"}) == []
    assert config.model.hidden_sizes == (16,)


def test_cli_model_name_override_switches_the_model(tmp_path):
    # fed.rounds=0 stops at validation: it shows which model keys survive without a run.
    args = ["--config.model.name=cnn", "--config.fed.rounds=0"]
    out = subprocess.run(cli(tmp_path / "w", *args), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "the config file's ['model.hidden_sizes'] are not arguments" in out.stderr, out.stderr
    assert "fed.rounds=0 is out of range" in out.stderr and "unknown keys" not in out.stderr
    args = [*args, "--config.model.hidden_sizes=3"]
    out = subprocess.run(cli(tmp_path / "w", *args), cwd=REPO, capture_output=True, text=True)
    assert "model has unknown keys ['hidden_sizes']" in out.stderr, out.stderr
