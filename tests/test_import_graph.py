"""fedorth's modules, and the entry points of ``experiments/``, import each other along an
acyclic graph: the ``fedorth`` command (``fedorth.cli``) runs the entry points, which import the
package's modules (the configs' catalog among them), never the command back.

Every import of a ``fedorth`` module counts, those inside a function too: an import moved into a
function hides a cycle from Python's import machinery, it does not remove it (each module of the
pair still needs the other, and neither can be read, tested or moved alone). A piece two modules
share lives in the one that owns it, and the other imports it from there.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The one recursion by design: the ``auc`` model wraps any model of the registry that lists it
# (``auc(base="rnn")`` builds its base through ``fedorth.models.get_model``).
BY_DESIGN = {("fedorth.models.auc", "fedorth.models")}


PACKAGES = ("fedorth", "experiments")


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of the packages under ``root``."""
    out = {}
    paths = [p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))]
    for path in paths:
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _module_of(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The module ``name`` lives in: itself, or its longest prefix that is a module."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ``PACKAGES`` it imports, anywhere in its file."""
    known = modules(root)
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(_module_of(a.name, known) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:  # `from fedorth.train import builders`: a module
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in known else _module_of(base, known))
        graph[name] = {d for d in deps if d and d.startswith(PACKAGES) and d != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (``[a, b, ..., a]``), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_check_finds_a_lazy_cycle(tmp_path):
    package = tmp_path / "fedorth"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from fedorth import b\n")
    (package / "b.py").write_text("def f():\n    from fedorth.a import x\n")
    (package / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph == {
        "fedorth": set(),
        "fedorth.a": {"fedorth.b"},
        "fedorth.b": {"fedorth.a"},
        "fedorth.c": {"fedorth.a"},
    }, graph
    assert cycle(graph) == ["fedorth.a", "fedorth.b", "fedorth.a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_fedorth_imports_along_an_acyclic_graph():
    graph = import_graph()
    assert {
        "fedorth.train.builders",
        "fedorth.train.validate",
        "fedorth.models.auc",
        "fedorth.cli",
        "experiments.main",
        "experiments.sweep",
    } <= set(graph)
    assert "experiments.main" in graph["fedorth.cli"], "the command runs the entry points"
    for module, dep in BY_DESIGN:
        assert dep in graph[module], f"{module} no longer imports {dep}: drop it from BY_DESIGN"
        graph[module] = graph[module] - {dep}
    found = cycle(graph)
    assert found is None, (
        f"import cycle {' -> '.join(found)}: move the piece they share into the module that owns it"
    )


def test_config_error_is_one_class_wherever_it_is_imported_from():
    """The builders and the config checks raise one ``ConfigError``: what catches
    ``fedorth.train.ConfigError`` (the command line's exit code 2) catches both."""
    from fedorth import train
    from fedorth.train import builders, validate

    assert train.ConfigError is validate.ConfigError is builders.ConfigError
    assert issubclass(builders.ConfigError, ValueError)
