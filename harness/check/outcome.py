"""The exit code of a check, for CI: 1 when a row fails ``--fail-on``, with one line per
failing case saying which and why; 0 otherwise.

Rows are read as check.csv holds them (strings), so the launcher can judge the file the
ranks wrote and a rank can judge the rows it holds the same way.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.check.script.schema import DIFFERENT_SAMPLES

#: ``--fail-on`` value -> the verdicts that fail the run. A case that errors (its step
#: raised, or its loss went NaN) always fails: nothing was checked; so does a row in
#: :data:`UNJUDGED`.
FAIL_ON = {
    "error": frozenset(),
    "differs": frozenset({"differs"}),
    "scaled": frozenset({"differs", "scaled"}),
}
#: Statuses of rows that could not be judged, which fail the run as an error does
#: (script.csv: a split's step fed other samples than the reference's).
UNJUDGED = frozenset({DIFFERENT_SAMPLES})
#: A pure scale is sometimes meant (a summed loss with the learning rate divided to
#: match), and the params rows then say whether it is compensated; a difference no
#: scale explains never is.
DEFAULT_FAIL_ON = "differs"
#: Failing cases named one per line before the rest are only counted.
SHOWN_CASES = 5


def _case(row: dict[str, Any]) -> str:
    if "split" in row:  # a script's row (``grad-check run``: script.csv)
        return f"split {row['split']} (N={row['world_size']} k={row['accum_steps']})"
    # A strategy's row (check.csv), or a framework's (``--frameworks``: frameworks.csv).
    how = row.get("strategy") or f"{row['framework']} {row['setting']}"
    return f"{row['setup']} {how} N={row['world_size']} k={row['accum_steps']}"


def _verdict(row: dict[str, Any]) -> str:
    """What the row says of the step: a framework's row is judged against the big batch
    under the framework's own recipe (its shipped clip applied once), which is its
    ``verdict`` where the recipe is none."""
    return str(row.get("recipe_verdict") or row["verdict"])


def failing_cases(rows: Sequence[dict[str, Any]], fail_on: str) -> dict[str, str]:
    """Each failing case's label -> why it fails (its first failing row)."""
    verdicts = FAIL_ON[fail_on]
    failing: dict[str, str] = {}
    for row in rows:
        where = f"step {row['step']}" if "step" in row else "the step"
        if row["status"] == "error":
            why = f"{where}: {row['error']}"
        elif row["status"] in UNJUDGED:
            why = f"{where}: {row['status']}"
        elif _verdict(row) in verdicts:
            why = f"{where} {row['point']} {_verdict(row)}"
        else:
            continue
        failing.setdefault(_case(row), why)
    return failing


def exit_code(rows: Sequence[dict[str, Any]], fail_on: str, prog: str) -> int:
    """0, or 1 after naming the failing cases on stderr."""
    failing = failing_cases(rows, fail_on)
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
