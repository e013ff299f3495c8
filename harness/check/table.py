"""The short console table rank 0 prints: one line per case and comparison point."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

HEADER = ("strategy", "N", "k", "step", "point", "verdict", "scale", "residual", "precision",
          "worst tensors", "fix")


def number(value: float | None) -> str:
    """A table's number: four significant digits, nothing for a missing one (None, NaN)."""
    return "" if value is None or math.isnan(value) else f"{value:.4g}"


def aligned(lines: Sequence[Sequence[str]]) -> list[str]:
    """Each line's cells padded to their column's widest, two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
            .rstrip() for line in lines]


def _cells(row: dict[str, Any], steps: int) -> tuple[str, ...]:
    verdict = row["verdict"] if row["status"] == "ok" else row["status"]
    if row["error"]:
        verdict = f"error: {row['error']}"
    # Only where no scale explains the measurement do the worst tensors say something.
    worst = row["worst_tensors"] if row["verdict"] == "differs" else ""
    return (row["strategy"], str(row["world_size"]), str(row["accum_steps"]),
            str(row["step"]) if steps > 1 else "", row["point"], verdict,
            number(row["scale"]), number(row["residual"]), row.get("precision", ""),
            worst.replace(";", " "),
            row["fix"])


def render(rows: Sequence[dict[str, Any]], steps: int = 1) -> str:
    """Aligned columns; the step column only when the setup has several steps."""
    keep = [i for i in range(len(HEADER)) if HEADER[i] != "step" or steps > 1]
    lines = [HEADER, *(_cells(row, steps) for row in rows)]
    return "\n".join(aligned([[line[i] for i in keep] for line in lines]))
