"""The README runs as written: every ```python block, every config its commands name resolves,
``.ci/run`` runs its two commands in a fresh virtual environment, and ``import fedorth`` reaches
the subpackages lazily.

Each block runs in its own namespace (a reader copies one at a time), the blocks one after the
other in one fresh Python process, from an empty temporary directory, with the suite's
warnings-as-errors; the blocks assert their own numbers (FedPAC finds the regression's w* to the
noise's level).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from fedorth import catalog

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_PYTHON = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
_BASH = re.compile(r"^```bash\n(.*?)^```$", re.S | re.M)


def python_blocks() -> list[str]:
    return _PYTHON.findall(README.read_text())


def test_readme_has_the_python_blocks_this_file_runs():
    assert len(python_blocks()) == 2, "a README block was added or removed: update this test"


@pytest.mark.parametrize("index", range(2))
def test_readme_python_block_is_lint_clean(index):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (the 'test' extra)")
    code = python_blocks()[index]
    path = f"tests/readme_{index}.py"
    for command in (
        [ruff, "check", "--stdin-filename", path, "-"],
        [ruff, "format", "--diff", "--stdin-filename", path, "-"],
    ):
        result = subprocess.run(command, input=code, cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, f"README block {index}:\n{result.stdout}{result.stderr}"


# Runs each block in its own namespace, one after the other, in one fresh process (one JAX
# import for both), printing a marker after each.
_RUNNER = """
import sys
for index, code in enumerate(sys.argv[1:]):
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__main__"})
    print(f"--- block {index} done", flush=True)
"""


@pytest.mark.slow  # one fresh process importing JAX and compiling a round: 10-20 s
def test_readme_python_blocks_run(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "JAX_PLATFORMS": "cpu",
        "PYTHONWARNINGS": "error::UserWarning,error::RuntimeWarning",
    }
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER, *python_blocks()],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, (
        f"a README block failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    first, second, _ = result.stdout.split("--- block ")
    # Block 0 prints the extreme singular values of Newton-Schulz's output (polar_express's
    # five steps put them within about 0.15 of 1); block 1 its own check's figures.
    low, high = sorted(float(v) for v in first.strip("[]\n ").split())
    assert 0.8 < low <= high < 1.2, result.stdout
    assert "train loss" in second, result.stdout


def test_readme_commands_name_configs_that_resolve(tmp_path, monkeypatch):
    """Every ``--config=NAME[:preset]`` of the README's command blocks resolves from an unrelated
    directory (a renamed config or preset fails here, not in a reader's shell)."""
    monkeypatch.chdir(tmp_path)
    specs = re.findall(r"--config=(\S+)", "\n".join(_BASH.findall(README.read_text())))
    specs = [s for s in specs if "NAME" not in s]
    assert "configs/fedpac_soap.py" in specs, specs
    for spec in specs:
        catalog.resolve_config(spec)


def test_ci_runs_the_readmes_two_commands_in_a_fresh_virtualenv():
    """``.ci/run`` runs the Quick start's commands verbatim, inside a new virtual environment."""
    quick_start = README.read_text().split("## Quick start")[1].split("\n## ")[0]
    commands = [block.strip() for block in _BASH.findall(quick_start)]
    assert len(commands) == 2, commands
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    venv_line = next(i for i, line in enumerate(script) if "-m venv" in line)
    activate = next(i for i, line in enumerate(script) if "/bin/activate" in line)
    assert venv_line < activate < script.index(commands[0]) < script.index(commands[1]), script


def test_import_fedorth_reaches_the_subpackages_lazily():
    """``import fedorth; fedorth.optim.muon(...)`` works as ``optax.adam`` after ``import optax``,
    and ``import fedorth`` alone loads no JAX (the command line's start-up stays fast)."""
    code = (
        "import sys, fedorth\n"
        "assert 'jax' not in sys.modules and 'fedorth.optim' not in sys.modules\n"
        "assert {'optim', 'fed', 'data', 'models', 'train', 'theory'} <= set(dir(fedorth))\n"
        "tx = fedorth.optim.muon(learning_rate=0.02)\n"
        "assert callable(tx.update) and fedorth.fed.get_algorithm\n"
        "assert fedorth.optim is sys.modules['fedorth.optim']\n"
        "try:\n"
        "    fedorth.nope\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "module 'fedorth' has no attribute 'nope'"
