"""What a study's section of the report is, and what it gets to build itself.

A section is a plain function from the study's CSV (a DataFrame) to findings,
tables and figures. It never sees text written for an expected outcome: every
sentence is assembled from the rows, and every finding names the rows it was
built from so that a reader can check it in the CSV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.report.text import code, count

if TYPE_CHECKING:
    import pandas as pd

    from harness.report.figures import FigureWriter


@dataclass(frozen=True)
class Finding:
    """One sentence built from measured numbers, and the rows it comes from."""

    text: str
    #: Which CSV and which rows: ``reduction.csv: strategy = ddp, devices_used >= 2 (24 rows)``.
    source: str
    #: Also listed under "At a glance" at the top of the report: the answers a reader came for.
    headline: bool = False

    def markdown(self) -> str:
        return f"- {self.text} <sub>[{self.source}]</sub>"


@dataclass
class SectionInputs:
    """Everything a section needs besides its CSV."""

    csv_name: str
    #: Relative tolerance of the run's dtype: the same one the study judged its verdicts with.
    rtol: float
    figures: FigureWriter

    def source(self, filter_text: str, rows: int) -> str:
        """How a finding cites its rows: the CSV, the filter, and how many rows matched."""
        return f"{code(self.csv_name)}: {filter_text} ({count(rows, 'row')})"


@dataclass
class SectionOutput:
    """A rendered section: findings first, then tables and figures (Markdown blocks)."""

    findings: list[Finding] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Section:
    """How the report summarizes one study."""

    #: The study's name; its CSV is ``<study>.csv``.
    study: str
    #: The section's heading.
    title: str
    #: One sentence under the heading: what the study measures.
    intro: str
    #: Columns the section reads; a CSV without them is refused before anything is written.
    columns: tuple[str, ...]
    render: Callable[[pd.DataFrame, SectionInputs], SectionOutput]
