"""The theory notebooks: they render as text, install fedorth where it is missing, and run top to
bottom against the *installed wheel*, not the source tree.

* Committed with outputs (plots visible when browsing the repository), ending with assertions.
* The first cell installs fedorth only where it cannot be imported (Colab): from the project's
  address (setup.cfg's ``project_urls``, empty until it is published), else from a wheel
  uploaded to the notebook's folder, else it stops with one sentence giving both ways.
  ``FEDORTH_INSTALL_SOURCE`` in the environment overrides both (the tests). The cell and each
  notebook's "Open in Colab" link are written from the address by ``python
  tests/test_notebooks.py``; a test checks that they are.
* Markdown cells are markdown (paragraphs, lists, LaTeX), not lines turned into headings by a
  leading ``#``: no markdown cell renders as headings only.
* ``test_wheel_runs_every_notebook`` builds the wheel (``python -m pip wheel --no-deps``), makes
  a fresh virtual environment that sees the test interpreter's packages (its site-packages on
  the new one's path, so a virtualenv's packages are seen, not its base interpreter's), lets
  the install cell install the wheel from the run folder with no package index, runs the
  wheel's ``fedorth`` command beside a user's own ``configs/`` and ``experiments/``, and executes
  every notebook in a kernel of that environment from that folder (two kernels at once); the
  kernel's ``fedorth`` must be the wheel's. It takes about 100 CPU-seconds, most of them XLA
  compiling the notebooks' rollouts (user+sys of ``python -m pytest -n 0 tests/test_notebooks.py
  -k wheel``; 3.5 min wall on a heavily loaded 2-core machine).
"""

import configparser
import json
import os
import pathlib
import re
import subprocess
import sys
import venv
import zipfile

import nbformat
import pytest
from markdown_it import MarkdownIt

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {
    "heavy_tailed_noise",
    "localmuon_bias",
    "newton_schulz_and_lmo",
    "preconditioner_drift",
}


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


# ---------------------------------------------------------------------------------------------
# The install cell and the "Open in Colab" links, written from the project's address.


def project_url() -> str:
    """The project's address: setup.cfg's ``project_urls`` ``Source`` (empty until published)."""
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    urls = setup["metadata"].get("project_urls", "")
    found = re.search(r"^\s*Source\s*=\s*(\S+)", urls, re.M)
    return found.group(1) if found else ""


INSTALL_CELL = """\
# Installs fedorth where it cannot be imported (Colab, a fresh kernel), from the first of: the
# environment variable FEDORTH_INSTALL_SOURCE (anything pip installs); the project's address,
# FEDORTH_URL, once it is published; a fedorth-*.whl uploaded to the notebook's folder (Colab:
# /content; build it in a checkout with `pip wheel --no-deps -w dist .`, which needs nothing more).
import glob
import importlib.util
import os
import subprocess
import sys

FEDORTH_URL = {url}  # the project's address (setup.cfg's project_urls)
if importlib.util.find_spec("fedorth") is None:
    wheels = sorted(glob.glob("fedorth-*.whl"))
    source = (
        os.environ.get("FEDORTH_INSTALL_SOURCE")
        or (f"git+{{FEDORTH_URL}}" if FEDORTH_URL else None)
        or (wheels[-1] if wheels else None)
    )
    if source is None:
        raise RuntimeError(
            "fedorth is not installed here: upload the wheel that `pip wheel --no-deps -w dist .` "
            "makes in a checkout of fedorth (dist/fedorth-*.whl) to the notebook's folder, or set "
            "FEDORTH_URL to the project's address, and run this cell again."
        )
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", source])"""

_COLAB_LINE = re.compile(r"^\[!\[Open in Colab\].*\n\n", re.M)


def install_cell(url: str) -> str:
    """The first code cell of every notebook, for the project's address ``url``."""
    return INSTALL_CELL.format(url=json.dumps(url))


def colab_link(url: str, notebook: str) -> str:
    """The "Open in Colab" badge line of ``notebook`` for a GitHub address, else ``""``."""
    github = re.match(r"https://github\.com/([^/]+/[^/]+?)(\.git)?/?$", url)
    if not github:
        return ""
    target = f"https://colab.research.google.com/github/{github.group(1)}/blob/main/notebooks/"
    badge = "https://colab.research.google.com/assets/colab-badge.svg"
    return f"[![Open in Colab]({badge})]({target}{notebook})\n\n"


def synced(nb, name: str, url: str):
    """``nb`` with its install cell and title cell's Colab link written for ``url``."""
    _code_cells(nb)[0].source = install_cell(url)
    title = next(c for c in nb.cells if c.cell_type == "markdown")
    title.source = colab_link(url, name) + _COLAB_LINE.sub("", title.source)
    return nb


def test_install_cell_and_colab_link_follow_the_project_address():
    """Run ``python tests/test_notebooks.py`` after changing setup.cfg's project_urls."""
    url = project_url()
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert _code_cells(nb)[0].source == install_cell(url), (
            f"{path.name}: run python tests/test_notebooks.py"
        )
        title = next(c for c in nb.cells if c.cell_type == "markdown").source
        assert title.startswith(colab_link(url, path.name)), path.name
        assert bool(_COLAB_LINE.match(title)) == bool(colab_link(url, path.name)), path.name


def test_colab_link_of_a_github_address():
    assert colab_link("https://github.com/owner/fedorth", "x.ipynb") == (
        "[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        "(https://colab.research.google.com/github/owner/fedorth/blob/main/notebooks/x.ipynb)\n\n"
    )
    assert colab_link("", "x.ipynb") == "" and colab_link("https://example.org/f", "x") == ""


_FAKE_PIP = """\
import json, os, sys
with open(os.environ["FAKE_PIP_LOG"], "w") as f:
    json.dump(sys.argv[1:], f)
"""


def _run_install_cell(tmp_path, url: str, files=(), env=None) -> tuple[int, str, list | None]:
    """Runs the install cell for address ``url`` where fedorth cannot be imported (``python -S``:
    no site-packages), with a stand-in ``pip`` that records its arguments: no network."""
    fake = tmp_path / "fake"
    (fake / "pip").mkdir(parents=True)
    (fake / "pip" / "__init__.py").write_text("")
    (fake / "pip" / "__main__.py").write_text(_FAKE_PIP)
    session = tmp_path / "session"
    session.mkdir()
    for name in files:
        (session / name).write_text("")
    log = tmp_path / "pip.json"
    environ = {k: v for k, v in os.environ.items() if k != "FEDORTH_INSTALL_SOURCE"}
    environ.update(PYTHONPATH=str(fake), FAKE_PIP_LOG=str(log), **(env or {}))
    result = subprocess.run(
        [sys.executable, "-S", "-c", install_cell(url)],
        cwd=session, env=environ, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return result.returncode, result.stderr, json.loads(log.read_text()) if log.exists() else None


def test_install_cell_installs_from_the_declared_address(tmp_path):
    code, stderr, pip = _run_install_cell(
        tmp_path, "https://github.com/owner/fedorth", files=["fedorth-0.1.0-py3-none-any.whl"]
    )
    assert code == 0, stderr
    assert pip == ["install", "-q", "git+https://github.com/owner/fedorth"]


def test_install_cell_without_an_address_installs_an_uploaded_wheel(tmp_path):
    wheels = ["fedorth-0.1.0-py3-none-any.whl", "fedorth-0.2.0-py3-none-any.whl"]
    code, stderr, pip = _run_install_cell(tmp_path, "", files=wheels)
    assert code == 0, stderr
    assert pip == ["install", "-q", "fedorth-0.2.0-py3-none-any.whl"]
    code, stderr, pip = _run_install_cell(
        tmp_path / "t", "", files=wheels, env={"FEDORTH_INSTALL_SOURCE": "/x/fedorth"}
    )
    assert code == 0 and pip == ["install", "-q", "/x/fedorth"], stderr


def test_install_cell_with_neither_says_both_ways_in_one_sentence(tmp_path):
    code, stderr, pip = _run_install_cell(tmp_path, "")
    assert code == 1 and pip is None
    message = stderr.strip().splitlines()[-1]
    assert message.startswith("RuntimeError: fedorth is not installed here: upload the wheel"), (
        message
    )
    assert "pip wheel --no-deps -w dist ." in message and "FEDORTH_URL" in message


def test_the_four_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} >= EXPECTED, (
        f"missing notebooks in {NOTEBOOK_DIR}: {sorted(EXPECTED - {p.stem for p in NOTEBOOKS})}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_outputs(path):
    """Valid nbformat; install cell first; outputs and a plot present; ends with asserts."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    cells = _code_cells(nb)
    assert cells[0].source == install_cell(project_url()), "the install cell comes first"
    executed = cells[1:]
    assert all(c.execution_count is not None for c in executed), (
        f"{path.name} is not fully executed: re-run it and commit it with its outputs"
    )
    assert any(
        o.output_type == "display_data" and "image/png" in o.data for c in cells for o in c.outputs
    ), f"{path.name} has no rendered plot"
    assert not any(o.output_type == "error" for c in cells for o in c.outputs)
    assert "assert" in cells[-1].source or "assert" in cells[-2].source, (
        f"{path.name} must end with assertions of its claim"
    )


def _block_kinds(markdown: str) -> list[str]:
    """The top-level blocks a markdown cell renders to (``heading``, ``paragraph``, ...)."""
    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    return [t.type.removesuffix("_open") for t in tokens if t.level == 0 and t.nesting >= 0]


def test_block_kinds_reads_markdown_as_a_renderer_does():
    """The checker itself: '# # Title' lines are headings, text lines a paragraph."""
    assert _block_kinds("# # Title\n#\n# Some text.") == ["heading", "heading", "heading"]
    assert _block_kinds("# Title\n\nSome text,\nand $x^2$.\n\n* a\n* b") == [
        "heading",
        "paragraph",
        "bullet_list",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_markdown_cell_renders_as_headings_only(path):
    nb = nbformat.read(path, as_version=4)
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    assert markdown, f"{path.name} has no markdown cell"
    for source in markdown:
        kinds = _block_kinds(source)
        assert set(kinds) - {"heading", "hr"}, f"renders as headings only:\n{source[:300]}"
        assert kinds.count("heading") <= 2, f"a line per heading (leading '#'?):\n{source[:300]}"
    # The first markdown cell is the title, one heading of level 1, then paragraphs.
    tokens = MarkdownIt("commonmark").parse(markdown[0])
    assert [t.tag for t in tokens if t.type == "heading_open"] == ["h1"]
    assert sum(t.type == "paragraph_open" for t in tokens) >= 2


def _build_wheel(out: pathlib.Path) -> pathlib.Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(out), str(REPO)],
        check=True, capture_output=True, text=True, cwd=out,
    )  # fmt: skip
    (wheel,) = out.glob("fedorth-*.whl")
    return wheel


_DRIVER = r"""
import json, os, sys, nbformat
from nbclient import NotebookClient
out = {}
for path in sys.argv[1:]:
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import fedorth, configs; print(fedorth.__file__)"))
    NotebookClient(nb, timeout=600, kernel_name="fedorth-wheel",
                   resources={"metadata": {"path": os.getcwd()}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    out[os.path.basename(path)] = {"errors": len(errors),
                                  "fedorth": nb.cells[-1].outputs[0]["text"].strip()}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_wheel_runs_every_notebook(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("configs/__init__.py", "configs/presets.py", "configs/fedpac_soap.py",
                   "experiments/main.py", "fedorth/data/digits.npz"):  # fmt: skip
        assert needed in names, f"the wheel lacks {needed}"
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    # The dependencies are this interpreter's packages: its site-packages folders (a virtualenv's
    # own, not its base interpreter's as --system-site-packages would give) go on the new
    # environment's path, after its own site-packages, without their .pth files (no editable
    # fedorth from this checkout).
    own_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (pathlib.Path(own_site) / "_outer_packages.pth").write_text("\n".join(outer) + "\n")
    # A kernel of that environment, found through JUPYTER_PATH.
    spec = env_dir / "share" / "jupyter" / "kernels" / "fedorth-wheel"
    spec.mkdir(parents=True)
    argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "fedorth wheel", "language": "python"})
    )
    run_dir = tmp_path / "run"  # not the repository: `import fedorth` cannot find the sources
    run_dir.mkdir()
    uploaded = run_dir / wheel.name  # a wheel uploaded to the notebook's folder
    uploaded.write_bytes(wheel.read_bytes())
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "XLA_FLAGS", "PYTEST_ADDOPTS")
    }
    env.update(
        JUPYTER_PATH=str(env_dir / "share" / "jupyter"),
        JAX_PLATFORMS="cpu",
        JAX_NUMPY_RANK_PROMOTION="raise",
        PIP_NO_INDEX="1",  # no network: the install cell installs the uploaded wheel
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    env.pop("FEDORTH_INSTALL_SOURCE", None)
    notebook = nbformat.read(NOTEBOOKS[0], as_version=4)
    install = subprocess.run(
        [str(python), "-c", _code_cells(notebook)[0].source],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-4000:]
    # The wheel's `fedorth` command, from a folder holding configs/ and experiments/ packages of
    # its own, runs the configs installed with the wheel.
    user = tmp_path / "user"
    for package in ("configs", "experiments"):
        (user / package).mkdir(parents=True)
        (user / package / "__init__.py").write_text("")
    command = subprocess.run(
        [str(env_dir / "bin" / "fedorth"), "config", "fedpac_soap"],
        cwd=user, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert command.returncode == 0, command.stderr[-4000:]
    assert json.loads(command.stdout)["fed"]["algorithm"] == "fedpac_soap"
    # Two kernels at once (each notebook is mostly one thread: compilation and small kernels).
    groups = [NOTEBOOKS[0::2], NOTEBOOKS[1::2]]
    procs = [
        subprocess.Popen(
            [str(python), "-c", _DRIVER, *map(str, group)],
            cwd=run_dir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for group in groups
        if group
    ]
    results = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-4000:]
        results.update(json.loads(stdout.splitlines()[-1]))
    assert sorted(results) == sorted(p.name for p in NOTEBOOKS)
    site = str(env_dir.resolve())
    for name, result in results.items():
        assert result["errors"] == 0, name
        assert pathlib.Path(result["fedorth"]).resolve().is_relative_to(site), (
            f"{name} imported fedorth from {result['fedorth']}, not from the wheel in {site}"
        )


if __name__ == "__main__":
    # Writes every notebook's install cell and Colab link for setup.cfg's project_urls.
    for notebook_path in NOTEBOOKS:
        notebook = nbformat.read(notebook_path, as_version=4)
        nbformat.write(synced(notebook, notebook_path.name, project_url()), notebook_path)
        print(f"wrote {notebook_path.relative_to(REPO)}")
