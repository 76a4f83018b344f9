"""The tree's architecture: no import cycles, scripts import library code and never each other."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "common", "dataset", "trainer", "evaluation", "benchmarks", "scripts")
ENTRY_POINTS = ("scripts", "benchmarks")  # command-line programs, like the trainer's stage scripts


def module_names():
    """{dotted module name: path} of every Python file in the repo's packages."""
    names = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name, path, known):
    """The repo modules that module `name` imports anywhere in its body (lazy imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph():
    known = module_names()
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def test_the_import_graph_has_no_cycle(graph):
    state = {}  # name -> "open" while on the DFS stack, "done" after

    def visit(name, stack):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, stack + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def is_program(name):
    """Scripts, benchmarks and the trainer's stage scripts: run, never imported."""
    return name.split(".")[0] in ENTRY_POINTS or name.startswith("trainer.train_")


SHARED_BENCHMARK_CODE = ("benchmarks.common", "benchmarks.flex_cores")


def allowed_import(target):
    """Programs are never imported; benchmarks share only their library modules."""
    return not is_program(target) or target in SHARED_BENCHMARK_CODE


@pytest.mark.parametrize("package", PACKAGES)
def test_programs_are_never_imported(graph, package):
    for name, targets in graph.items():
        if name.split(".")[0] == package:
            wrong = sorted(t for t in targets if not allowed_import(t))
            assert not wrong, f"{name} imports {wrong}: code imports library code, never a script"


def test_every_module_imports_in_a_fresh_interpreter():
    names = list(module_names())
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
