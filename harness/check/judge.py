"""One judge for every front-end: a step's comparisons in, judged rows out.

Each front-end of the check (the Setup matrix, ``--frameworks``, ``grad-check run``) runs
steps its own way and hands the engine only what it measured: for each point of a step,
the comparison of the measured tensors with the big batch's (compare.py) and whether the
ranks agreed; the precision the step ran in; the facts a fix is read from (fix.py).
:func:`judge_step` turns those into :class:`Judged` rows by one set of rules: the
tolerance of the precision, a fix from the front-end's own causes or else the engine's,
and every later row of a case whose step-0 gradient is a pure multiple said to follow
from it. :func:`judged_row` writes a judgement as a row of a front-end's CSV: the columns
every judged row shares (harness/columns.py ``JUDGED``) filled from it, the front-end's
own from the cells it measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from harness.check import causes
from harness.check.causes import (
    carried_update,
    no_gradient,
    no_update,
    precision_unresolved,
    update_beyond_precision,
)
from harness.check.causes.evidence import (
    Evidence,
    FrameworkStep,
    MatrixStep,
    ScriptStep,
)
from harness.check.compare import Comparison, worst_tensors
from harness.check.fix import Facts
from harness.check.precision import above_float32_rounding, tolerance
from harness.columns import Column
from harness.tolerances import FLOAT32_ROUNDING, dtype_name
from harness.verdicts import Equivalence, Status, skipped


@dataclass(frozen=True)
class Compared:
    """One point of a step as a front-end measured it."""

    point: str
    comparison: Comparison
    #: Whether every rank held the same tensors there (None: the ranks are not meant to).
    ranks_agree: bool | None = None
    #: The front-end's own cells that belong with this comparison (e.g. the frameworks'
    #: comparison under the framework's recipe).
    own: Mapping[str, Any] = field(default_factory=dict)
    #: The tolerance the comparison was judged at, where it is not its precision's (a
    #: float64 model whose loss alone casts to float32: that cast's rounding).
    rtol: float | None = None


@dataclass(frozen=True)
class Judged:
    """The engine's judgement of one step and point: what a row of every front-end says."""

    step: int
    point: str
    comparison: Comparison | None = None
    #: The precision the row is judged at (None: a row with nothing measured, say so).
    precision: torch.dtype | None = None
    fix: str = ""
    status: str = Status.OK
    error: str = ""
    ranks_agree: bool | None = None
    #: Under autocast, the residual of the step as run under it (None without autocast).
    autocast_residual: float | None = None
    own: Mapping[str, Any] = field(default_factory=dict)
    #: The ranks disagree where only rank 0's tensors were compared: a verdict of its own.
    ranks_differ: bool = False
    #: The tolerance judged at, where it is not the precision's (Compared.rtol).
    rtol: float | None = None
    #: The id of the cause ``fix`` says (harness/check/causes/), "" where none.
    cause: str = ""

    @property
    def verdict(self) -> str:
        if self.comparison is None or self.status == Status.UNRESOLVED:
            return ""
        if self.ranks_differ:
            return str(Equivalence.RANKS_DIFFER)
        return str(self.comparison.verdict)

    @property
    def scale(self) -> float:
        return self.comparison.scale if self.comparison else math.nan

    @property
    def residual(self) -> float:
        return self.comparison.residual if self.comparison else math.nan

    @property
    def worst_tensors(self) -> str:
        if self.comparison is None:
            return ""
        rtol = (self.rtol if self.rtol is not None else tolerance(self.precision)
                if self.precision is not None else 0.0)
        return worst_tensors(self.comparison.errors.items(), rtol)

    @property
    def precision_name(self) -> str:
        return dtype_name(self.precision) if self.precision is not None else ""

    @property
    def autocast_residual_cell(self) -> float:
        return math.nan if self.autocast_residual is None else self.autocast_residual


@dataclass(frozen=True)
class Seen:
    """What only a front-end measured of a point, for its causes (harness/check/causes/
    evidence.py): a script's run, a framework's step, the Setup matrix's micro-step."""

    script: ScriptStep | None = None
    framework: FrameworkStep | None = None
    matrix: MatrixStep | None = None


#: A front-end's own evidence of a point it compared.
Seeing = Callable[[Compared], Seen]


def nothing_seen(_compared: Compared) -> Seen:
    return Seen()


@dataclass(frozen=True)
class Memory:
    """What the judge carries from one step of a case to the next: the scale of a step-0
    gradient that is a pure multiple other than 1, which every later row it does not
    explain by itself names as its cause."""

    gradient_scale: float | None = None


class JudgedStep(NamedTuple):
    """A step's rows, and the memory the case's next step is judged with."""

    rows: list[Judged]
    memory: Memory


def judge_step(step: int, compared: Sequence[Compared], precision: torch.dtype, facts: Facts,
               memory: Memory = Memory(), seen: Seeing = nothing_seen,
               say_unresolved: bool = False, rank_zero_only: bool = False,
               explaining: bool = True) -> JudgedStep:
    """The rows of one step, in the order of ``compared``, and the memory the next step of
    the case is judged with (``memory``: the one this step's judgement returned before).

    A point where both sides were all zero compared nothing, and says so instead of a
    verdict. ``seen``: what the front-end measured of each point besides (its causes read
    it). ``say_unresolved``: a ``matches`` at a precision coarser than float32 says what its
    tolerance cannot resolve (for a front-end that runs no twin without autocast).
    ``rank_zero_only``: the front-end compared rank 0's tensors alone, so ranks that
    disagree are the row's verdict. ``explaining``: look for the rows' causes (only the
    rank that writes rows does: a cause may forward pieces)."""
    facts = replace(facts, rtol=tolerance(precision), gradient_scale=memory.gradient_scale)
    judged: list[Judged] = []
    for measured in compared:
        gradient = next((row for row in judged if row.point == "grad"), None)
        if not measured.comparison.nothing:
            facts = replace(facts, ranks_agree=measured.ranks_agree)
        evidence = evidence_of(step, measured, precision, facts, gradient, seen)
        judged.append(judged_point(evidence, measured, say_unresolved, rank_zero_only,
                                   explaining))
        if (step == 0 and measured.point == "grad"
                and measured.comparison.verdict is Equivalence.SCALED):
            memory = Memory(gradient_scale=measured.comparison.scale)
            facts = replace(facts, gradient_scale=memory.gradient_scale)  # its update's too
    return JudgedStep(judged, memory)


def evidence_of(step: int, measured: Compared, precision: torch.dtype, facts: Facts,
                gradient: Judged | None, seen: Seeing) -> Evidence:
    """What the causes of one point read: the judge's view of it and the front-end's."""
    own = seen(measured)
    return Evidence(step, measured.point, measured.comparison, facts, precision,
                    gradient.comparison if gradient else None,
                    gradient.verdict if gradient else "", gradient.status if gradient else "",
                    own.script, own.framework, own.matrix)


def judged_point(evidence: Evidence, measured: Compared, say_unresolved: bool,
                 rank_zero_only: bool, explaining: bool) -> Judged:
    """A point's row, by the judge's rules and then the first cause that applies."""
    if measured.comparison.nothing:
        return nothing_compared(evidence, measured)
    if say_unresolved and update_beyond_precision.CAUSE.applies(evidence):
        return unresolved_update(evidence, measured)
    if say_unresolved and carried_update.CAUSE.applies(evidence):
        return carried(evidence, measured)
    explained = causes.explain(evidence) if explaining else causes.UNEXPLAINED
    cause, fix = explained.cause, explained.fix
    status = Status.OK
    comparison, precision = measured.comparison, evidence.precision
    if (say_unresolved and not fix and explaining
            and precision_unresolved.CAUSE.applies(evidence)):
        cause, fix = precision_unresolved.CAUSE.id, precision_unresolved.CAUSE.fix(evidence)
        if above_float32_rounding(precision, comparison.residual, measured.point):
            status = Status.UNRESOLVED  # never a match above the rounding of what ran
    return Judged(evidence.step, measured.point, comparison, precision, fix, status,
                  ranks_agree=measured.ranks_agree, own=measured.own,
                  ranks_differ=rank_zero_only and measured.ranks_agree is False,
                  rtol=measured.rtol, cause=cause)


def carried(evidence: Evidence, measured: Compared) -> Judged:
    """An update that carries its gradient's difference (harness/check/causes/
    carried_update.py): it reads as its gradient does (``differs``, or ``unresolved``),
    judged at what a gradient's rounding leaves."""
    comparison = measured.comparison
    unresolved = evidence.gradient_status == Status.UNRESOLVED
    return Judged(evidence.step, measured.point,
                  comparison if unresolved else replace(comparison, verdict=Equivalence.DIFFERS),
                  evidence.precision, carried_update.CAUSE.fix(evidence),
                  Status.UNRESOLVED if unresolved else Status.OK,
                  ranks_agree=measured.ranks_agree, own=measured.own,
                  rtol=FLOAT32_ROUNDING["grad"], cause=carried_update.CAUSE.id)


def unresolved_update(evidence: Evidence, measured: Compared) -> Judged:
    """An update its precision cannot resolve after a matching gradient (harness/check/
    causes/update_beyond_precision.py)."""
    return Judged(evidence.step, measured.point, measured.comparison, evidence.precision,
                  update_beyond_precision.CAUSE.fix(evidence), Status.UNRESOLVED,
                  ranks_agree=measured.ranks_agree, own=measured.own,
                  cause=update_beyond_precision.CAUSE.id)


def nothing_compared(evidence: Evidence, measured: Compared) -> Judged:
    """A point all zero on both sides: no verdict (a run that compared nothing is not a
    match), unless the step's learning rate was 0, where no update is expected."""
    status, cause = Status.NO_UPDATE, no_update.CAUSE
    if no_gradient.CAUSE.applies(evidence):
        status, cause = Status.NO_GRADIENT, no_gradient.CAUSE
    elif not no_update.CAUSE.applies(evidence):
        return Judged(evidence.step, measured.point, None, evidence.precision, "",
                      skipped("the learning rate was 0 at this step (a warm-up from 0): no "
                              "update to compare"),
                      ranks_agree=measured.ranks_agree, own=measured.own)
    return Judged(evidence.step, measured.point, None, evidence.precision,
                  cause.fix(evidence), status, ranks_agree=measured.ranks_agree,
                  own=measured.own, cause=cause.id)


def judged_row(columns: Sequence[Column], judged: Judged, **cells: Any) -> dict[str, Any]:
    """A row of the CSV whose schema is ``columns``: each column the engine judges read from
    ``judged``, every other from ``judged.own`` and then ``cells``. A column left unfilled,
    or a cell no column holds, is a bug of the front-end, raised here."""
    given = {**judged.own, **cells}
    unknown = set(given) - {column.name for column in columns}
    if unknown:
        raise KeyError(f"cells of no column: {', '.join(sorted(unknown))}")
    row = {}
    for column in columns:
        if column.name in given:
            row[column.name] = given[column.name]
        elif column.judged is not None:
            row[column.name] = column.judged(judged)
        else:
            raise KeyError(f"column {column.name!r} left unfilled")
    return row


def at_full_precision(low: Sequence[Judged], full: Sequence[Judged]) -> list[Judged]:
    """A case run under autocast (``low``) judged with its twin run without autocast at the
    run's precision (``full``), by :func:`full_precision_decides`; every row keeps the
    autocast run's residual beside it."""
    twins = {(judged.step, judged.point): judged for judged in full}
    decided = []
    for judged in low:
        twin = twins.get((judged.step, judged.point))
        residual = judged.comparison.residual if judged.comparison else None
        if twin is not None and twin.comparison is not None and full_precision_decides(
                judged.status, twin.comparison.verdict):
            judged = twin
        decided.append(replace(judged, autocast_residual=residual))
    return decided


def full_precision_decides(status: str, twin_verdict: Equivalence | str | None) -> bool:
    """A case run under ``Setup.autocast`` (its row's ``status``) and its twin run without
    autocast at the run's precision: the twin's verdict stands where the twin differs from
    the big batch, since the autocast precision's tolerance (ten times bfloat16's rounding)
    would hide a split a few per cent off; the autocast run's stands elsewhere (its
    rounding within its tolerance, or what only autocast does)."""
    return (status == Status.OK and twin_verdict is not None
            and str(twin_verdict) not in ("", str(Equivalence.MATCHES)))

