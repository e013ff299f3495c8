"""What a study's section of the report is: a declaration of parts, drawn by one renderer.

Every part is a callable ``part(rows: Rows)`` returning one item, a list, or
None: :class:`Answer` rows for the table that opens the report, :class:`Finding`
sentences, or Markdown blocks (tables, figures), each put where its kind belongs
(a finding and the answer it rests on come from one part); see :mod:`harness.report.spec`.
Every sentence is assembled from the rows and names the rows it was built from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from harness.report.rows import filter_text, groups, measured, select
from harness.report.text import code, count, small, table

if TYPE_CHECKING:
    import pandas as pd


class Figures(Protocol):
    """Where a section's figures go (harness/report/figures.py ``Figures``): a figure
    saved under its name, given back as the Markdown that shows it."""

    def save(self, figure: Any, name: str, alt: str, caption: str) -> str: ...


@dataclass(frozen=True)
class Finding:
    """One sentence built from measured numbers, and the rows it comes from."""

    text: str
    #: Which CSV and which rows: ``reduction.csv: strategy = ddp, devices_used >= 2 (24 rows)``.
    source: str

    def markdown(self) -> str:
        return f"- {self.text} <sub>[{self.source}]</sub>"


@dataclass(frozen=True)
class Answer:
    """One row of the answer table that opens the report: a question, answered by the rows."""

    question: str
    answer: str
    #: How much the answer rests on: cases, scale, worst residual.
    evidence: str
    #: What to change, where the rows show a change that works; empty otherwise.
    fix: str = ""


@dataclass
class SectionInputs:
    """Everything a section needs besides its CSV."""

    csv_name: str
    #: Relative tolerance of the run's dtype: the same one the study judged its verdicts with.
    rtol: float
    figures: Figures

    def source(self, filter_text: str, rows: int) -> str:
        """How a finding cites its rows: the CSV, the filter, and how many rows matched."""
        return f"{code(self.csv_name)}: {filter_text} ({count(rows, 'row')})"


@dataclass
class SectionOutput:
    """A rendered section: answers for the top table, findings, then tables and figures; for
    a study that writes several CSVs, a rendered subsection per CSV, by CSV name."""

    findings: list[Finding] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    subsections: dict[str, SectionOutput] = field(default_factory=dict)

    def add(self, item: Answer | Finding | str) -> None:
        if isinstance(item, Answer):
            self.answers.append(item)
        elif isinstance(item, Finding):
            self.findings.append(item)
        else:
            self.blocks.append(item)


@dataclass
class Rows:
    """What a declared part reads: the measured rows (status ok), every row, and how to cite."""

    ok: pd.DataFrame
    all: pd.DataFrame
    inputs: SectionInputs
    #: What the derived columns a ``where`` may name mean, for citations.
    terms: Mapping[str, str] = field(default_factory=dict)
    #: Selections by ``where`` text, made once: several parts read the same rows.
    _selected: dict[str, pd.DataFrame] = field(default_factory=dict)

    @property
    def rtol(self) -> float:
        return self.inputs.rtol

    def select(self, where: str = "") -> pd.DataFrame:
        if where not in self._selected:
            self._selected[where] = select(self.ok, where)
        return self._selected[where]

    def groups(self, per: Sequence[str], where: str = "") -> list[tuple[dict, pd.DataFrame]]:
        return groups(self.select(where), per)

    def fill(self, caption: str, shown: int) -> str:
        """A caption template filled in: ``{csv}``, ``{rows}`` (how many shown), ``{rtol}``."""
        return caption.format(csv=code(self.inputs.csv_name), rows=shown, rtol=small(self.rtol))

    def table(self, caption: str, shown: int, headers: Sequence[str],
              body: Sequence[Sequence[str]], numeric: Sequence[bool]) -> str:
        """A Markdown table under its caption, filled in as :meth:`fill` does."""
        return self.fill(caption, shown) + "\n\n" + table(headers, body, numeric)

    def cite(self, values: dict, where: str, rows: int) -> str:
        """``reduction.csv: strategy = ddp, status = ok, devices_used >= 2 (18 rows)``."""
        parts = [f"{column} = {value}" for column, value in values.items()]
        shown = filter_text(where)
        for term, meaning in self.terms.items():
            shown = shown.replace(term, meaning)
        parts += ["status = ok"] + ([shown] if where else [])
        return self.inputs.source(", ".join(parts), rows)


Part = Callable[[Rows], Any]


@dataclass(frozen=True)
class Section:
    """How the report summarizes one study, or one CSV of a study that writes several."""

    #: The study's name; its CSV is ``<study>.csv``.
    study: str
    #: The section's heading.
    title: str
    #: One sentence under the heading: what the study measures.
    intro: str
    #: Columns computed once from the measured rows and the tolerance, for every part to read.
    derive: Callable[[pd.DataFrame, float], pd.DataFrame] | None = None
    #: What each derived column means when a ``where`` names it: how citations say it.
    terms: Mapping[str, str] = field(default_factory=dict)
    answers: Sequence[Part] = ()
    findings: Sequence[Part] = ()
    tables: Sequence[Part] = ()
    figures: Sequence[Part] = ()
    #: The CSV a subsection reads, ``<table>.csv``; empty: the study's one, ``<study>.csv``.
    table: str = ""
    #: A study that writes several CSVs: a section per CSV, drawn under this one's title and
    #: intro (this one's own parts, if any, read no CSV).
    subsections: Sequence[Section] = ()

    @property
    def csv(self) -> str:
        return f"{self.table or self.study}.csv"

    def summarize_run(self, frames: Mapping[str, pd.DataFrame], rtol: float,
                      figures: Figures) -> SectionOutput:
        """The section from the run's CSVs (``frames``, by CSV name); a subsection whose CSV
        the run did not write is left out."""
        if not self.subsections:
            return self.summarize(frames[self.csv], SectionInputs(self.csv, rtol, figures))
        return SectionOutput(subsections={
            sub.csv: sub.summarize(frames[sub.csv], SectionInputs(sub.csv, rtol, figures))
            for sub in self.subsections if sub.csv in frames})

    def summarize(self, frame: pd.DataFrame, inputs: SectionInputs) -> SectionOutput:
        """The section's answers, findings and blocks, from the study's rows."""
        output = SectionOutput()
        # An empty text is a missing value, as when the CSV is read (rows built in memory).
        ok = measured(frame).replace({"": None})
        if self.derive is not None and not ok.empty:
            ok = self.derive(ok, inputs.rtol)
        rows = Rows(ok, frame, inputs, self.terms)
        drawn = (*self.tables, *self.figures) if not ok.empty else ()
        for part in (*self.answers, *self.findings, *drawn):
            made = part(rows)
            # A part gives one item, several (a finding and the answer it rests on), or None;
            # each goes where its kind belongs.
            for item in made if isinstance(made, list | tuple) else [] if made is None else [made]:
                output.add(item)
        return output
