"""The engine's layout stays readable: short modules, short functions, a short round pipeline.

``fedorth/fed/`` is split by job (docs/ARCHITECTURE.md); a module that grows past 400 lines or a
function past 80 is the sign that a job or an axis wants its own module or spec.
"""

import ast
import pathlib

import fedorth.fed

FED = pathlib.Path(fedorth.fed.__file__).parent
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_ROUND_LINES = 400, 80, 150


def _modules():
    return sorted(FED.glob("*.py"))


def _algorithm_modules():
    return sorted((FED / "algorithms").glob("*.py"))


def test_engine_modules_are_short():
    sizes = {p.name: len(p.read_text().splitlines()) for p in _modules()}
    assert sizes["round.py"] < MAX_ROUND_LINES, sizes["round.py"]
    long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def _long_functions(paths) -> dict:
    long = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.name}:{node.name}"] = lines
    return long


def test_engine_functions_are_short():
    long = _long_functions(_modules())
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_algorithm_modules_and_functions_are_short():
    # fedorth/fed/algorithms/ holds the factories; their Optax transforms live in fedorth/optim/.
    paths = _algorithm_modules()
    sizes = {p.name: len(p.read_text().splitlines()) for p in paths}
    long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
    long = _long_functions(paths)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
