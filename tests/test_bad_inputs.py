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
import test_reliability
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


# (id, docs/ERRORS.md's description, config from tmp_path, workdir from tmp_path, the key the
# line names, a phrase of the fix)
CASES = [
    (
        "pretrained_missing",
        "`model.pretrained` a path where nothing is (exit code 2)",
        lambda tmp: _vit(pretrained=str(tmp / "nowhere")),
        None,
        "model.pretrained=",
        "no such file or folder; download it once",
    ),
    (
        "pretrained_of_another_architecture",
        "`model.pretrained` a RoBERTa checkpoint for `model.name='vit_b16'` (exit code 2)",
        lambda tmp: _vit(pretrained=str(FIXTURES / "roberta")),
        None,
        "model.pretrained=",
        "is a 'roberta' checkpoint (config.json), but model.name='vit_b16' needs a 'vit' one",
    ),
    (
        "pretrained_garbage_safetensors",
        "`model.pretrained` a `model.safetensors` that is not one (exit code 2)",
        lambda tmp: _vit(pretrained=_garbage(tmp, "model.safetensors", "garbage")),
        None,
        "model.pretrained=",
        "is not a readable safetensors file",
    ),
    (
        "pretrained_garbage_config_json",
        "`model.pretrained` a folder whose `config.json` is not JSON (exit code 2)",
        lambda tmp: _vit(pretrained=_bare_checkpoint(tmp)),
        None,
        "model.pretrained=",
        "is not the checkpoint's JSON config",
    ),
    (
        "tokenizer_missing",
        "`data.dataset_kwargs.tokenizer` a path where nothing is (exit code 2)",
        lambda tmp: _roberta(str(tmp / "tokenizer.json")),
        None,
        "data.dataset_kwargs.tokenizer=",
        "no such file",
    ),
    (
        "tokenizer_garbage",
        "`data.dataset_kwargs.tokenizer` a file that is not a tokenizer (exit code 2)",
        lambda tmp: _roberta(_garbage(tmp, "tokenizer.json", "not a tokenizer")),
        None,
        "data.dataset_kwargs.tokenizer=",
        "is not a tokenizers JSON file",
    ),
    (
        "workdir_is_a_file",
        "`--workdir` a file (exit code 2)",
        lambda tmp: tiny_config(),
        lambda tmp: _garbage(tmp, "a_file", ""),
        "--workdir=",
        "is a file, not a folder",
    ),
    (
        "workdir_not_writable",
        "`--workdir` a folder that cannot be created (below a file; likewise without "
        "permission; exit code 2)",
        lambda tmp: tiny_config(),
        lambda tmp: os.path.join(_garbage(tmp, "a_file", ""), "run"),
        "--workdir=",
        "cannot be written",
    ),
    (
        "hidden_size_zero",
        "`model.hidden_sizes=(0,)` (exit code 2)",
        lambda tmp: tiny_config(**{"model.hidden_sizes": (0,)}),
        None,
        "model.hidden_sizes=(0,)",
        "integers >= 1",
    ),
    (
        "hidden_size_negative",
        "`model.hidden_sizes=(16, -3)` (exit code 2)",
        lambda tmp: tiny_config(**{"model.hidden_sizes": (16, -3)}),
        None,
        "model.hidden_sizes=(16, -3)",
        "integers >= 1",
    ),
    (
        "more_clients_than_examples",
        "`data.num_clients=5000` on the 1437 digits (exit code 2)",
        lambda tmp: tiny_config(**{"data.num_clients": 5000}),
        None,
        "data.num_clients=5000",
        "set data.num_clients <= 1437",
    ),
    (
        "empty_dirichlet_clients",
        "`data.num_clients=200`, `data.partition='dirichlet'`, `data.alpha=0.001` (exit code 2)",
        lambda tmp: tiny_config(
            **{"data.num_clients": 200, "data.partition": "dirichlet", "data.alpha": 0.001}
        ),
        None,
        "data.partition='dirichlet'",
        "lower data.num_clients or raise data.alpha",
    ),
    (
        "negative_image_size",
        "`data.image_size=-4` (exit code 2)",
        lambda tmp: tiny_config(**{"data.image_size": -4}),
        None,
        "data.image_size=-4",
        "an integer >= 0",
    ),
    (
        "vit_image_size_mismatch",  # the config has no model.image_size
        "`model.name='vit_b16'` (224x224 positions) on CIFAR-100's 32x32 images, "
        "`data.image_size=0` (exit code 2)",
        lambda tmp: _native_size_vit(),
        None,
        "model.name='vit_b16' takes 224x224 images",
        "data.name='cifar100' has 32x32 images: set data.image_size=224",
    ),
]


def _run_message(tmp: pathlib.Path, make_config, make_workdir) -> str:
    """What the command prints for the case (``train.run``'s user error, as main.py prints it)."""
    config = make_config(tmp)
    workdir = make_workdir(tmp) if make_workdir else tmp / "run"
    with pytest.raises(train.USER_ERRORS) as error:
        train.run(config, workdir)
    return f"error: {error.value}"


@pytest.mark.parametrize(
    "description, make_config, make_workdir, key, fix",
    [case[1:] for case in CASES],
    ids=[c[0] for c in CASES],
)
def test_a_bad_input_is_one_line_naming_its_key(
    tmp_path, description, make_config, make_workdir, key, fix
):
    message = _run_message(tmp_path, make_config, make_workdir)
    lines = message.replace("error: Invalid config:\n  ", "error: ").splitlines()
    assert len(lines) == 1, message
    assert key in lines[0] and fix in lines[0], lines[0]
    assert_documented(description, message, tmp_path)


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


# (docs/ERRORS.md's description, the config file, what the line says of it)
CONFIG_FILES = {
    "syntax_error": (
        "`--config=$TMP/mine.py`, a file with a syntax error (exit code 2)",
        "def get_config(:\n",
        "SyntaxError: invalid syntax; {file}, line 1",
    ),
    "name_error_in_get_config": (
        "`--config=$TMP/mine.py`, whose `get_config` uses an undefined name (exit code 2)",
        "def get_config(arg=None):\n    return undefined_name\n",
        "NameError: name 'undefined_name' is not defined; {file}, line 2, in get_config",
    ),
    "name_error_at_import": (
        "`--config=$TMP/mine.py`, which uses an undefined name at its top level (exit code 2)",
        "import ml_collections\nBASE = undefined_name\n",
        "{file}, line 2, in <module>",
    ),
}


def _config_file_message(tmp: pathlib.Path, source: str) -> tuple[int, str]:
    file = tmp / "mine.py"
    file.write_text(source)
    result = _main(f"--config={file}", f"--workdir={tmp / 'run'}")
    return result.returncode, result.stderr.strip()


@pytest.mark.parametrize("case", sorted(CONFIG_FILES))
def test_a_broken_config_file_is_one_line_naming_the_file_and_line(tmp_path, case):
    description, source, where = CONFIG_FILES[case]
    returncode, message = _config_file_message(tmp_path, source)
    file = tmp_path / "mine.py"
    assert returncode == 2, message[-3000:]
    lines = message.splitlines()
    assert len(lines) == 1, message[-3000:]
    assert lines[0].startswith(f"error: --config={file}: the config file fails ("), lines[0]
    assert where.format(file=file) in lines[0], lines[0]
    assert_documented(description, message, tmp_path)


def test_the_command_prints_the_line_for_a_garbage_checkpoint(tmp_path):
    """The command prints train.run's line, before any data (CIFAR-100 is not prepared here)."""
    garbage = _garbage(tmp_path, "model.safetensors", "garbage")
    result = _main(
        "--config=configs/fedavg.py:vit_base_cifar100",
        f"--config.model.pretrained={garbage}",
        f"--workdir={tmp_path / 'run'}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    expected = _run_message(tmp_path, lambda tmp: _vit(pretrained=garbage), None)
    assert result.stderr.strip().splitlines() == [expected]


# ------------------------------------------------------------------------ docs/ERRORS.md

DOC = ROOT / "docs" / "ERRORS.md"
SECTION = "## Files, data, config files, several processes"
INTRO = """
What the checks of the files a config names (`fedorth.train.builders.check_files`, before the
data are loaded), of the data (`fedorth.data.load_federated`) and of the config file itself say,
generated by `python tests/test_bad_inputs.py` from the cases of that file. `$TMP` stands for a
folder of the user's, `$HF_HUB_CACHE` for the Hugging Face cache. With `--distributed`, a process
of the run that is killed or crashes stops the others within seconds (about 2 s after their next
collective; a silent one after `--heartbeat_timeout_s`, 10 by default) with the last line below
(`$PID`, `$HOST`, `$COORDINATOR` stand for the lost process's values), exit code 1; the same
command on every process resumes the run.

"""
LOST = {
    "`--distributed`, 2 processes: process 1 killed (process 0 prints it; exit code 1)": (
        {1: "pid $PID on $HOST"},
        0,
    ),
    "`--distributed`, 2 processes: process 0, the coordinator, killed (process 1 prints it)": (
        {0: "pid $PID on $HOST, the coordinator at $COORDINATOR"},
        1,
    ),
}


def _doc_row(description: str, message: str, tmp: pathlib.Path) -> str:
    from fedorth.models import pretrained

    text = message.replace(str(ROOT) + os.sep, "")
    text = text.replace(str(pretrained._hub_cache()), "$HF_HUB_CACHE")
    return test_reliability._row(description, text, tmp)


def assert_documented(description: str, message: str, tmp: pathlib.Path) -> None:
    row = _doc_row(description, message, tmp)
    assert row in DOC.read_text(), (
        f"docs/ERRORS.md lacks (run python tests/test_bad_inputs.py):\n{row}"
    )


def write_doc() -> None:
    """Rewrites this file's section of docs/ERRORS.md from its cases (a minute)."""
    import tempfile

    from fedorth.train import distributed

    rows = []
    for _, description, make_config, make_workdir, _, _ in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            message = _run_message(pathlib.Path(tmp), make_config, make_workdir)
            rows.append(_doc_row(description, message, pathlib.Path(tmp)))
    for description, source, _ in CONFIG_FILES.values():
        with tempfile.TemporaryDirectory() as tmp:
            _, message = _config_file_message(pathlib.Path(tmp), source)
            rows.append(_doc_row(description, message, pathlib.Path(tmp)))
    for description, (dead, me) in LOST.items():
        rows.append(_doc_row(description, distributed.lost_message(dead, me, 2), ROOT))
    section = (
        SECTION + "\n" + INTRO + "| bad input | message |\n| --- | --- |\n" + "\n".join(rows) + "\n"
    )
    text = DOC.read_text()
    parts = text.split("\n" + SECTION + "\n")
    rest = parts[1].split("\n## ", 1)[1] if len(parts) > 1 and "\n## " in parts[1] else None
    text = parts[0].rstrip("\n") + "\n\n" + section + ("\n## " + rest if rest else "")
    DOC.write_text(text)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    write_doc()
    print(f"wrote {DOC}")
