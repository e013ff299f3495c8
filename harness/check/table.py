"""The short console tables rank 0 prints: one line per case, step and comparison point.

Every front-end of the check (the Setup matrix, ``--frameworks``, ``grad-check run``)
prints its rows with :func:`render`: the columns its rows identify a case by, then the
verdict columns every front-end shares. A failed case says ``error`` in its verdict cell
and its error in the last cell, where it widens no other column.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harness.verdicts import Equivalence, Status

Row = dict[str, Any]


@dataclass(frozen=True)
class Cell:
    """One console column: its header and how a row fills it."""

    header: str
    of: Callable[[Row], str]


def number(value: float | None) -> str:
    """A table's number: four significant digits, nothing for a missing one (None, NaN)."""
    if value is None or value == "":
        return ""
    value = float(value)
    return "" if math.isnan(value) else f"{value:.4g}"


def aligned(lines: Sequence[Sequence[str]]) -> list[str]:
    """Each line's cells padded to their column's widest, two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
            .rstrip() for line in lines]


def verdict_cell(row: Row) -> str:
    """The verdict, or where the row was not judged, its status (``error``, ``skipped``,
    ``no gradient``, ``no update``)."""
    return str(row["verdict"]) if row["status"] == Status.OK else str(row["status"])


def worst_cell(row: Row) -> str:
    # Only where no scale explains the measurement do the worst tensors say something.
    return (str(row["worst_tensors"]).replace(";", " ")
            if row["verdict"] == Equivalence.DIFFERS else "")


def fix_cell(row: Row) -> str:
    return str(row["error"]) if row.get("error") else str(row["fix"])


#: The columns every front-end's table ends with.
VERDICT_CELLS = (
    Cell("verdict", verdict_cell),
    Cell("scale", lambda row: number(row["scale"])),
    Cell("residual", lambda row: number(row["residual"])),
    Cell("precision", lambda row: str(row.get("precision", ""))),
)
N_AND_K = (Cell("N", lambda row: str(row["world_size"])),
           Cell("k", lambda row: str(row["accum_steps"])))
STEP = Cell("step", lambda row: str(row["step"]))
POINT = Cell("point", lambda row: str(row["point"]))


def render(rows: Sequence[Row], steps: int, cells: Sequence[Cell]) -> str:
    """Aligned columns; the step column only when the setup has several steps."""
    shown = [cell for cell in cells if cell is not STEP or steps > 1]
    lines = [[cell.header for cell in shown], *([cell.of(row) for cell in shown]
                                                 for row in rows)]
    return "\n".join(aligned(lines))
