"""Queries on the ``hooks`` study's rows that the section's parts share: grouping by
variant, steps in runs, counts per world size, and the multiple of ḡ a verdict names."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from harness.report.rows import ordered
from harness.report.text import integers, strategy_name, words
from harness.verdicts import HookVerdict

if TYPE_CHECKING:
    import pandas as pd

#: Verdicts whose error is not a scale: the figure draws their variants.
ERRING = (HookVerdict.COMPRESSED, HookVerdict.DIFFERS)


#: The multiple of ḡ that a verdict names (the study judged it, hooks/measure.py), as a
#: function of N: the report reads it from the verdict instead of judging the scale again.
NAMED_SCALES = {HookVerdict.SUMMED: ("N", float),
                HookVerdict.OVER_AVERAGED: ("1/N", lambda n: 1 / n)}


# ------------------------------------------------------------------ grouping
def derive(ok: pd.DataFrame, rtol: float) -> pd.DataFrame:
    """``name`` (strategy and variant, as sentences say them), ``erring`` (the variant had a
    compressed or differing step at that world size), and for the figure ``via`` (one
    series: compressed rows by their wire format, the others by variant) and ``at`` (its
    panel: ``N = 2``)."""
    names = [f"{strategy_name(s)} {v}" for s, v in zip(ok["strategy"], ok["variant"],
                                                        strict=True)]
    erring = ok["verdict"].isin(ERRING).groupby(ok["case_id"]).transform("any")
    compressed = (ok["verdict"] == HookVerdict.COMPRESSED).groupby(ok["case_id"]).transform("any")
    via = [wire if squeezed else variant for squeezed, wire, variant in
           zip(compressed, ok["wire_dtype"], ok["variant"], strict=True)]
    return ok.assign(name=names, erring=erring, via=via,
                     at=[f"N = {int(n)}" for n in ok["world_size"]])


def always(rows: pd.DataFrame, verdict: HookVerdict) -> pd.DataFrame:
    """The rows of the variants every row of which has ``verdict``."""
    every = (rows["verdict"] == verdict).groupby(rows["variant"]).transform("all")
    return rows[every]


def variant_names(rows: pd.DataFrame) -> str:
    return words(ordered(rows, "name"))


def where_variants(rows: pd.DataFrame) -> str:
    return "variant in " + ", ".join(ordered(rows, "variant"))


def last_steps(rows: pd.DataFrame) -> pd.DataFrame:
    """Each case's last measured step."""
    return rows[rows["step"] == rows.groupby("case_id")["step"].transform("max")]


def step_runs(steps: list) -> str:
    """``1-2``, ``3``, ``1, 3-5``: steps in runs."""
    runs: list[list[int]] = []
    for step in sorted(int(s) for s in steps):
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def integer(value: float) -> str:
    return "n/a" if value != value else str(int(value))  # NaN != NaN


def by_step(rows: pd.DataFrame, column: str, fmt: Callable[[object], str] = integer,
            sentence: bool = False) -> str:
    """One value, or the values with their steps when they change: ``1 (1-2), 3 (3-5)``, or
    in a ``sentence``: ``1 in steps 1-2, 3 in steps 3-5``."""
    runs: list[tuple[str, list]] = []
    for step, value in rows.sort_values("step")[["step", column]].itertuples(index=False):
        text = fmt(value)
        if runs and runs[-1][0] == text:
            runs[-1][1].append(step)
        else:
            runs.append((text, [step]))
    if len(runs) == 1:
        return runs[0][0]
    if sentence:
        return ", ".join(f"{text} in step{'s' if len(steps) > 1 else ''} {step_runs(steps)}"
                         for text, steps in runs)
    return ", ".join(f"{text} ({step_runs(steps)})" for text, steps in runs)


def per_world_size(rows: pd.DataFrame, column: str) -> str:
    """:func:`by_step` (in a sentence) at each world size, said once when they agree."""
    texts = {int(n): by_step(rows[rows["world_size"] == n], column, sentence=True)
             for n in sorted(rows["world_size"].unique())}
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"{text} at N = {n}" for n, text in texts.items())


def at_each_world_size(rows: pd.DataFrame, column: str) -> str:
    """``32 at N = 2, 4`` or ``29 at N = 2, 19 at N = 4``: the values of a per-case constant."""
    by_value: dict[str, list] = {}
    for n, value in rows.groupby("world_size")[column].first().items():
        by_value.setdefault(integer(value), []).append(n)
    return ", ".join(f"{value} at N = {integers(ns)}" for value, ns in by_value.items())


def bytes_ratio(rows: pd.DataFrame, every: pd.DataFrame) -> pd.Series:
    """collective_bytes of each row over the fewest bytes of an exact row of the same
    strategy, world size and step."""
    exact = every[every["verdict"] == HookVerdict.EXACT]
    least = exact.groupby(["strategy", "world_size", "step"])["collective_bytes"].min()
    reference = [least.get(key, float("nan")) for key in
                 zip(rows["strategy"], rows["world_size"], rows["step"], strict=True)]
    return (rows["collective_bytes"] / reference).dropna()


def scale_name(rows: pd.DataFrame, verdict: HookVerdict) -> tuple[str | None, float]:
    """The multiple of ḡ (N, 1/N) the rows' ``verdict`` names, and the largest deviation of
    full_batch_scale from it; None (and NaN) for a scale the verdict does not name."""
    if verdict not in NAMED_SCALES:
        return None, math.nan
    name, multiple = NAMED_SCALES[verdict]
    return name, max(abs(scale - multiple(n)) for n, scale in
                     zip(rows["world_size"], rows["full_batch_scale"], strict=True))
