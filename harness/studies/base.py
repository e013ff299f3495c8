"""What a study is: a list of cases, and how to measure one of them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from harness.context import CONTEXT_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

    from harness.context import RunContext


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
        one-rank case that still uses its (one-rank) process group, e.g. DDP at k = 1."""
        if collective is None:
            collective = participants > 1
        return cls(study, tuple(spec.items()), participants, collective, cost)

    @property
    def id(self) -> str:
        """Stable and readable: the key a resumed run and the report refer to."""
        return "/".join([self.study, *(f"{k}={v}" for k, v in self.spec)])

    @property
    def params(self) -> Mapping[str, Any]:
        return dict(self.spec)

    def __getitem__(self, name: str) -> Any:
        return self.params[name]


class Study(ABC):
    """A named experiment whose cases become the rows of one CSV."""

    name: ClassVar[str]
    #: One line for ``--list``.
    summary: ClassVar[str]
    #: A worked command for ``--help``.
    example: ClassVar[str]
    #: The study's own columns, after ``study`` and ``case_id``, before the context columns.
    own_columns: ClassVar[tuple[str, ...]]

    @property
    def csv_name(self) -> str:
        return f"{self.name}.csv"

    @property
    def columns(self) -> tuple[str, ...]:
        return ("study", "case_id", *self.own_columns, *CONTEXT_COLUMNS, "status")

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
