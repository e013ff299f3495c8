"""An experiment of the update study, declared once: a plug-in.

The update study asks several questions of the optimizer step (which learning-rate
factor restores a recipe's update, where clipping must run, ...). Each is an
:class:`Experiment` in ``experiments/``: its name, its question, its CSV's columns,
its grid of cases, how to measure a case, and its part of the report. The study's
cases, its CSVs (one per experiment, ``update-<name>.csv``), its schema and its report
section are all read from the registry, ``experiments.EXPERIMENTS``.

Free of torch: the schema and the report read the experiments without running them; an
experiment's module imports torch inside its ``measure``, when a case first runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.report.findings import skipped
from harness.report.section import Part, Rows, Section
from harness.studies.schema import Column, Table

if TYPE_CHECKING:
    import pandas as pd

    from harness.report.section import SectionInputs
    from harness.studies.update.trial import Trial

#: The study the experiments belong to: its CSVs are ``update-<experiment>.csv``.
STUDY = "update"
#: An experiment's name: it names a CSV file and appears in case ids.
NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
#: The columns every experiment's CSV starts with: where its case ran.
COORDINATES = ("strategy", "world_size")

#: Rows measured by a case (its experiment's columns but the case's coordinates), or None
#: on the ranks of a collective case that do not report.
MeasuredRows = list[dict[str, Any]] | None


@dataclass(frozen=True)
class Grid:
    """What one run offers an experiment's cases."""

    #: The run's strategies among the study's, in the study's order.
    strategies: tuple[str, ...]
    #: The run's world sizes.
    world_sizes: tuple[int, ...]
    #: k, the micro-steps of the accumulation recipes (``--update-accum-steps``).
    accum_steps: int
    #: The full matrix (``--matrix full``).
    full: bool

    @property
    def sizes(self) -> tuple[int, ...]:
        """World sizes of the multi-device recipes: every one of the run's in the full matrix;
        by default those >= 2 (one device is the big batch itself), or 1 if none is."""
        if self.full:
            return self.world_sizes
        return tuple(n for n in self.world_sizes if n >= 2) or (1,)

    @property
    def widest(self) -> tuple[int, ...]:
        """World sizes of the costlier cases: the run's widest (every one in the full matrix)."""
        return self.sizes if self.full else (max(self.world_sizes),)


#: An experiment's ``measure``: a case's rows from its trial (the name is a string: Trial is
#: only a type here).
Measure = Callable[["Trial"], MeasuredRows]


@dataclass(frozen=True)
class Experiment:
    """One question of the update study, and everything the study, its CSV and its report
    need of it."""

    #: The one spelling of its name: the ``experiment`` of its cases' ids, its CSV's name.
    name: str
    #: The question its rows answer: its CSV's description and its subsection's title.
    question: str
    #: What it measures, in a few sentences: its subsection's intro.
    intro: str
    #: Its CSV's own columns, in order: the case's coordinates (``strategy``, ``world_size``
    #: and, where the case has one, ``accum_steps``) and what ``measure`` writes.
    columns: tuple[Column, ...]
    #: Its cases' coordinates in a run: ``strategy``, ``world_size``, ``accum_steps``.
    grid: Callable[[Grid], list[dict[str, Any]]]
    #: The rows of one case: every column but the coordinates (the study adds them).
    measure: Measure
    #: Rough milliseconds per micro-step, for spreading single-process cases over idle ranks.
    cost_ms: float
    #: Its report parts, each a function of its CSV's rows (:class:`Rows`): answers and
    #: findings; tables; figures (drawn when a row was measured).
    findings: Sequence[Part] = ()
    tables: Sequence[Part] = ()
    figures: Sequence[Part] = ()
    #: A few lines for the console at the end of the run, from its rows; None: the first rows.
    summary: Callable[[pd.DataFrame], str] | None = None

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ValueError(f"experiment name {self.name!r}: lower-case words joined by '-' "
                             "(it names a CSV and a case id's experiment)")
        names = [column.name for column in self.columns]
        if names[:len(COORDINATES)] != list(COORDINATES):
            raise ValueError(f"experiment {self.name}: its columns start with "
                             f"{', '.join(COORDINATES)} (the case's coordinates), not "
                             f"{', '.join(names[:len(COORDINATES)])}")
        if len(set(names)) != len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"experiment {self.name}: columns declared twice: "
                             f"{', '.join(twice)}")
        if not self.cost_ms > 0:
            raise ValueError(f"experiment {self.name}: cost_ms {self.cost_ms} is not > 0")

    @property
    def table(self) -> Table:
        return Table(f"{STUDY}-{self.name}", self.columns, self.question[:1].upper()
                     + self.question[1:])

    def cost(self, coordinates: dict[str, Any]) -> float:
        """The rough relative cost of a case: its micro-steps, more with more ranks."""
        return (self.cost_ms * coordinates.get("accum_steps", 1)
                * (1 + 0.25 * coordinates["world_size"]))

    def unmeasured(self, coordinates: dict[str, Any], status: str) -> dict[str, Any]:
        """The row of a case that was not measured: its coordinates, ``status`` saying why,
        every measured column empty."""
        return {**dict.fromkeys(c.name for c in self.columns), **coordinates, "status": status}

    def section(self) -> Section:
        """Its subsection of the update study's report: its parts, then the strategies it
        could not measure."""
        return Section(study=STUDY, table=self.table.name, title=f"`{self.name}`: {self.question}",
                       intro=self.intro, findings=(*self.findings, skipped()),
                       tables=self.tables, figures=self.figures)


def report_part(where: str = "") -> Callable[[Callable[[pd.DataFrame, SectionInputs], Any]],
                                             Part]:
    """A report part made of ``build(rows, inputs)``, the measured rows ``where`` selects (a
    pandas query; all by default); nothing when it selects none."""
    def decorate(build: Callable[[pd.DataFrame, SectionInputs], Any]) -> Part:
        def part(rows: Rows) -> Any:
            selected = rows.select(where)
            return None if selected.empty else build(selected, rows.inputs)
        part.__doc__ = build.__doc__
        return part
    return decorate
