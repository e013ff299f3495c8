"""Compare two results folders of scripts/study.py cell by cell: do their findings agree?

    python scripts/compare.py results/ /tmp/rerun
    python scripts/compare.py results/ /tmp/rerun --studies reduction,seed001

The rules are :func:`rules` (the ``--help`` text); each is one function:
rows are matched by :func:`keyed`, a column's kind is :func:`column_kind`
(timing columns: :func:`is_timing`), two cells are judged by :func:`cells_agree`.
Each folder's run.json and CSVs are read by :class:`ResultsFolder`
(harness/results_folder.py).
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.context import CONTEXT_COLUMNS
from harness.errors import USAGE_EXIT, UsageError
from harness.options import CommandParser
from harness.results_folder import ResultsFolder

PROG = "compare.py"
#: Difference lines printed at most; the counts below them cover the rest.
MAX_SHOWN = 20
#: Characters of a value shown in the table of differences.
VALUE_WIDTH = 24

#: A column is timing when its name ends in one of these (a duration in seconds,
#: milliseconds or microseconds) ...
TIMING_SUFFIXES = ("_s", "_ms", "_us")
#: ... or has one of these words between its underscores (``wall_time``, ``algbw_GBps``).
TIMING_WORDS = frozenset({"time", "algbw", "busbw"})


def rules() -> str:
    """The rules in words, from the constants that implement them (the ``--help`` text)."""
    from harness.tolerances import COLUMN_TOLERANCES, RELATIVE_TOLERANCE

    tolerances = ", ".join(f"{rtol:g} for {dtype}" for dtype, rtol in RELATIVE_TOLERANCE.items())
    declared = ", ".join(f"{study}.{column} ±{tolerance:.3g}"
                         for (study, column), tolerance in COLUMN_TOLERANCES.items())
    paragraphs = [
        "For every study both folders ran, rows are matched by case_id and by their position "
        "among the rows of that case (several studies write several rows per case: one per "
        "iteration, epoch, variant, parameter, event, ...), over every CSV of the study (a "
        "study may write several, e.g. one per experiment). Each cell present on both sides "
        "is judged by its column:",
        f"- timing columns (names ending in {', '.join(TIMING_SUFFIXES)}, or with the word "
        f"{', '.join(sorted(TIMING_WORDS))} between underscores, e.g. wall_time, time_s, "
        "busbw_GBps): measured durations and rates, which vary from run to run: ignored;",
        f"- run-context columns ({', '.join(CONTEXT_COLUMNS)}): shown side by side, never a "
        "disagreement;",
        "- every other cell: two numbers agree within the relative tolerance of the runs' "
        f"dtype (harness/tolerances.py, the one the verdicts were judged with: {tolerances}; "
        "the looser one if the dtypes differ; both empty or both NaN agree), or within the "
        f"absolute tolerance declared for a column whose value may move between CPUs (a "
        f"count by one unit, a float32 or bfloat16 rounding error by another rounding: "
        f"{declared or 'none'}); anything else (verdicts, status, booleans, text) must be the "
        "same text.",
        "A row only one folder has is a difference too (a case measured on one side only), "
        "unless --common-rows: then it is counted, not compared. The run.json settings and "
        f"run context are shown side by side, not judged. At most {MAX_SHOWN} differences are "
        "listed (--all: every one), then the counts.",
        "Exit code: 0 when the findings agree, 1 when they do not, 2 for bad input (a folder "
        "that is not a results folder, an unreadable run.json or CSV, no study in common), "
        "with one line naming it.",
    ]
    return "\n\n".join(textwrap.fill(p, 79, subsequent_indent="  " if p[0] == "-" else "")
                       for p in paragraphs)


def is_timing(column: str) -> bool:
    """True for a measured duration or rate: it varies from run to run, so it is ignored."""
    name = column.lower()
    return name.endswith(TIMING_SUFFIXES) or bool(TIMING_WORDS & set(name.split("_")))


def column_kind(column: str) -> str:
    """``timing`` (ignored), ``context`` (shown, not judged) or ``judged``."""
    if column in CONTEXT_COLUMNS:
        return "context"
    if is_timing(column):
        return "timing"
    return "judged"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def cells_agree(a: str, b: str, rtol: float, absolute: float = 0.0) -> bool:
    """Two CSV cells agree: equal text, or two numbers within ``rtol`` (harness.tolerances'
    ``close``) or within ``absolute`` (a column's declared tolerance), NaN (or empty) on
    both sides counting as equal."""
    from harness.tolerances import close

    if a == b:
        return True
    x, y = _number(a) if a else math.nan, _number(b) if b else math.nan
    if x is None or y is None:
        return False
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if math.isinf(x) or math.isinf(y):
        return x == y
    return close(x, y, rtol) or abs(x - y) <= absolute


# ---------------------------------------------------------------- comparing
@dataclass(frozen=True)
class Difference:
    """One judged cell (or a row) that disagrees."""

    study: str
    case_id: str
    column: str
    a: str
    b: str


@dataclass
class FolderComparison:
    """Everything two folders disagree on, and how much was compared."""

    studies: list[str]
    rtol: float
    differences: list[Difference] = field(default_factory=list)
    rows_matched: int = 0
    cells_judged: int = 0
    timing_columns: set[str] = field(default_factory=set)
    #: Context cells that differ, as (column, A value, B value), once each.
    context: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: Columns only one side has: (study, column, side).
    schema: list[tuple[str, str, str]] = field(default_factory=list)
    #: Declared absolute tolerances applied, by (study, column).
    declared: dict[tuple[str, str], float] = field(default_factory=dict)
    #: ``--common-rows``: a row only one side has is counted here (by side), not a difference
    #: (a quick form's rows against the full run's).
    common_rows: bool = False
    only_in: Counter = field(default_factory=Counter)

    @property
    def agree(self) -> bool:
        return not self.differences


def keyed(rows: list[dict[str, str]]) -> dict[tuple[str, int], dict[str, str]]:
    """Rows by (case_id, position among the rows of that case)."""
    positions: dict[str, int] = {}
    result = {}
    for row in rows:
        position = positions.get(row["case_id"], 0)
        positions[row["case_id"]] = position + 1
        result[(row["case_id"], position)] = row
    return result


def _row_label(key: tuple[str, int], rows_in_case: int) -> str:
    """The case_id, and the row's position when its case has several rows."""
    case_id, position = key
    return case_id if rows_in_case == 1 else f"{case_id} [row {position + 1}]"


def compare_study(study: str, a: ResultsFolder, b: ResultsFolder, into: FolderComparison) -> None:
    """Add ``study``'s differences between ``a`` and ``b`` to ``into``."""
    from harness.tolerances import column_tolerance

    columns_a, rows_a = a.rows(study)
    columns_b, rows_b = b.rows(study)
    shared = [c for c in columns_a if c in columns_b and c not in ("study", "case_id")]
    into.schema += [(study, c, "A") for c in columns_a if c not in columns_b]
    into.schema += [(study, c, "B") for c in columns_b if c not in columns_a]
    into.timing_columns |= {c for c in shared if column_kind(c) == "timing"}
    judged = [c for c in shared if column_kind(c) == "judged"]
    absolute = {c: column_tolerance(study, c) for c in judged}
    into.declared |= {(study, c): tolerance for c, tolerance in absolute.items() if tolerance}
    context = [c for c in shared if column_kind(c) == "context"]
    left, right = keyed(rows_a), keyed(rows_b)
    rows_in_case = Counter(case_id for case_id, _ in {**left, **right})
    for key in {**left, **right}:
        label = _row_label(key, rows_in_case[key[0]])
        if into.common_rows and (key not in left or key not in right):
            into.only_in["A" if key in left else "B"] += 1
            continue
        if key not in left or key not in right:
            into.differences.append(Difference(
                study, label, "(row)", "present" if key in left else "absent",
                "present" if key in right else "absent"))
            continue
        into.rows_matched += 1
        # A study that writes several CSVs: a row has its own CSV's columns only.
        both = [c for c in shared if c in left[key] and c in right[key]]
        for column in (c for c in both if c in context):
            cells = (column, left[key][column], right[key][column])
            if cells[1] != cells[2]:
                into.context[cells] = into.context.get(cells, 0) + 1
        for column in (c for c in both if c in absolute):
            into.cells_judged += 1
            x, y = left[key][column], right[key][column]
            if not cells_agree(x, y, into.rtol, absolute[column]):
                into.differences.append(Difference(study, label, column, x, y))


def tolerance_for(a: ResultsFolder, b: ResultsFolder) -> float:
    """The relative tolerance of the runs' dtype (the looser one if they differ)."""
    from harness.tolerances import RELATIVE_TOLERANCE

    tolerances = []
    for folder in (a, b):
        if folder.dtype not in RELATIVE_TOLERANCE:
            raise UsageError(f"{folder.path / 'run.json'}: dtype {folder.dtype!r} is unknown; "
                             f"allowed: {', '.join(RELATIVE_TOLERANCE)}")
        tolerances.append(RELATIVE_TOLERANCE[folder.dtype])
    return max(tolerances)


def studies_to_compare(a: ResultsFolder, b: ResultsFolder, asked: str | None) -> list[str]:
    """The studies both folders ran (in A's order), or those of ``--studies``."""
    common = [s for s in a.studies if s in b.studies]
    if not common:
        raise UsageError(f"no study in common: {a.path} has {', '.join(a.studies)}; "
                         f"{b.path} has {', '.join(b.studies)}")
    if asked is None:
        return common
    names = [name.strip() for name in asked.split(",")]
    for name in names:
        if name not in common:
            raise UsageError(f"--studies: {name!r} is not in both folders; "
                             f"allowed: {', '.join(common)}")
    return list(dict.fromkeys(names))


def compare_folders(a: ResultsFolder, b: ResultsFolder, studies: Sequence[str],
                    common_rows: bool = False) -> FolderComparison:
    comparison = FolderComparison(studies=list(studies), rtol=tolerance_for(a, b),
                                  common_rows=common_rows)
    for study in studies:
        compare_study(study, a, b, comparison)
    return comparison


# ---------------------------------------------------------------- printing
def _cell(value: Any, width: int = VALUE_WIDTH) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= width else text[:width - 1] + "…"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    return [line.format(*headers).rstrip(), *(line.format(*r).rstrip() for r in rows)]


def _side_by_side(title: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ, A next to B; nothing when they all agree."""
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    if not keys:
        return []
    rows = [[k, _cell(a.get(k, "(absent)")), _cell(b.get(k, "(absent)"))] for k in keys]
    return ["", f"{title} (shown, not judged):", *_table(["", "A", "B"], rows)]


def report(a: ResultsFolder, b: ResultsFolder, comparison: FolderComparison,
           every: bool = False) -> str:
    """The comparison as printed: the first :data:`MAX_SHOWN` differences, or ``every``
    one (``--all``)."""
    lines = [f"A = {a.path}", f"B = {b.path}"]
    lines += _side_by_side("run.json settings that differ", a.settings(), b.settings())
    lines += _side_by_side("run context", a.facts(), b.facts())
    if comparison.context:
        rows = [[column, _cell(x), _cell(y), str(n)]
                for (column, x, y), n in comparison.context.items()]
        lines += ["", "context columns that differ in the CSVs (shown, not judged):",
                  *_table(["column", "A", "B", "rows"], rows)]
    if comparison.schema:
        rows = [[study, column, f"only in {side}"] for study, column, side in comparison.schema]
        lines += ["", "columns only one side has (not compared):",
                  *_table(["study", "column", ""], rows)]
    if comparison.differences:
        shown = comparison.differences if every else comparison.differences[:MAX_SHOWN]
        rows = [[d.study, d.case_id, d.column, _cell(d.a), _cell(d.b)] for d in shown]
        lines += ["", "differences:", *_table(["study", "case_id", "column", "A", "B"], rows)]
        if len(comparison.differences) > len(shown):
            lines.append(f"... and {len(comparison.differences) - len(shown)} more "
                         "(--all lists every one)")
    if comparison.only_in:
        lines += ["", "rows only one side has (--common-rows: not compared): " + ", ".join(
            f"{count} only in {side}" for side, count in sorted(comparison.only_in.items()))]
    lines += ["", _counts(comparison), _verdict(comparison)]
    return "\n".join(lines)


def _counts(comparison: FolderComparison) -> str:
    timing = ", ".join(sorted(comparison.timing_columns)) or "none"
    declared = "".join(f", {study}.{column} within ±{tolerance:.3g}"
                       for (study, column), tolerance in comparison.declared.items())
    return (f"compared {', '.join(comparison.studies)}: {comparison.rows_matched} rows matched "
            f"by case_id and position, {comparison.cells_judged} cells judged (numbers within "
            f"rtol {comparison.rtol:g}{declared}, the rest exactly); timing columns ignored: "
            f"{timing}")


def _verdict(comparison: FolderComparison) -> str:
    if comparison.agree:
        return "agree: no verdict, status or text differs and every number is within tolerance"
    rows = sum(1 for d in comparison.differences if d.column == "(row)")
    studies = sorted({d.study for d in comparison.differences})
    return (f"differ: {len(comparison.differences) - rows} cell(s) and {rows} unmatched row(s) "
            f"in {', '.join(studies)}")


# ------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\n" + rules(),
        epilog=textwrap.dedent("""\
            examples:
              python scripts/compare.py results/ /tmp/rerun
              python scripts/compare.py results/ /tmp/rerun --studies reduction,seed001
            """))
    parser.add_argument("a", metavar="A", help="results folder (the --out of a study run, "
                        "with run.json and the CSVs it lists)")
    parser.add_argument("b", metavar="B", help="the results folder to compare it with")
    parser.add_argument("--studies", metavar="NAME[,NAME]",
                        help="compare only these studies (each must be in both folders; "
                             "default: every study both ran)")
    parser.add_argument("--common-rows", action="store_true",
                        help="compare only the rows both folders hold (a quick form against "
                             "the full run); the others are counted, not differences")
    parser.add_argument("--all", action="store_true", dest="every",
                        help=f"list every difference (default: the first {MAX_SHOWN})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        a, b = ResultsFolder.load(args.a), ResultsFolder.load(args.b)
        comparison = compare_folders(a, b, studies_to_compare(a, b, args.studies),
                                     args.common_rows)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_EXIT
    print(report(a, b, comparison, args.every))
    return 0 if comparison.agree else 1
