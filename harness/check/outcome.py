"""The exit code of a check, for CI: 1 when a row fails ``--fail-on``, with one line per
failing case saying which and why; 0 otherwise.

Rows are read as the CSVs hold them (strings), so the launcher can judge the file the
ranks wrote and a rank can judge the rows it holds the same way. A front-end says how
its rows name their case (``case_of``) and, where it judges another verdict than the
row's ``verdict`` (the frameworks' recipe), which (``verdict_of``).
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Sequence
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
              "once in float32 to resolve them", file=sys.stderr, flush=True)
    failing = failing_cases(rows, fail_on, case_of, verdict_of)
    if not failing:
        return 0
    lines = [f"{prog}: {case}: {why}" for case, why in list(failing.items())[:SHOWN_CASES]]
    if len(failing) > SHOWN_CASES:
        lines.append(f"{prog}: ... and {len(failing) - SHOWN_CASES} more case(s)")
    lines.append(f"{prog}: {len(failing)} case(s) fail --fail-on {fail_on}: exit code 1")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 1


def rows_of(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))
