"""What a study is: its schema, its options, its cases, and how to measure one.

A study is a plug-in over the driver (harness/runner.py). Everything about it is
declared once, next to its measuring code, in its own package under
``harness/studies/<name>/``:

- ``columns``: the CSV's own columns, each a :class:`Column` with its unit and
  meaning (docs/results.md's tables are printed from these), declared in the
  package's torch-free ``schema.py`` so that the registry and the report read them
  without the measuring code; a study that writes several CSVs declares them as
  ``tables()`` (its ``schema.TABLES``) and says which one a case's rows go to;
- ``Options``: a frozen dataclass of the study's own settings, each field an
  :func:`option` (flag, help, parser); it validates itself in ``__post_init__``
  and the command line registers its fields as flags;
- ``cases`` / ``run_case``: the matrix and the measurement; the measuring code
  writes every verdict column (words from :mod:`harness.verdicts`, booleans, or
  :func:`named_multiple`), judged with the tolerances of :mod:`harness.tolerances`;
- ``report.py`` beside it: the report section, which only reads the rows.

Adding a study = one package + one line in :data:`harness.studies.STUDY_PACKAGES`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from harness.context import CONTEXT_COLUMNS
from harness.options import NoOptions, StudyOptions
from harness.studies.schema import TRAILING_COLUMNS, Column, Table
from harness.tolerances import close

if TYPE_CHECKING:
    import pandas as pd

    from harness.context import RunContext


assert tuple(c.name for c in TRAILING_COLUMNS[:-1]) == CONTEXT_COLUMNS


# -------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One cell of a study's matrix."""

    study: str
    #: The case's coordinates, in column order: they become the row's first columns.
    spec: tuple[tuple[str, Any], ...]
    #: Ranks that run the case together.
    participants: int = 1
    #: True: the case runs collectives on the subgroup of ranks 0..participants-1.
    #: False: it is a single process, which the runner may place on any rank.
    collective: bool = False
    #: Rough relative cost, for spreading single-process cases over idle ranks.
    cost: float = 1.0

    @classmethod
    def of(cls, study: str, participants: int = 1, collective: bool | None = None,
           cost: float = 1.0, **spec: Any) -> Case:
        """``collective`` defaults to ``participants > 1``; pass True for a
        one-rank case that still uses its (one-rank) process group, e.g. DDP at N = 1."""
        if collective is None:
            collective = participants > 1
        return cls(study, tuple(spec.items()), participants, collective, cost)

    @property
    def id(self) -> str:
        """Stable and readable: the key a resumed run and the report refer to."""
        return "/".join([self.study, *(f"{axis}={value}" for axis, value in self.spec)])

    @property
    def params(self) -> Mapping[str, Any]:
        return dict(self.spec)

    def __getitem__(self, name: str) -> Any:
        return self.params[name]


# -------------------------------------------------------------------- study
class Study(ABC):
    """A named experiment whose cases become the rows of one CSV."""

    name: ClassVar[str]
    #: One line for ``--list``.
    summary: ClassVar[str]
    #: A worked command for ``--help``.
    example: ClassVar[str]
    #: The study's own columns, after ``study`` and ``case_id``, before the context columns.
    columns: ClassVar[tuple[Column, ...]]
    #: The study's own settings (flags); :class:`NoOptions` when it has none.
    Options: ClassVar[type[StudyOptions]] = NoOptions
    #: Part of a run that names no ``--studies``.
    in_default_run: ClassVar[bool] = True
    #: Its collective cases may run on any slot of N ranks (harness/schedule.py), side by
    #: side: true for a study that addresses ranks only relative to the group the run gives
    #: it (``run.group(N)``, ``run.reports(case)``). False, the safe default, keeps ranks
    #: 0..N-1 (e.g. ``comm``, which times collectives; ``training``, which gathers rows to
    #: global rank 0).
    any_slot: ClassVar[bool] = False

    def __init__(self, options: StudyOptions | None = None) -> None:
        self.options = options if options is not None else self.Options()

    @classmethod
    def tables(cls) -> tuple[Table, ...]:
        """The CSVs the study writes: one, ``<name>.csv`` with its ``columns``, unless it
        declares several (each case's rows go to the table :meth:`table_of` names)."""
        return (Table(cls.name, cls.columns),)

    def table_of(self, case: Case) -> Table:
        """The CSV ``case``'s rows go to: the study's one."""
        (table,) = self.tables()
        return table

    @classmethod
    def own_columns(cls) -> tuple[str, ...]:
        return tuple(c.name for c in cls.columns)

    @classmethod
    def column_names(cls) -> tuple[str, ...]:
        """Every column of the study's one CSV, in order."""
        (table,) = cls.tables()
        return table.column_names()

    @classmethod
    def schema(cls) -> tuple[Column, ...]:
        (table,) = cls.tables()
        return table.schema()

    def unavailable(self) -> str | None:
        """Why this study cannot run on this installation (e.g. an optional extra is
        missing), or None. A study that is unavailable is left out of the default run."""
        return None

    @abstractmethod
    def cases(self, run: RunContext) -> list[Case]:
        """Every case of the study for this run, in the order rows appear in the CSV."""

    @abstractmethod
    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        """Measure ``case``; return its rows (usually one) where ``run.reports(case)``,
        None on the other ranks of a collective case.

        A row holds the study's own columns plus ``status`` and, where it differs
        from the run's, ``device``; the runner adds the rest."""

    def summary_table(self, frame: pd.DataFrame) -> str:
        """A few lines for the console at the end of the run."""
        return frame.drop(columns=["study", "case_id", *CONTEXT_COLUMNS]).head(20).to_string()

    def table_summary(self, table: Table, frame: pd.DataFrame) -> str:
        """The console's lines for one of the study's CSVs: :meth:`summary_table`'s, unless
        a study that writes several says something of its own per CSV."""
        return self.summary_table(frame)


def tables_written(study: Study, cases: list[Case]) -> list[Table]:
    """The study's tables that some of ``cases`` write to, in the study's order."""
    used = {study.table_of(case) for case in cases}
    return [table for table in study.tables() if table in used]


def rows_by_table(study: Study, cases: list[Case], rows: list[dict[str, Any]]
                  ) -> dict[Table, list[dict[str, Any]]]:
    """``rows`` of ``cases``, in their order, by the table each case writes to."""
    table_of = {case.id: study.table_of(case) for case in cases}
    split: dict[Table, list[dict[str, Any]]] = {t: [] for t in tables_written(study, cases)}
    for row in rows:
        split[table_of[row["case_id"]]].append(row)
    return split


def named_multiple(scale: float, count: int, rtol: float, name: str) -> str:
    """Which of 1, 1/``name`` and ``name`` ``scale`` equals within ``rtol``, or "" when none
    does; ``count`` is what the letter ``name`` stands for (N devices, k micro-steps).

    A ratio column the report can name in words instead of listing numbers; where the count
    is 1 the three coincide and "1", checked first, is the plain word for it.
    """
    for word, multiple in (("1", 1.0), (f"1/{name}", 1.0 / count), (name, float(count))):
        if not math.isnan(scale) and close(scale, multiple, rtol):
            return word
    return ""
