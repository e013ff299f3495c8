"""Words and numbers the update experiments' report parts share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.report.section import Answer, Rows
from harness.report.tables import cell
from harness.report.text import count, number, small, strategy_name
from harness.report.text import words as listed
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


def whole(value: float) -> str:
    """A count as a table shows it: ``4``, not ``4.0`` (a column with empty cells is read
    as floats)."""
    return str(int(value))


def scale_text(value: float) -> str:
    """GradScaler's scale, a power of two: ``65536``, not ``6.554e+04``."""
    return f"{value:.0f}" if value == int(value) else number(value)


def verb(verdict: str) -> str:
    return "matched the big batch's" if verdict == Equivalence.MATCHES else "differed"


@dataclass(frozen=True)
class SettingsAnswer:
    """An answer part: which ``setting`` values gave the big batch's update in every run,
    which did not; ``fix`` names what to do ("clip" per-window), ``none`` what to say when
    no setting did."""

    question: str
    fix: str
    none: str

    def __call__(self, rows: Rows) -> list[Answer]:
        measured = rows.ok
        by_setting = dict(iter(measured.groupby("setting", sort=False)))
        right = [s for s, g in by_setting.items() if (g["verdict"] == Equivalence.MATCHES).all()]
        wrong = [s for s in by_setting if s not in right]
        if not by_setting:
            return []
        worst = measured[measured["setting"].isin(wrong)]["update_error"].max() if wrong else 0.0
        return [Answer(
            self.question, (listed(right, "or") or self.none)
            + (f"; not {listed(wrong, 'or')}" if wrong else ""),
            f"{count(len(measured), 'run')}; update_error up to {small(worst)} where it differs",
            f"{self.fix} {listed(right, 'or')}" if right and wrong else "")]


#: Table columns: which case a row is of (the strategy, N, k) ...
IDENTITY = (("strategy", cell("strategy", strategy_name)), ("N", cell("world_size", whole)),
            ("k", cell("accum_steps", whole)))
#: ... GradScaler's scale around the window ...
SCALES = (("scale before", cell("scale_before", scale_text)),
          ("scale after", cell("scale_after", scale_text)))
#: ... and how its update compared with the big batch's.
OUTCOME = (("update_error", cell("update_error", small)), ("verdict", cell("verdict")))
