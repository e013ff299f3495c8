"""The end of every front-end's run, one path (:func:`finish`): its rows to their CSV,
the console table and where the rows went, then the exit code, for CI: 1 when a row fails
``--fail-on``, with one line per failing case saying which and why; 0 otherwise.

Rows are read as the CSVs hold them (strings), so the launcher can judge the file the
ranks wrote and a rank can judge the rows it holds the same way. A front-end says how
its rows name their case (``case_of``) and, where it judges another verdict than the
row's ``verdict`` (the frameworks' recipe), which (``verdict_of``).
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.verdicts import FAILING_STATUSES, FAILS_UNDER, Equivalence, Status

Row = dict[str, Any]
#: ``--fail-on`` value -> the verdicts that fail the run. A row whose status is in
#: :data:`~harness.verdicts.FAILING_STATUSES` (an error, a step that fed other samples)
#: always fails: nothing was checked.
FAIL_ON = {level: frozenset(verdict for verdict, levels in FAILS_UNDER.items()
                            if level in levels)
           for level in (str(Status.ERROR), str(Equivalence.DIFFERS), str(Equivalence.SCALED))}
#: A pure scale is sometimes meant (a summed loss with the learning rate divided to
#: match), and the params rows then say whether it is compensated; a difference no
#: scale explains never is.
DEFAULT_FAIL_ON = str(Equivalence.DIFFERS)
#: Failing cases named one per line before the rest are only counted.
SHOWN_CASES = 5


def row_verdict(row: Row) -> str:
    return str(row["verdict"])


def failing_cases(rows: Sequence[Row], fail_on: str, case_of: Callable[[Row], str],
                  verdict_of: Callable[[Row], str] = row_verdict) -> dict[str, str]:
    """Each failing case's label -> why it fails (its first failing row)."""
    verdicts = FAIL_ON[fail_on]
    failing: dict[str, str] = {}
    for row in rows:
        where = f"step {row['step']}" if "step" in row else "the step"
        if row["status"] in FAILING_STATUSES:
            why = f"{where}: {row['error'] or row['status']}"
        elif verdict_of(row) in verdicts:
            why = f"{where} {row['point']} {verdict_of(row)}"
        else:
            continue
        failing.setdefault(case_of(row), why)
    return failing


def exit_code(rows: Sequence[Row], fail_on: str, prog: str, case_of: Callable[[Row], str],
              verdict_of: Callable[[Row], str] = row_verdict) -> int:
    """0, or 1 after naming the failing cases on stderr."""
    unresolved = sum(row["status"] == Status.UNRESOLVED for row in rows)
    if unresolved:
        print(f"{prog}: {unresolved} row(s) {Status.UNRESOLVED}: measured, but their "
              "precision cannot tell rounding from a difference (their fix says why): run "
              "once at the higher precision their fix names to resolve them", file=sys.stderr,
              flush=True)
    failing = failing_cases(rows, fail_on, case_of, verdict_of)
    if not failing:
        return 0
    lines = [f"{prog}: {case}: {why}" for case, why in list(failing.items())[:SHOWN_CASES]]
    if len(failing) > SHOWN_CASES:
        lines.append(f"{prog}: ... and {len(failing) - SHOWN_CASES} more case(s)")
    lines.append(f"{prog}: {len(failing)} case(s) fail --fail-on {fail_on}: exit code 1")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 1


@dataclass(frozen=True)
class Judging:
    """How a front-end's rows decide its exit code: the ``--fail-on`` level, the program
    that speaks, how a row names its case, and which verdict of a row is judged."""

    fail_on: str
    prog: str
    case_of: Callable[[Row], str]
    verdict_of: Callable[[Row], str] = row_verdict

    def __post_init__(self) -> None:
        if self.fail_on not in FAIL_ON:
            raise ValueError(f"--fail-on {self.fail_on}: allowed: {', '.join(FAIL_ON)}")

    def exit_code(self, rows: Sequence[Row]) -> int:
        return exit_code(rows, self.fail_on, self.prog, self.case_of, self.verdict_of)


def finish(rows: Sequence[Row], path: Path, columns: Sequence[str], judging: Judging,
           table: str | None, written: bool = False, judged_elsewhere: bool = False,
           where_else: str = "") -> int:
    """A front-end's rows to its exit code: written to ``path`` atomically (unless the run
    wrote them as it went: ``written``), ``table`` and where the rows went on the console
    (None: quiet; ``where_else``: what else the run left, said after the path), then the
    exit code (0 where another process, the launcher, judges the CSV)."""
    if not written:
        from harness.results import write_csv_atomic

        write_csv_atomic(path, list(rows), columns)
    if table is not None:
        print(table, flush=True)
        print(f"{judging.prog}: {len(rows)} rows -> {path}{where_else}", flush=True)
    return 0 if judged_elsewhere else judging.exit_code(rows)


def rows_of(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))
