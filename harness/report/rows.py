"""Small queries on a study's rows that every part of the report shares."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd


def is_true(values: pd.Series) -> pd.Series:
    """A boolean column as read from a CSV: True/False, or text when some cells are empty."""
    return values.astype(str).str.lower() == "true"


def measured(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows whose case was measured (status ``ok``), not skipped."""
    return frame[frame["status"] == "ok"]


def ordered(frame: pd.DataFrame, column: str) -> list:
    """Distinct values of ``column`` in the order the CSV first shows them (the study's order)."""
    return list(dict.fromkeys(frame[column].tolist()))


def labels(frame: pd.DataFrame, column: str) -> pd.Series:
    """A column as text, missing values as "" (verdict words, booleans, names)."""
    return frame[column].fillna("").astype(str)


def split_by(frame: pd.DataFrame, values: pd.Series) -> list[tuple[str, pd.DataFrame]]:
    """Groups of rows by ``values`` (text, aligned with the rows), largest group first."""
    parts = [(value, frame[values == value]) for value in dict.fromkeys(values)]
    return sorted(parts, key=lambda part: -len(part[1]))


def select(frame: pd.DataFrame, where: str = "") -> pd.DataFrame:
    """The rows a pandas query selects (``devices_used >= 2 and model != 'toy'``); all if empty."""
    return frame.query(where, engine="python") if where else frame


def filter_text(where: str) -> str:
    """A query as a finding cites it: ``devices_used >= 2, model != toy``."""
    text = where.replace(" and ", ", ").replace("'", "").replace(".notna()", " not empty")
    return re.sub(r"\s*==\s*", " = ", text)


def groups(frame: pd.DataFrame, per: Sequence[str]) -> list[tuple[dict, pd.DataFrame]]:
    """Rows grouped by the columns ``per`` in the CSV's order, each with its column values."""
    if not per:
        return [({}, frame)] if len(frame) else []
    grouped = frame.groupby(list(per), sort=False, dropna=False)
    return [(dict(zip(per, key if isinstance(key, tuple) else (key,), strict=True)), rows)
            for key, rows in grouped]
