"""The short console table rank 0 prints: one line per case and comparison point."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

HEADER = ("strategy", "N", "k", "step", "point", "verdict", "scale", "residual", "precision",
          "worst tensors", "fix")


def _number(value: float) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.4g}"


def _cells(row: dict[str, Any], steps: int) -> tuple[str, ...]:
    verdict = row["verdict"] if row["status"] == "ok" else row["status"]
    if row["error"]:
        verdict = f"error: {row['error']}"
    # Only where no scale explains the measurement do the worst tensors say something.
    worst = row["worst_tensors"] if row["verdict"] == "differs" else ""
    return (row["strategy"], str(row["world_size"]), str(row["accum_steps"]),
            str(row["step"]) if steps > 1 else "", row["point"], verdict,
            _number(row["scale"]), _number(row["residual"]), row.get("precision", ""),
            worst.replace(";", " "),
            row["fix"])


def render(rows: Sequence[dict[str, Any]], steps: int = 1) -> str:
    """Aligned columns; the step column only when the setup has several steps."""
    lines = [HEADER, *(_cells(row, steps) for row in rows)]
    keep = [i for i in range(len(HEADER)) if HEADER[i] != "step" or steps > 1]
    widths = {i: max(len(line[i]) for line in lines) for i in keep}
    out = []
    for line in lines:
        out.append("  ".join(line[i].ljust(widths[i]) for i in keep).rstrip())
    return "\n".join(out)
