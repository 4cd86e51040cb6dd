"""Bad inputs that reach past the config's value checks (files, the data, the config file itself)
end in one line naming the config key, the command-line flag or the file, and the fix; never a
traceback.

Most cases call what ``python -m experiments.main`` calls, ``train.run``, whose errors
(``train.USER_ERRORS``) the command prints as ``error: <message>``; the cases that fail while the
flags are parsed (a broken config file), and one of the others, run the command itself.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import ml_collections
import pytest
from test_reliability import tiny_config

from configs import fedavg
from fedorth import train

ROOT = pathlib.Path(__file__).parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"


def _vit(**model) -> ml_collections.ConfigDict:
    """FedPAC (Liu et al.) Table 2's ViT-B/16 fine-tuning (FedAvg), its checkpoint replaced."""
    config = fedavg.get_config("vit_base_cifar100")
    config.model.update(model)
    return config


def _roberta(tokenizer: str) -> ml_collections.ConfigDict:
    """FedMuon (Liu et al.) Table 4's RoBERTa LoRA fine-tuning on SST-2, on the tiny fixture."""
    config = fedavg.get_config("roberta_lora_sst2")
    config.model.pretrained = str(FIXTURES / "roberta")
    config.data.dataset_kwargs.tokenizer = tokenizer
    return config


def _native_size_vit() -> ml_collections.ConfigDict:
    config = _vit(pretrained=str(FIXTURES / "vit"))
    config.data.image_size = 0  # the data's own 32x32
    return config


def _garbage(tmp: pathlib.Path, name: str, text: str) -> str:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _bare_checkpoint(tmp: pathlib.Path) -> str:
    folder = tmp / "garbage_checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    shutil.copy(FIXTURES / "vit" / "model.safetensors", folder / "model.safetensors")
    return str(folder)


# (id, config from tmp_path, workdir from tmp_path, the key the line names, a phrase of the fix)
CASES = [
    (
        "pretrained_missing",
        lambda tmp: _vit(pretrained=str(tmp / "nowhere")),
        None,
        "model.pretrained=",
        "no such file, folder or cached Hugging Face model",
    ),
    (
        "pretrained_of_another_architecture",
        lambda tmp: _vit(pretrained=str(FIXTURES / "roberta")),
        None,
        "model.pretrained=",
        "is a 'roberta' checkpoint (config.json), but model.name='vit_b16' needs a 'vit' one",
    ),
    (
        "pretrained_garbage_safetensors",
        lambda tmp: _vit(pretrained=_garbage(tmp, "model.safetensors", "garbage")),
        None,
        "model.pretrained=",
        "is not a readable safetensors file",
    ),
    (
        "pretrained_garbage_config_json",
        lambda tmp: _vit(pretrained=_bare_checkpoint(tmp)),
        None,
        "model.pretrained=",
        "is not the checkpoint's JSON config",
    ),
    (
        "tokenizer_missing",
        lambda tmp: _roberta(str(tmp / "tokenizer.json")),
        None,
        "data.dataset_kwargs.tokenizer=",
        "no such file",
    ),
    (
        "tokenizer_garbage",
        lambda tmp: _roberta(_garbage(tmp, "tokenizer.json", "not a tokenizer")),
        None,
        "data.dataset_kwargs.tokenizer=",
        "is not a tokenizers JSON file",
    ),
    (
        "workdir_is_a_file",
        lambda tmp: tiny_config(),
        lambda tmp: _garbage(tmp, "a_file", ""),
        "--workdir=",
        "is a file, not a folder",
    ),
    (
        "workdir_not_writable",
        lambda tmp: tiny_config(),
        lambda tmp: os.path.join(_garbage(tmp, "a_file", ""), "run"),
        "--workdir=",
        "cannot be written",
    ),
    (
        "hidden_size_zero",
        lambda tmp: tiny_config(**{"model.hidden_sizes": (0,)}),
        None,
        "model.hidden_sizes=(0,)",
        "integers >= 1",
    ),
    (
        "hidden_size_negative",
        lambda tmp: tiny_config(**{"model.hidden_sizes": (16, -3)}),
        None,
        "model.hidden_sizes=(16, -3)",
        "integers >= 1",
    ),
    (
        "more_clients_than_examples",
        lambda tmp: tiny_config(**{"data.num_clients": 5000}),
        None,
        "data.num_clients=5000",
        "set data.num_clients <= 1437",
    ),
    (
        "empty_dirichlet_clients",
        lambda tmp: tiny_config(
            **{"data.num_clients": 200, "data.partition": "dirichlet", "data.alpha": 0.001}
        ),
        None,
        "data.partition='dirichlet'",
        "lower data.num_clients or raise data.alpha",
    ),
    (
        "negative_image_size",
        lambda tmp: tiny_config(**{"data.image_size": -4}),
        None,
        "data.image_size=-4",
        "an integer >= 0",
    ),
    (
        "vit_image_size_mismatch",  # the config has no model.image_size: name data.image_size
        lambda tmp: _native_size_vit(),
        None,
        "model.name='vit_b16' takes 224x224 images",
        "data.name='cifar100' has 32x32 images: set data.image_size=224",
    ),
]


@pytest.mark.parametrize(
    "make_config, make_workdir, key, fix", [case[1:] for case in CASES], ids=[c[0] for c in CASES]
)
def test_a_bad_input_is_one_line_naming_its_key(tmp_path, make_config, make_workdir, key, fix):
    config = make_config(tmp_path)
    workdir = make_workdir(tmp_path) if make_workdir else tmp_path / "run"
    with pytest.raises(train.USER_ERRORS) as error:
        train.run(config, workdir)
    lines = str(error.value).removeprefix("Invalid config:\n  ").splitlines()
    assert len(lines) == 1, str(error.value)
    assert key in lines[0] and fix in lines[0], lines[0]


def _main(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1"}
    return subprocess.run(
        [sys.executable, "-m", "experiments.main", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "source, where",
    [
        ("def get_config(:\n", "SyntaxError: invalid syntax; {file}, line 1"),
        (
            "def get_config(arg=None):\n    return undefined_name\n",
            "NameError: name 'undefined_name' is not defined; {file}, line 2, in get_config",
        ),
        ("import ml_collections\nBASE = undefined_name\n", "{file}, line 2, in <module>"),
    ],
    ids=["syntax_error", "name_error_in_get_config", "name_error_at_import"],
)
def test_a_broken_config_file_is_one_line_naming_the_file_and_line(tmp_path, source, where):
    file = tmp_path / "mine.py"
    file.write_text(source)
    result = _main(f"--config={file}", f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: --config={file}: the config file fails ("), lines[0]
    assert where.format(file=file) in lines[0], lines[0]


def test_the_command_prints_the_line_for_a_garbage_checkpoint(tmp_path):
    """The same line from the command, before any data (CIFAR-100 is not prepared here)."""
    garbage = _garbage(tmp_path, "model.safetensors", "garbage")
    result = _main(
        "--config=configs/fedavg.py:vit_base_cifar100",
        f"--config.model.pretrained={garbage}",
        f"--workdir={tmp_path / 'run'}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: model.pretrained={garbage!r}: {garbage} is not a readable safetensors file "
        "(SafetensorError: Error while deserializing header: header too small); replace it: "
        "download it once on a machine with network access (`hf download "
        "google/vit-base-patch16-224-in21k model.safetensors config.json --local-dir DIR`) and "
        "pass model.pretrained=DIR, or put it in the Hugging Face cache "
        f"({pretrained_hub_cache()})."
    ]


def pretrained_hub_cache():
    from fedorth.models import pretrained

    return pretrained._hub_cache()
