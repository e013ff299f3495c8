"""The layout keeps its promises (docs/architecture.md): the check is an engine that imports
no study, the report imports no study either (the studies import its vocabulary), harness's
top-level packages and modules import one another one way only, packages share only public
names, strategies are asked rather than named, and no module or function grows past what a
reader takes in at once.

Read from the source (ast), so a lazy import inside a function or one under TYPE_CHECKING
counts as much as one at the top of a module.
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
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 40
#: Functions allowed past MAX_FUNCTION_LINES, in the whole package.
MAX_LONG_FUNCTIONS = 2
MAX_STRATEGY_COMPARISONS = 5


def modules() -> list[Path]:
    return sorted(HARNESS.rglob("*.py"))


@functools.cache
def tree(path: Path) -> ast.Module:
    """The module's syntax tree, parsed once for every test here (none changes it)."""
    return ast.parse(path.read_text(), filename=str(path))


@functools.cache
def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of the module's tree, walked once for every test here."""
    return tuple(ast.walk(tree(path)))


def package(path: Path) -> str:
    """The dotted package a module belongs to (a package's __init__: the package itself)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1])


def imported(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from harness... import name`` in the file; ``import x``
    gives (x, "")."""
    found = []
    for node in nodes(path):
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


def unit(module: str) -> str | None:
    """The top-level package or module of harness a dotted module name belongs to: ``report``
    for ``harness.report.spec``, ``columns`` for ``harness.columns``; None outside harness."""
    parts = module.split(".")
    if parts[0] != "harness" or len(parts) < 2:
        return None
    return parts[1]


def unit_of(path: Path) -> str:
    """The top-level package (a folder directly under harness/) or module (a .py directly
    under harness/) a file of harness belongs to."""
    return path.relative_to(HARNESS).parts[0].removesuffix(".py")


def imported_units(path: Path) -> set[str]:
    """The top-level packages and modules of harness the file imports, at the top, inside a
    function or under TYPE_CHECKING alike (``from harness import columns`` names ``columns``)."""
    found = set()
    for module, name in imported(path):
        if module == "harness" and name:
            found.add(name)
        elif (named := unit(module)) is not None:
            found.add(named)
    return found


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """Each top-level package and module of harness -> those it imports (itself left out)."""
    graph: dict[str, set[str]] = {}
    for path in modules():
        if path.parent == HARNESS and path.name == "__init__.py":
            continue  # harness itself: its __init__ holds the version, and imports nothing
        source = unit_of(path)
        graph.setdefault(source, set()).update(imported_units(path) - {source})
    return {source: frozenset(targets) for source, targets in graph.items()}


def reachable(graph: dict[str, frozenset[str]], start: str) -> set[str]:
    """The units ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def import_cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The groups of units that import one another, each sorted: the units each unit of a
    cycle reaches and is reached from."""
    reach = {source: reachable(graph, source) for source in graph}
    return sorted({tuple(sorted(other for other in reach[source] if source in reach[other]))
                   for source in graph if source in reach[source]})


def test_an_import_cycle_is_found_whatever_its_length():
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a", "d"}),
             "d": frozenset(), "e": frozenset({"e"})}
    assert import_cycles(graph) == [("a", "b", "c"), ("e",)]
    assert import_cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_harness_top_level_packages_and_modules_import_one_another_one_way():
    assert import_cycles(import_graph()) == []


def module_file(module: str, name: str = "") -> Path | None:
    """The file of harness that ``from module import name`` (or ``import module``) runs: a
    submodule called ``name``, else the module itself (None outside harness)."""
    base = ROOT / module.replace(".", "/")
    candidates = [base / f"{name}.py", base / name / "__init__.py"] if name else []
    candidates += [base.with_suffix(".py"), base / "__init__.py"]
    return next((path for path in candidates if path.is_file()), None)


@functools.cache
def file_graph() -> dict[str, frozenset[str]]:
    """Each file of harness -> the files of harness it imports, at the top, inside a
    function or under TYPE_CHECKING alike (an annotation names what it depends on)."""
    graph = {}
    for path in modules():
        found = set()
        for node in nodes(path):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness"):
                found |= {module_file(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {module_file(alias.name) for alias in node.names
                          if alias.name.startswith("harness")}
        graph[str(path.relative_to(ROOT))] = frozenset(
            str(target.relative_to(ROOT)) for target in found - {None, path})
    return graph


def test_no_file_of_harness_is_in_an_import_cycle():
    """Packages import one another one way; so do files, within a package too (a rank's
    guard and its capture, the check's command line and its --frameworks front-end, the
    capture and the functions it wraps, which know it by its events: events.py)."""
    assert "harness/grad_check/script/guard.py" in file_graph()[
        "harness/grad_check/script/installed.py"]
    assert import_cycles(file_graph()) == []


def test_the_launcher_side_of_script_mode_imports_none_of_the_rank_side():
    """grad-check run's launcher and the ranks meet at wire.py alone: what the launcher
    runs reaches no module that only a rank loads (the capture, the guard, what they wrap)."""
    script = "harness/grad_check/script/"
    launcher = {f"{script}{name}.py" for name in ("grad_check_run", "runs", "processes")}
    rank_side = {f"{script}{name}.py" for name in ("capture", "guard", "installed", "wrappers",
                                                    "engines", "points", "ending")}
    reached = set().union(*(reachable(file_graph(), path) for path in launcher))
    assert f"{script}wire.py" in reached
    assert reached & rank_side == set()


#: The check's front-ends (harness/grad_check/): the Setup matrix and its API,
#: --frameworks, grad-check run, the command line. The engine is a sink below them.
FRONT_ENDS = {"grad_check"}


def test_the_check_engine_imports_no_front_end_and_no_study():
    graph = import_graph()
    assert not (reachable(graph, "check") & (FRONT_ENDS | {"studies", "strategies",
                                                            "adapters", "report"}))


def strings_in(path: Path) -> list[tuple[int, str]]:
    """Every string constant of the module, with its line, but its docstrings and the
    names of columns it reads (``row["error"]``, ``row.get("error")``)."""
    walked = nodes(path)
    docstrings = {id(node.body[0].value) for node in walked
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    columns = {id(node.slice) for node in walked if isinstance(node, ast.Subscript)}
    columns |= {id(node.args[0]) for node in walked if isinstance(node, ast.Call) and node.args
                and isinstance(node.func, ast.Attribute) and node.func.attr == "get"}
    return [(node.lineno, node.value) for node in walked
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings | columns]


#: The code that judges a step against its big batch, and its front-ends' rows.
JUDGING = ("check", "grad_check", "adapters")


def judging_modules() -> list[Path]:
    return [path for path in modules()
            if path.relative_to(HARNESS).parts[0] in JUDGING]


def test_one_place_builds_a_judged_row():
    """A row's verdict cell is written in harness/check/judge.py alone (from the shared
    columns' declarations): no front-end spells a judged row out by hand."""
    keyed = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in judging_modules()
             for node in nodes(path) if isinstance(node, ast.Dict)
             and any(isinstance(key, ast.Constant) and key.value == "verdict"
                     for key in node.keys)]
    assert keyed == []


def test_verdicts_and_statuses_are_spelled_by_their_enums():
    """verdicts.py promises that a typo in a verdict is an AttributeError: no judging code
    writes a verdict's or a status's words as a string."""
    from harness.verdicts import Equivalence, Status

    words = {str(member) for member in (*Equivalence, *Status)}
    spelled = [f"{path.relative_to(ROOT)}:{line} {value!r}" for path in judging_modules()
               for line, value in strings_in(path) if value in words]
    assert spelled == []


def test_each_verdict_and_status_is_declared_once_with_its_meaning():
    """Every judged CSV's ``verdict`` and ``status`` columns are the shared ones, whose
    meanings come from harness/verdicts.py; a schema that describes them in its own words is
    refused (they drifted apart when each front-end did)."""
    from harness import columns
    from harness.adapters.columns import COLUMNS as FRAMEWORKS
    from harness.grad_check.schema import COLUMNS as CHECK
    from harness.grad_check.script.schema import COLUMNS as SCRIPT
    from harness.verdicts import Equivalence, Status

    assert all(member.meaning for member in (*Equivalence, *Status))
    for schema in (CHECK, SCRIPT, FRAMEWORKS):
        by_name = {column.name: column for column in schema}
        assert by_name["status"] == columns.STATUS and by_name["verdict"] == columns.VERDICT
    for member in Status:
        assert f"`{member}`: {member.meaning}" in columns.STATUS.doc
    with pytest.raises(ValueError, match="declared once"):
        columns.judged_columns(status="`ok`, or `error`")


@functools.cache
def definitions() -> dict[str, list[str]]:
    """Every name a module of harness defines (a function, a class, an assignment) -> the
    modules that define it."""
    found: dict[str, list[str]] = {}
    for path in modules():
        for node in nodes(path):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found.setdefault(target.id, []).append(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("name", ["POINTS", "full_precision_decides", "at_full_precision",
                                  "dtype_name", "CLIPPED_ALIKE", "judge_step", "judged_row"])
def test_each_rule_is_defined_once(name):
    assert len(definitions().get(name, [])) == 1, definitions().get(name)


def test_the_report_imports_no_study_and_is_in_no_cycle_with_the_studies():
    """The studies declare their sections in the report's vocabulary; the report gets the
    studies' catalogue from its callers (runner.py, grad_report.py, scripts/docs.py)."""
    graph = import_graph()
    assert "report" in graph["studies"]
    assert "studies" not in reachable(graph, "report")
    assert not any({"report", "studies"} <= set(group) for group in import_cycles(graph))


def test_packages_share_public_names_only():
    private = [(str(path.relative_to(ROOT)), module, name) for path in modules()
               for module, name in imported(path)
               if module.startswith("harness") and name.startswith("_")
               and module_package(module) != package(path)]
    assert private == []


def test_nothing_is_looked_up_by_name_in_globals():
    lookups = [str(path.relative_to(ROOT)) for path in modules() for node in nodes(path)
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
                   for node in nodes(path) if isinstance(node, ast.Compare)
                   and STRATEGY_NAMES & {s for part in (node.left, *node.comparators)
                                         for s in _strings(part)}]
    assert len(comparisons) <= MAX_STRATEGY_COMPARISONS, comparisons


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(HARNESS)))
def test_no_module_is_longer_than_a_reader_takes_in(path):
    assert path.read_text().count("\n") <= MAX_FILE_LINES


def test_few_functions_are_long():
    long = [f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1})"
            for path in modules() for node in nodes(path)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert len(long) <= MAX_LONG_FUNCTIONS, long
