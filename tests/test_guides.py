"""The guides of docs/guides/ run as written, each in a fresh Python process.

Each guide's ```python blocks are joined in order into one script and executed from an empty
temporary directory, so that what a guide registers (an algorithm, an optimizer, a model, a
dataset) stays in that process and the guide cannot lean on the test suite's state. A block
opened with ```python file=NAME.py is a file of the user's own (a module, a config): it is
written to that directory instead, and each ```console block's ``$ `` lines are the user's
commands, run there (in real processes, the CLI included) before the script. The guides
assert their own numbers (e.g. the new algorithm with K = 1 and full participation equals
gradient descent; the new optimizer equals its NumPy transcription; the outside-the-package
algorithm's aggregation equals its NumPy transcription and its CLI run wrote its metrics); here a
guide passes when its commands and script exit 0 and the script prints what its last check
prints.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"
# Each guide and a line its final check prints (the script reached its end).
EXPECTED = {
    "algorithm": "fedavg_trimmed from its own module: the trimmed mean equals NumPy's",
    "optimizer": "lion equals its NumPy transcription",
    "model": "resmlp matches its NumPy forward pass",
    "dataset": "blobs trains",
}
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
_FILE = re.compile(r"^```python file=([\w.]+)\n(.*?)^```$", re.S | re.M)
_CONSOLE = re.compile(r"^```console\n(.*?)^```$", re.S | re.M)


def guide_code(name: str) -> str:
    """The python code blocks of ``docs/guides/<name>.md``, in order, as one script."""
    blocks = _BLOCK.findall((GUIDES / f"{name}.md").read_text())
    if not blocks:
        raise AssertionError(f"docs/guides/{name}.md has no ```python block")
    return "\n\n".join(blocks)


def guide_files(name: str) -> dict[str, str]:
    """The user's files a guide shows (```python file=NAME.py blocks), by file name."""
    return dict(_FILE.findall((GUIDES / f"{name}.md").read_text()))


def guide_commands(name: str) -> list[list[str]]:
    """The commands of a guide's ```console blocks (their ``$ `` lines), in order."""
    lines = "\n".join(_CONSOLE.findall((GUIDES / f"{name}.md").read_text())).splitlines()
    return [shlex.split(line[2:]) for line in lines if line.startswith("$ ")]


def test_every_guide_is_tested():
    assert sorted(p.stem for p in GUIDES.glob("*.md")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_guide_code_is_lint_clean(name):
    """The guides' code follows the project's ruff settings (pyproject.toml), as if it were a
    module of tests/ (imports in the middle of a guide are allowed: E402)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (the 'test' extra)")
    sources = {f"guide_{name}.py": guide_code(name), **guide_files(name)}
    for filename, code in sources.items():
        path = f"tests/{filename}"
        for command in (
            [ruff, "check", "--ignore", "E402", "--stdin-filename", path, "-"],
            [ruff, "format", "--diff", "--stdin-filename", path, "-"],
        ):
            result = subprocess.run(command, input=code, cwd=ROOT, capture_output=True, text=True)
            assert result.returncode == 0, (
                f"docs/guides/{name}.md ({filename}):\n{result.stdout}{result.stderr}"
            )


@pytest.mark.slow  # 3-8 s of CPU each, half of it importing JAX in the fresh process
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_guide_runs_and_its_checks_pass(name, tmp_path):
    script = tmp_path / f"{name}_guide.py"
    script.write_text(guide_code(name))
    for filename, code in guide_files(name).items():
        (tmp_path / filename).write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        # On the CPU on every machine: the guides' float32 tolerances assume full-precision
        # matrix products (a GPU's default may be TensorFloat-32), and the examples are tiny.
        "JAX_PLATFORMS": "cpu",
        # The guides' warnings are errors, as the suite's (pyproject's filterwarnings).
        "PYTHONWARNINGS": "error::UserWarning,error::RuntimeWarning",
    }
    for command in guide_commands(name):
        argv = [sys.executable, *command[1:]] if command[0] == "python" else command
        result = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, (
            f"docs/guides/{name}.md: `{shlex.join(command)}` failed (exit {result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (
        f"docs/guides/{name}.md failed (exit {result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    assert EXPECTED[name] in result.stdout, result.stdout
