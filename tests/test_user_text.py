"""What users read speaks of the project and the papers, not of how it was built.

The README, docs/, the notebooks (markdown and code), benchmarks/README.md and the command line's
own text (``--list``, ``fedorth --help``, experiments.main's flags) name no issue numbers, no
work sessions, agents or the machinery they used, and cite the papers by name, never as "the
seeds" or by file number.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from fedorth import catalog, cli

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each pattern with what to write instead.
FORBIDDEN = {
    r"\bissues? \d+": "say what the code does; history lives in git",
    r"\bsessions?\b": "say what the code does; history lives in git",
    r"\bagents?\b": "name the people or leave them out",
    r"\bdevice tool\b|\bthis task\b": "describe the machine, not how it was lent",
    r"\bthe seeds?\b|\bseed (papers?|00\d)|(?<![\d,._])00\d\b": "cite the paper by name",
}


def documents() -> list[pathlib.Path]:
    return sorted(
        [
            ROOT / "README.md",
            ROOT / "benchmarks" / "README.md",
            *(ROOT / "docs").rglob("*.md"),
            *(ROOT / "notebooks").glob("*.md"),
            *(ROOT / "notebooks").glob("*.ipynb"),
        ]
    )


def text_of(path: pathlib.Path) -> str:
    if path.suffix == ".ipynb":  # the cells, not the outputs' base64
        cells = json.loads(path.read_text())["cells"]
        return "\n".join("".join(cell["source"]) for cell in cells)
    return path.read_text()


def violations(name: str, text: str) -> list[tuple[str, str]]:
    """``(what was found, the line "NAME:LINE: ... (what to write instead)")`` per match."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, fix in FORBIDDEN.items():
            for found in re.finditer(pattern, line, re.I):
                out.append((found.group(0), f"{name}:{number}: {line.strip()[:120]} ({fix})"))
    return out


# A seed citation, spelled out of two pieces so that this file holds no citation of its own.
SEED_SAMPLE = "seed " + "003"


def test_the_scan_finds_what_it_forbids():
    text = (
        f"As in issue 23, one session later the agents ran the device tool on {SEED_SAMPLE} (§6); "
        "the seeds' code, 003 (§6). Not: seed 42, 25,000 steps, sessions= none."
    )
    found = [what for what, _ in violations("x", text)]
    assert found == [
        "issue 23",
        "session",
        "sessions",
        "agents",
        "device tool",
        SEED_SAMPLE,
        "the seeds",
        "003",
    ], found
    assert not violations("x", "1_000_000 and 25,000 and 1.005 and seed 42")


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_document_speaks_of_the_project_and_the_papers(path):
    found = violations(str(path.relative_to(ROOT)), text_of(path))
    assert not found, "\n".join(where for _, where in found)


def test_command_line_text_speaks_of_the_project_and_the_papers():
    from absl import flags

    import experiments.main  # noqa: F401  (defines its flags)

    texts = {
        "fedorth --help": cli.USAGE,
        "--list": catalog.listing(catalog.config_dir()),
        "experiments.main flags": "\n".join(
            flag.help or "" for flag in flags.FLAGS.get_key_flags_for_module(experiments.main)
        ),
    }
    found = [v for name, text in texts.items() for v in violations(name, text)]
    assert not found, "\n".join(where for _, where in found)
