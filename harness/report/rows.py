"""Small queries on a study's rows that several sections share."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from harness.tolerances import close

if TYPE_CHECKING:
    import pandas as pd

#: Ratios a sentence can name instead of listing numbers, as functions of k.
#: Checked in this order: at k = 1 all three coincide and "1" is the plain word for it.
NAMED_RATIOS = {"1": lambda k: 1.0, "1/k": lambda k: 1.0 / k, "k": lambda k: float(k)}


def is_true(values: pd.Series) -> pd.Series:
    """A boolean column as read from a CSV: True/False, or text when some cells are empty."""
    return values.astype(str).str.lower() == "true"


def measured(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows whose case was measured (status ``ok``), not skipped."""
    return frame[frame["status"] == "ok"]


def ordered(frame: pd.DataFrame, column: str) -> list:
    """Distinct values of ``column`` in the order the CSV first shows them (the study's order)."""
    return list(dict.fromkeys(frame[column].tolist()))


def split_by(frame: pd.DataFrame, column: str) -> list[tuple[object, pd.DataFrame]]:
    """Groups of rows by ``column``, largest group first; missing values form a group too."""
    keys = frame[column].fillna("").astype(str)
    groups = [(value, frame[keys == value]) for value in dict.fromkeys(keys)]
    return sorted(groups, key=lambda group: -len(group[1]))


def named_ratio(ks: Iterable[float], values: Iterable[float], rtol: float
                ) -> tuple[str | None, float]:
    """The name ("1", "1/k" or "k") every value equals within ``rtol``, and the largest deviation.

    None (and NaN) when no single name fits every (k, value) pair.
    """
    pairs = list(zip(ks, values, strict=True))
    for name, ratio in NAMED_RATIOS.items():
        expected = [ratio(k) for k, _ in pairs]
        if pairs and all(not math.isnan(v) and close(v, e, rtol)
                         for (_, v), e in zip(pairs, expected, strict=True)):
            return name, max(abs(v - e) for (_, v), e in zip(pairs, expected, strict=True))
    return None, math.nan
