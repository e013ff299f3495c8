"""The layout keeps its promises (docs/architecture.md): the check is an engine that imports
no study, packages share only public names, strategies are asked rather than named, and
no module or function grows past what a reader takes in at once.

Read from the source (ast), so a lazy import inside a function counts as much as one at
the top of a module.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "harness"
#: Names of strategies (harness/strategies/): code elsewhere asks their specs instead.
STRATEGY_NAMES = {"local", "ddp", "fsdp", "dp", "dp-emulated"}
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 40
#: Functions allowed past MAX_FUNCTION_LINES, in the whole package.
MAX_LONG_FUNCTIONS = 4
MAX_STRATEGY_COMPARISONS = 5


def modules() -> list[Path]:
    return sorted(HARNESS.rglob("*.py"))


@functools.cache
def tree(path: Path) -> ast.Module:
    """The module's syntax tree, parsed once for every test here (none changes it)."""
    return ast.parse(path.read_text(), filename=str(path))


def package(path: Path) -> str:
    """The dotted package a module belongs to (a package's __init__: the package itself)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1])


def imported(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from harness... import name`` in the file; ``import x``
    gives (x, "")."""
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return found


def module_package(module: str) -> str:
    """The package of a dotted module name (a package itself where it is a folder)."""
    if (ROOT / module.replace(".", "/")).is_dir():
        return module
    return module.rsplit(".", 1)[0]


def test_the_check_engine_imports_no_study():
    importing = [(str(path.relative_to(ROOT)), module)
                 for path in (HARNESS / "check").rglob("*.py")
                 for module, _ in imported(path) if module.startswith("harness.studies")]
    assert importing == []


def test_packages_share_public_names_only():
    private = [(str(path.relative_to(ROOT)), module, name) for path in modules()
               for module, name in imported(path)
               if module.startswith("harness") and name.startswith("_")
               and module_package(module) != package(path)]
    assert private == []


def test_nothing_is_looked_up_by_name_in_globals():
    lookups = [str(path.relative_to(ROOT)) for path in modules() for node in ast.walk(tree(path))
               if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call)
               and getattr(node.value.func, "id", "") == "globals"]
    assert lookups == []


def _strings(node: ast.AST) -> list[str]:
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [item.value for item in items
            if isinstance(item, ast.Constant) and isinstance(item.value, str)]


def test_code_outside_the_strategies_asks_their_specs_rather_than_naming_them():
    comparisons = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in modules()
                   if "strategies" not in path.relative_to(HARNESS).parts
                   for node in ast.walk(tree(path)) if isinstance(node, ast.Compare)
                   and STRATEGY_NAMES & {s for part in (node.left, *node.comparators)
                                         for s in _strings(part)}]
    assert len(comparisons) <= MAX_STRATEGY_COMPARISONS, comparisons


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(HARNESS)))
def test_no_module_is_longer_than_a_reader_takes_in(path):
    assert path.read_text().count("\n") <= MAX_FILE_LINES


def test_few_functions_are_long():
    long = [f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1})"
            for path in modules() for node in ast.walk(tree(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert len(long) <= MAX_LONG_FUNCTIONS, long
