"""The text describes each algorithm by the specs its builder constructs.

A :class:`fedorth.fed.FedAlgorithm` is one spec per design axis (``local_tx``, ``start``,
``corrections``, ``quantities``, ``report``, ``server``; docs/ARCHITECTURE.md). A docstring,
comment, message, page of docs/ or notebook that maps a paper's algorithm onto the engine names
those specs (``start.Global(mask=...)``, ``FromState(read)``, ``update.GlobalStep(gamma)``),
never a field of a flat ``FedAlgorithm`` that fedorth does not have
(``control_variates="momentum"``, ``aggregate_mask``, ``client_prepass``, ...): a reader would
look for it and not find it.

``client_state`` and ``server_rule`` are also the ``fed.options`` of some builders
(``"reset"``/``"persistent"`` and ``"mean"``/``"partial"``). Written with a value, they must
name a value a builder accepts, and, without their ``fed.options.`` prefix, stand in a module
whose builders take that option.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import pathlib
import re
import tokenize

import pytest

from fedorth import fed
from fedorth.fed import corrections, quantities, start, update

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Fields a flat FedAlgorithm would have and fedorth's has not, with the spec that holds each.
NOT_FIELDS = {
    "aggregate_opt_state": "start.Global() (or averaged=True of Reset/Persistent)",
    "state_compression": "start.Global(compression=...)",
    "aggregate_mask": "start.Global(mask=...)",
    "persistent_mask": "start.Global(keep=...)",
    "uses_global_direction": "corrections.Corrections(global_direction=True)",
    "control_variates": "corrections.Corrections(control=FromState(read)) or scaffold.OptionII()",
    "momentum_fn": "corrections.FromState(read)",
    "client_prepass": "corrections.Prepass(fn)",
    "prepass_per_client": "corrections.Prepass(per_client=...)",
    "prepass_floats": "corrections.Prepass(floats=...)",
    "server_extra_init": "quantities.ServerQuantities(init, update)",
    "server_extra_update": "quantities.ServerQuantities(init, update)",
    "client_report": "quantities.ClientReport(fn)",
    "report_floats": "quantities.ClientReport(floats=...)",
    "aggregate_delta": "update.ServerUpdate(combine=...)",
    "server_tx": "update.ServerUpdate(tx=...)",
}
# The option values the builders accept (checked against the code below).
OPTION_VALUES = {"client_state": ("reset", "persistent"), "server_rule": ("mean", "partial")}
# ``fed.client_state`` (not under ``fed.options``) is where the clients' states live
# (fedorth.fed.client_store), another key of the same last name.
STORE_VALUES = ("auto", "device", "host", "disk")

_NOT_FIELD = re.compile(r"(?<!\w)(" + "|".join(NOT_FIELDS) + r")(?!\w)")
_OPTION = re.compile(
    r"(?<![\w.])((?:fed\.)?(?:options\.)?)(client_state|server_rule)\s*=\s*[\"']?(\w+)"
)


def python_text(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of a module's strings (docstrings, messages) and comments."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.extend((node.lineno + i, line) for i, line in enumerate(node.value.splitlines()))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            out.append((token.start[0], token.string))
    return out


def option_parameters(source: str) -> set[str]:
    """The keyword parameters of a module's functions."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            out.update(a.arg for a in arguments.args + arguments.kwonlyargs)
    return out


def findings(name: str, lines: list[tuple[int, str]], parameters: set[str] | None) -> list[str]:
    """What in ``lines`` names a field fedorth's FedAlgorithm has not, or a wrong option.

    ``parameters``: the keyword parameters of the module the lines are from (None: a page, whose
    options are checked for their values only).
    """
    out = []
    for number, line in lines:
        for found in _NOT_FIELD.finditer(line):
            what = found.group(1)
            out.append(f"{name}:{number}: {what} -> {NOT_FIELDS[what]}")
        for found in _OPTION.finditer(line):
            prefix, option, value = found.groups()
            if option == "client_state" and "options." not in prefix and value in STORE_VALUES:
                continue  # fed.client_state, the store
            if value not in OPTION_VALUES[option]:
                out.append(
                    f"{name}:{number}: {option}={value!r} is no value of fed.options.{option} "
                    f"{OPTION_VALUES[option]}; name the spec (start.Global(), update.GlobalStep)"
                )
            elif parameters is not None and not prefix and option not in parameters:
                out.append(
                    f"{name}:{number}: {option}={value!r}, and no builder here takes "
                    f"fed.options.{option}; name the spec the builder constructs"
                )
    return out


def python_files() -> list[pathlib.Path]:
    return sorted([*(ROOT / "fedorth").rglob("*.py"), *(ROOT / "configs").rglob("*.py")])


def pages() -> list[pathlib.Path]:
    return sorted(
        [
            ROOT / "README.md",
            ROOT / "benchmarks" / "README.md",
            *(ROOT / "docs").rglob("*.md"),
            *(ROOT / "notebooks").glob("*.md"),
            *(ROOT / "notebooks").glob("*.ipynb"),
        ]
    )


def page_text(path: pathlib.Path) -> str:
    """A page's text; a notebook's cells (markdown and code), not its outputs."""
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])
    return path.read_text()


def test_the_names_are_no_fields_and_the_values_no_options():
    """The scan's lists are what the code says: no spec has a field of those names, no module of
    fedorth defines one, and the builders refuse the other values of the two options."""
    specs = [
        fed.FedAlgorithm,
        start.Reset,
        start.Global,
        start.Persistent,
        corrections.Corrections,
        corrections.FromState,
        corrections.Prepass,
        quantities.ServerQuantities,
        quantities.ClientReport,
        update.ServerUpdate,
    ]
    fields = {f.name for spec in specs for f in dataclasses.fields(spec)}
    assert not fields & set(NOT_FIELDS), fields & set(NOT_FIELDS)
    for path in python_files():
        tree = ast.parse(path.read_text())
        defined = {
            n.name
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        }
        defined |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        defined |= option_parameters(path.read_text())
        assert not defined & set(NOT_FIELDS), (path, defined & set(NOT_FIELDS))
    sgd = {"name": "sgd", "learning_rate": 0.1}
    for value in OPTION_VALUES["client_state"]:
        fed.get_algorithm("fedavg", sgd, client_state=value)
    for value in OPTION_VALUES["server_rule"]:
        fed.get_algorithm("fedavg", sgd, server_rule=value)
    with pytest.raises(ValueError, match=r"fed\.options\.client_state="):
        fed.get_algorithm("fedavg", sgd, client_state="global")
    with pytest.raises(ValueError, match="server_rule"):
        fed.get_algorithm("fedavg", sgd, server_rule="global_step")


def test_the_scan_finds_what_it_forbids():
    lines = [
        (1, 'Engine mapping: client_state="global" with aggregate_mask; a client_prepass.'),
        (2, "``control_variates='momentum'`` with ``momentum_fn``; FedAlgorithm.prepass_floats"),
        (3, 'line 11 is ``server_rule="global_step"``; X_i kept (client_state="persistent")'),
        # Current names: functions whose names contain a removed field's, options, specs.
        (4, "start.Global(mask=fafed_aggregate_mask, keep=fafed_persistent_mask)"),
        (5, "minimax_server_tx; per_client_prepass; fed.options.server_rule='partial'"),
        (6, "fed.options.client_state={client_state!r}; Corrections(prepass=Prepass(fn))"),
    ]
    found = [f.split(": ", 1)[1].split(" ")[0] for f in findings("x", lines, {"server_rule"})]
    assert found == [
        "aggregate_mask",
        "client_prepass",
        "client_state='global'",
        "control_variates",
        "momentum_fn",
        "prepass_floats",
        "server_rule='global_step'",
        "client_state='persistent',",
    ], found
    # Where the module's builders take the option, the bare name is that option.
    assert not findings("x", [(1, 'client_state="persistent"')], {"client_state"})


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_text_names_the_specs_its_code_builds(path):
    source = path.read_text()
    found = findings(str(path.relative_to(ROOT)), python_text(source), option_parameters(source))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_names_the_specs_the_code_builds(path):
    lines = list(enumerate(page_text(path).splitlines(), 1))
    found = findings(str(path.relative_to(ROOT)), lines, None)
    assert not found, "\n".join(found)
