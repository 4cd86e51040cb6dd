"""The API reference (pdoc, docs/API.md) builds from the docstrings without a warning.

The reference is built once, in a separate process (this file run as a script: pdoc imports every
module of the package, which should not happen inside a test worker), with the settings of
docs/API.md (docs/build_api.py: Google-style docstrings, math). It fails when

* pdoc fails (a module that cannot be imported) or warns (an ``.. include::`` of a missing file,
  a bad directive, an annotation it cannot evaluate, ...); the only warnings let through are two
  limitations of pdoc itself, matched narrowly (:func:`known_pdoc_limitation`);
* a module of the package has no page;
* a docstring names a ``fedorth.`` object in code (```fedorth.fed.make_round_fn```,
  ``:func:`fedorth.optim.scale_by_muon```) that does not exist: a renamed or removed function
  whose references were left behind;
* a key public name has no documented section on its package's page.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (page, name): each must have a section with a docstring on that page.
KEY_NAMES = [
    ("fedorth/optim.html", "newton_schulz"),
    ("fedorth/optim.html", "scale_by_muon"),
    ("fedorth/optim.html", "scale_by_lmo"),
    ("fedorth/optim.html", "scale_by_soap"),
    ("fedorth/optim.html", "scale_by_sophia"),
    ("fedorth/fed.html", "make_round_fn"),
    ("fedorth/fed.html", "get_algorithm"),
    ("fedorth/fed.html", "init_server"),
    ("fedorth/fed.html", "FedAlgorithm"),
    ("fedorth/fed.html", "RoundConfig"),
    ("fedorth/fed.html", "RoundContext"),
    ("fedorth/fed/local.html", "DIRECTIONS"),
    ("fedorth/models.html", "get_model"),
    ("fedorth/models.html", "Model"),
    ("fedorth/data.html", "load_federated"),
    ("fedorth/data.html", "sample_batch"),
    ("fedorth/train/loop.html", "run"),
]

# A ``fedorth.`` dotted name in code in a docstring, linked by pdoc or not.
_REFERENCE = re.compile(r"<code>(?:<a [^>]*>)?(fedorth(?:\.\w+)+)")


def load_build_api():
    """docs/build_api.py as a module (it also holds the pdoc limitations it does not show)."""
    spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
    build_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_api)
    return build_api


def build(output: pathlib.Path, package: str) -> dict:
    """Builds the reference of ``package`` into ``output`` with docs/build_api.py; returns the
    warnings (unexplained and known), the ``fedorth.`` references that do not resolve and the
    pages written."""
    build_api = load_build_api()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Re-issues all but pdoc's own limitations. Without the highlighted source listings,
        # which no check reads (the references are read from the docstrings' <code>, the
        # sections from their ids); test_build_script_says_where_it_wrote_and_nothing_else
        # builds them, as `python docs/build_api.py` does.
        pages = build_api.build(output, package, show_source=False)
    references = {m for page in pages for m in _REFERENCE.findall(page.read_text())}
    unresolved = []
    for name in sorted(references):
        try:
            build_api.resolve(name)
        except (AttributeError, ImportError) as error:
            unresolved.append(f"{name}: {error}")
    return {
        "warnings": sorted({str(w.message) for w in caught}),
        "unresolved": unresolved,
        "references": len(references),
        "pages": [str(page.relative_to(output)) for page in pages],
    }


def run_build(
    output: pathlib.Path, package: str, pythonpath: list[pathlib.Path]
) -> subprocess.CompletedProcess:
    """:func:`build` in a fresh process (this file as a script); its result is the last line of
    stdout."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, __file__, str(output), package],
        cwd=output.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def result_of(process: subprocess.CompletedProcess) -> dict:
    assert process.returncode == 0, (
        f"pdoc failed:\n{process.stdout[-3000:]}\n{process.stderr[-6000:]}"
    )
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_api_reference_builds_cleanly(tmp_path):
    """One build (about 10 s of CPU) and every check on it (a test per check would build once per
    xdist worker)."""
    output = tmp_path / "api"
    result = result_of(run_build(output, "fedorth", [ROOT]))

    assert result["warnings"] == [], "pdoc warned:\n" + "\n".join(result["warnings"])

    modules = {
        str(p.relative_to(ROOT).with_suffix("")).removesuffix("/__init__") + ".html"
        for p in (ROOT / "fedorth").rglob("*.py")
    }
    assert sorted(modules - set(result["pages"])) == [], "modules without a page"

    assert result["references"] >= 20, result  # the check below reads the rendered references
    assert result["unresolved"] == [], "docstrings name objects that do not exist:\n" + "\n".join(
        result["unresolved"]
    )

    # fedorth.optim's page opens on the optimizers, the state classes come last.
    optim = (output / "fedorth/optim.html").read_text()
    order = [optim.index(f'<section id="{name}">') for name in ("muon", "soap", "sophia")]
    assert max(order) < optim.index('<section id="MuonState">'), "the states come first"

    undocumented = []
    for page, name in KEY_NAMES:
        html = (output / page).read_text()
        section = re.search(rf'<section id="{re.escape(name)}">(.*?)</section>', html, re.S)
        if section is None or 'class="docstring"' not in section.group(1):
            undocumented.append(f"{page}#{name}")
    assert undocumented == [], "key public names without a documented section"


def test_the_check_catches_broken_references_includes_and_modules(tmp_path):
    """The same build on a tiny package: a reference to a misspelled fedorth function and an
    ``.. include::`` of a missing file are reported; a module that cannot be imported fails the
    build."""
    package = tmp_path / "src" / "brokendocs"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        '"""See `fedorth.optim.scale_by_muon` and :func:`fedorth.optim.scale_by_moun`.\n\n'
        '.. include:: missing.md\n"""\n'
    )
    result = result_of(run_build(tmp_path / "api", "brokendocs", [tmp_path / "src", ROOT]))
    assert [u.split(":")[0] for u in result["unresolved"]] == ["fedorth.optim.scale_by_moun"]
    assert result["references"] == 2
    assert len(result["warnings"]) == 1 and "Cannot include" in result["warnings"][0], result

    (package / "broken.py").write_text('"""Fails on import."""\n\nimport not_a_module\n')
    process = run_build(tmp_path / "api2", "brokendocs", [tmp_path / "src", ROOT])
    assert process.returncode != 0 and "Error importing brokendocs.broken" in process.stderr


def test_build_script_says_where_it_wrote_and_nothing_else(tmp_path):
    """``python docs/build_api.py OUT PACKAGE`` on a tiny package: one line naming the folder,
    no warning."""
    package = tmp_path / "src" / "tinydocs"
    package.mkdir(parents=True)
    # A NamedTuple field annotated with a module-level import: pdoc's own limitation, not shown.
    (package / "__init__.py").write_text(
        '"""A documented package."""\n\nfrom __future__ import annotations\n\n'
        "from typing import NamedTuple\n\nimport numpy as np\n\n\n"
        'class State(NamedTuple):\n    """A state."""\n\n    x: np.ndarray\n'
    )
    output = tmp_path / "api"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    process = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "build_api.py"), str(output), "tinydocs"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert process.returncode == 0 and process.stderr == "", process.stderr
    assert process.stdout == (
        f"wrote 2 pages to {output.resolve()}; open {output.resolve() / 'index.html'}\n"
    )


if __name__ == "__main__":
    print(json.dumps(build(pathlib.Path(sys.argv[1]), sys.argv[2])))
