"""Turning measured numbers into Markdown: number formats, lists and tables.

The report quotes numbers in sentences and tables; the formats here decide how
many digits a reader sees. Ratios get four significant digits (enough to tell
1/3 from 0.33, short enough for a table cell); deviations and residuals get
two in scientific notation, because their order of magnitude is the message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from harness.strategies import STRATEGIES


def _formatted(value: float, plain_below: float, plain: str, otherwise: str) -> str:
    """``value`` with format ``plain`` when 1e-3 <= |value| < ``plain_below``, else
    ``otherwise``; "n/a" for a missing value and "0" for an exact zero."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if value == 0:
        return "0"
    return format(value, plain if 1e-3 <= abs(value) < plain_below else otherwise)


def number(value: float) -> str:
    """A measured ratio or gradient, as a reader wants to see it: 0.5, 0.3333, 2.5, 1.2e+06."""
    return _formatted(value, 1e5, ".4g", ".2g")


def small(value: float) -> str:
    """A deviation or residual: its order of magnitude matters, not its digits (2.2e-16)."""
    return _formatted(value, 1e3, ".2g", ".1e")


def span(values: Iterable[float], format=small) -> str:
    """``0.43 to 0.91``, or one number when the smallest and largest read the same."""
    values = [v for v in values if v == v]
    low, high = format(min(values, default=math.nan)), format(max(values, default=math.nan))
    return low if low == high else f"{low} to {high}"


def integers(values: Iterable[float]) -> str:
    """Sorted distinct integers as a comma-separated list: '2, 3, 4'."""
    return ", ".join(str(int(v)) for v in sorted({int(v) for v in values}))


def words(items: Sequence[str], conjunction: str = "and") -> str:
    """'a', 'a and b', 'a, b and c' (or 'a, b or c')."""
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + f" {conjunction} " + items[-1]


def few(items: Sequence[str], shown: int = 2, conjunction: str = "and") -> str:
    """'a and b', or 'a, b and 3 more': a list that must fit in a table cell; the section the
    cell links to names every item."""
    items = list(items)
    if len(items) <= shown + 1:
        return words(items, conjunction)
    return ", ".join(items[:shown]) + f" {conjunction} {len(items) - shown} more"


def worst(n: int, noun: str, residual: float, name: str = "residual") -> str:
    """Evidence as the answer table gives it: '18 cases, worst residual 2.2e-16'."""
    return f"{count(n, noun)}, worst {name} {small(residual)}"


def code(text: str) -> str:
    return f"`{text}`"


def count(n: int, noun: str) -> str:
    """'1 case', '3 cases'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def cite_cases(case_ids: Sequence[str], shown: int = 2) -> str:
    """A few case_ids in code font, and how many more there are."""
    ids = list(dict.fromkeys(case_ids))
    text = ", ".join(code(i) for i in ids[:shown])
    if len(ids) > shown:
        text += f" and {len(ids) - shown} more"
    return text


def table(headers: Sequence[str], rows: Sequence[Sequence[str]],
          numeric: Sequence[bool] | None = None) -> str:
    """A GitHub-flavoured Markdown table; numeric columns are right-aligned."""
    numeric = list(numeric) if numeric is not None else [False] * len(headers)

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    rule = "|" + "|".join("---:" if n else "---" for n in numeric) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def strategy_name(strategy: str) -> str:
    """How the report names a strategy in sentences: its spec's label."""
    return STRATEGIES[strategy].label if strategy in STRATEGIES else strategy


def value_name(column: str, value: object) -> str:
    """How a sentence names a column's value: strategies by name, whole numbers without .0."""
    if column == "strategy":
        return strategy_name(str(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


#: The letter a sentence, a table or an axis names a count column by: N for the world size
#: (ranks or devices), k for micro-steps per optimizer step.
LETTERS = {"world_size": "N", "devices_used": "N", "accum_steps": "k"}


def letter(column: str) -> str:
    """How a count column is named where its value is quoted (``N = 4``, ``k = 2``): its
    letter, or the column's name."""
    return LETTERS.get(column, column)


def capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]
