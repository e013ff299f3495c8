"""README.md and docs/ kept true: every part of them that states a schema or a measured
number is generated, from the schema declarations and from a results folder.

A generated part sits between two markers, ``<!-- generated: NAME -->`` and
``<!-- end: NAME -->``; the text around it is written by hand. ``refresh`` fills
every part it knows and leaves the rest alone, so a second run changes nothing.
A sentence that states a verdict first checks that the rows still show it: where
they do not, generation stops with :class:`Unsupported`, naming the sentence and
the rows, instead of writing a claim the results no longer make.

Reads CSVs and JSON (no torch), like the report, but for the list of the check's causes,
which it reads from their declarations. Imports no study: the studies' columns and parts
come in a catalogue (:mod:`harness.report.catalogue`) that ``scripts/docs.py`` hands to
:func:`main`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from harness.columns import LEADING_COLUMNS, TRAILING_COLUMNS, Column, Table
from harness.report.quoted import DocPart, Results, Unsupported, require
from harness.report.text import code, table

if TYPE_CHECKING:
    from harness.report.catalogue import Catalogue

__all__ = ["DOCUMENTS", "Results", "Unsupported", "main", "parts", "refresh", "require",
           "stale"]

#: The files with generated parts, relative to the repository root.
DOCUMENTS = ("README.md", "docs/results.md", "docs/speed.md")
PART = re.compile(r"(?P<open><!-- generated: (?P<name>[\w:.-]+) -->\n)(?P<body>.*?)"
                  r"(?P<close><!-- end: (?P=name) -->)", re.DOTALL)


# ---------------------------------------------------------------- column tables
def column_table(columns: Sequence[Column]) -> str:
    return table(["column", "unit / values", "meaning"],
                 [[code(c.name), c.unit, c.doc] for c in columns], [False] * 3)


def tables_text(tables: Sequence[Table]) -> str:
    """One study's column tables: its one CSV's, or each CSV's under its name and rows."""
    if len(tables) == 1:
        return column_table(tables[0].columns)
    return "\n\n".join(f"`{table.csv}`: {table.doc}\n\n{column_table(table.columns)}"
                       for table in tables)


def schema_parts(catalogue: Catalogue) -> dict[str, DocPart]:
    """``columns:common``, ``columns:<study>`` for every study, ``columns:check``,
    ``columns:script``."""
    parts: dict[str, DocPart] = {
        "columns:common": lambda _: column_table((*LEADING_COLUMNS, *TRAILING_COLUMNS))}
    for name, study in catalogue.items():
        parts[f"columns:{name}"] = lambda _, study=study: tables_text(study.tables)
    parts["columns:check"] = lambda _: column_table(_check_columns())
    parts["columns:script"] = lambda _: column_table(_script_columns())
    parts["causes"] = lambda _: causes_table()
    return parts


def causes_table() -> str:
    """Every cause a judged row's ``cause`` column may name, in the judge's order, then the
    judge's own rules (the one place that reads the check's engine: its causes' ids and
    summaries are declared in their modules)."""
    from harness.check.causes import CAUSES, JUDGE_RULES

    return table(["cause", "what it says happened"],
                 [[code(cause.id), cause.summary] for cause in (*CAUSES, *JUDGE_RULES)],
                 [False, False])


def _check_columns() -> tuple[Column, ...]:
    from harness.grad_check.schema import COLUMNS
    return COLUMNS


def _script_columns() -> tuple[Column, ...]:
    from harness.grad_check.script.schema import COLUMNS
    return COLUMNS


# ---------------------------------------------------------------- the studies' parts
def study_parts(catalogue: Catalogue) -> dict[str, DocPart]:
    """Every study's own generated parts (its report module's ``DOC_PARTS``), and
    ``answers``, the README's list of them."""
    parts = {name: part for study in catalogue.values()
             for name, part in study.doc_parts.items()}
    return {**parts, "answers": lambda results: answers(results, catalogue)}


def answers(results: Results, catalogue: Catalogue) -> str:
    """The README's answers: one bullet per ``answer:`` part of the studies, in study order."""
    return "\n".join(f"- {part(results)}" for study in catalogue.values()
                     for name, part in study.doc_parts.items() if name.startswith("answer:"))


# ---------------------------------------------------------------- run times
def run_line(results: Results) -> str:
    """What the default run is, from its run.json."""
    run = results.manifest()
    cases = sum(s.cases for s in run.studies.values())
    studies = len(run.studies)
    context = ", ".join(str(run.value(key)) for key in ("backend", "device", "dtype"))
    wrote = f"{studies} {'study' if studies == 1 else 'studies'}, {cases} cases"
    return (f"`results/` holds what `{run.command}` wrote: {wrote}, {run.wall_time_s:.1f} s "
            f"in all on {run.value('launch_world_size')} ranks ({context}, torch "
            f"{run.value('torch_version')}).")


def times(results: Results) -> str:
    """Every study's cases and wall time: the default run's, the frameworks and the trainers
    runs'."""
    body = []
    for sub in ("", "frameworks", "trainers"):
        run = results.manifest(sub)
        for study, entry in run.studies.items():
            body.append([code(study), str(entry.cases), f"{entry.wall_time_s:.1f} s",
                         code(run.command)])
        # The run as its run.json times it, besides the studies alone.
        body.append(["the whole run", str(sum(e.cases for e in run.studies.values())),
                     f"{run.wall_time_s:.1f} s", code(run.command)])
    return table(["study", "cases", "wall time", "run"], body, [False, True, True, False])


def result_parts() -> dict[str, DocPart]:
    return {"run": run_line, "times": times}


def example_parts(root: Path) -> dict[str, DocPart]:
    """``example:<name>``: ``examples/<name>.py`` quoted whole, so that the quote is the file
    a test runs."""
    return {f"example:{path.stem}": lambda _, path=path: f"```python\n{path.read_text()}```"
            for path in sorted((root / "examples").glob("*.py")) if path.stem != "__init__"}


# ---------------------------------------------------------------- refreshing
def parts(root: Path, catalogue: Catalogue) -> dict[str, DocPart]:
    return {**schema_parts(catalogue), **study_parts(catalogue), **result_parts(),
            **example_parts(root)}


def refresh(text: str, results: Results, known: dict[str, DocPart]) -> str:
    """``text`` with every generated part it holds filled in anew; an unknown name is an
    error (a typo would otherwise leave a part stale forever)."""
    made: dict[str, str] = {}

    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in known:
            raise Unsupported(f"no generated part is called {name!r}; known: "
                              f"{', '.join(sorted(known))}")
        if name not in made:
            made[name] = known[name](results).rstrip("\n") + "\n"
        return match["open"] + made[name] + match["close"]

    return PART.sub(fill, text)


def stale(root: Path, results: Results, catalogue: Catalogue) -> dict[Path, str]:
    """Each document whose generated parts differ from what the results give: its new text."""
    known, changed = parts(root, catalogue), {}
    for name in DOCUMENTS:
        path = root / name
        text = path.read_text()
        new = refresh(text, results, known)
        if new != text:
            changed[path] = new
    return changed


# ---------------------------------------------------------------- command line
PROG = "docs.py"


def main(catalogue: Catalogue, argv: Sequence[str] | None = None) -> int:
    """Rewrite the generated parts of README.md and docs/ from ``catalogue`` (the studies')
    and the results (or, with --check, only say which are out of date: exit 1)."""
    from harness.errors import UsageError, refuse

    try:
        args = _parser().parse_args(argv)
        root, folder = Path(args.root), Path(args.results)
        _require_documents(root, folder)
        changed = stale(root, Results(folder), catalogue)
    except UsageError as error:
        return refuse(error, rank=0, prog=PROG)
    except Unsupported as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    names = ", ".join(str(p.relative_to(root)) for p in changed)
    if args.check:
        print(f"{PROG}: out of date: {names}; run python scripts/docs.py" if changed else
              f"{PROG}: up to date")
        return 1 if changed else 0
    for path, text in changed.items():
        path.write_text(text)
    print(f"{PROG}: wrote {names}" if changed else f"{PROG}: up to date, nothing written")
    return 0


def _parser():
    import argparse

    from harness.options import CommandParser

    parser = CommandParser(prog=PROG, description=(
        "Fill the generated parts of README.md, docs/results.md and docs/speed.md from the "
        "schema declarations and a results folder (run.json and CSVs, with frameworks/ "
        "inside). Rerun after regenerating the results or changing a study's columns."),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="results", metavar="FOLDER",
                        help="results folder to quote (default: results)")
    parser.add_argument("--root", default=".", metavar="DIR",
                        help="repository root holding README.md and docs/ (default: .)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a document is out of date")
    return parser


def _require_documents(root: Path, folder: Path) -> None:
    """UsageError unless ``root`` holds the documents and ``folder`` both runs' manifests."""
    from harness.errors import UsageError

    missing = [str(p) for p in (*(root / d for d in DOCUMENTS), folder / "run.json",
                                folder / "frameworks" / "run.json",
                                folder / "trainers" / "run.json") if not p.is_file()]
    if missing:
        raise UsageError(f"missing {', '.join(missing)}: --root must be the repository "
                         f"and --results a finished run with frameworks/ and trainers/ "
                         f"inside")
