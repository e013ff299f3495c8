"""Generic table parts: a pivot by a count (N or k) whose identical lines collapse, and one line
per row."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.report.section import Rows
from harness.report.text import letter, number

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True, kw_only=True)
class Pivot:
    """Lines by ``index``, one cell per value of ``column`` (a count: N, k) from the rows of
    that cell.

    Values of ``collapse`` whose cells all read the same share a line, listed in
    the last column: the table stays short where they agree and grows exactly
    where they differ.
    """

    caption: str
    index: tuple[str, ...]
    column: str
    cell: Callable[[pd.DataFrame, float], str]
    collapse: str = ""
    where: str = ""

    def __call__(self, rows: Rows) -> str | None:
        chosen = rows.select(self.where)
        if chosen.empty:
            return None
        counts = sorted(chosen[self.column].unique())
        keys = [*self.index, *([self.collapse] if self.collapse else [])]
        by_line: dict[tuple, dict[tuple, list]] = {}
        for key, part in chosen.groupby(keys, sort=False):
            key = key if isinstance(key, tuple) else (key,)
            at = dict(iter(part.groupby(self.column)))
            cells = tuple(self.cell(at[n], rows.rtol) if n in at else "" for n in counts)
            line = by_line.setdefault(key[:len(self.index)], {})
            line.setdefault(cells, []).extend(key[len(self.index):])
        body = [[*index, *cells, *([", ".join(map(str, shared))] if self.collapse else [])]
                for index, lines in by_line.items() for cells, shared in lines.items()]
        headers = [*self.index, *(f"{letter(self.column)} = {n}" for n in counts)]
        headers += [self.collapse] if self.collapse else []
        numeric = [False] * len(self.index) + [True] * len(counts) + [False] * bool(self.collapse)
        return rows.table(self.caption, len(chosen), headers, body, numeric)


@dataclass(frozen=True, kw_only=True)
class Records:
    """One line per selected row; each column a header and a cell made from the row.

    ``caption``: a template (``{csv}``, ``{rows}``, ``{rtol}``), or a function of the
    selected rows giving one, for a caption that quotes them.
    """

    caption: str | Callable[[pd.DataFrame], str]
    columns: Sequence[tuple[str, Callable[[dict], str]]]
    where: str = ""
    numeric: Sequence[bool] = ()

    def __call__(self, rows: Rows) -> str | None:
        chosen = rows.select(self.where)
        if chosen.empty:
            return None
        body = [[cell(row) for _, cell in self.columns] for row in chosen.to_dict("records")]
        headers = [header for header, _ in self.columns]
        numeric = [*self.numeric, *[False] * (len(headers) - len(self.numeric))]
        caption = self.caption(chosen) if callable(self.caption) else self.caption
        return rows.table(caption, len(chosen), headers, body, numeric)


def numbers(name: str, flag: Callable[[pd.DataFrame], pd.Series] | None = None,
            mark: str = "✗") -> Callable[[pd.DataFrame, float], str]:
    """A Pivot cell: the cell's distinct values of ``name``, and ``mark`` where ``flag`` holds."""
    def cell(rows: pd.DataFrame, rtol: float) -> str:
        text = "/".join(dict.fromkeys(number(v) for v in rows[name]))
        return text + (f" {mark}" if flag is not None and flag(rows).any() else "")
    return cell


def cell(name: str, format: Callable[[object], str] = str) -> Callable[[dict], str]:
    """A Records cell that shows one CSV column through ``format`` (empty where missing)."""
    return lambda row: "" if row[name] != row[name] or row[name] is None else format(row[name])


def column(name: str, format: Callable[[object], str] = str) -> tuple[str, Callable]:
    """A Records column that shows one CSV column through ``format``, headed by its name."""
    return name, cell(name, format)
