"""Words and numbers the update section's parts share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.section import SectionInputs
from harness.report.text import number, table
from harness.verdicts import Equivalence, close

if TYPE_CHECKING:
    import pandas as pd


def factor_text(factor: float, rtol: float) -> str:
    """``1/4``, ``3``, ``1``, or the number when neither it nor its inverse is an integer."""
    if factor >= 1 and close(factor, round(factor), rtol):
        return str(round(factor))
    if factor < 1 and close(1 / factor, round(1 / factor), rtol):
        return f"1/{round(1 / factor)}"
    return number(factor)


def is_scaled(rows: pd.DataFrame, rtol: float) -> pd.Series:
    """Rows whose gradient is not the big batch's (s ≠ 1)."""
    return ~rows["grad_scale"].map(lambda s: close(s, 1.0, rtol))


def scale_text(value: float) -> str:
    """GradScaler's scale, a power of two: ``65536``, not ``6.554e+04``."""
    return f"{value:.0f}" if value == int(value) else number(value)


def verb(verdict: str) -> str:
    return "matched the big batch's" if verdict == Equivalence.MATCHES else "differed"


def table_of_rows(caption: str, inputs: SectionInputs, experiments: str, shown: int,
                   headers: list[str], body: list[list[str]], numeric: str) -> str:
    """``caption``, the rows it shows cited, and the table; ``numeric``: + per right-aligned
    column, - per text column."""
    cited = (f" Rows of `{inputs.csv_name}` with experiment = {experiments}, status = ok "
             f"({shown} rows).")
    return caption + cited + "\n\n" + table(headers, body, [c == "+" for c in numeric])
