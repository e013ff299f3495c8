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

from harness.check.compare import Comparison, worst_tensors
from harness.check.fix import Facts, suggest
from harness.check.precision import (
    above_float32_rounding,
    coarser_than_float32,
    tolerance,
    unresolved_below,
)
from harness.columns import Column
from harness.tolerances import FLOAT32_ROUNDING, dtype_name
from harness.verdicts import Equivalence, Status, skipped

#: A point as a sentence names it.
WHAT = {"grad": "gradient", "params": "update", "buffers": "buffers"}


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


#: A front-end's own cause of a row's difference, tried before the engine's fixes: the
#: fix text ("" for none), or None to leave the row to :func:`~harness.check.fix.suggest`.
#: It is given the rows of the step judged so far (the update's cause may depend on
#: whether the gradient matched).
Cause = Callable[[Compared, Facts, Sequence[Judged]], "str | None"]


def no_cause(_compared: Compared, _facts: Facts, _judged: Sequence[Judged]) -> str | None:
    return None


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
               memory: Memory = Memory(), cause: Cause = no_cause, say_unresolved: bool = False,
               rank_zero_only: bool = False) -> JudgedStep:
    """The rows of one step, in the order of ``compared``, and the memory the next step of
    the case is judged with (``memory``: the one this step's judgement returned before).

    A point where both sides were all zero compared nothing, and says so instead of a
    verdict. ``say_unresolved``: a ``matches`` at a precision coarser than float32 says what
    its tolerance cannot resolve (for a front-end that runs no twin without autocast).
    ``rank_zero_only``: the front-end compared rank 0's tensors alone, so ranks that
    disagree are the row's verdict."""
    facts = replace(facts, rtol=tolerance(precision), gradient_scale=memory.gradient_scale)
    judged: list[Judged] = []
    for measured in compared:
        if measured.comparison.nothing:
            judged.append(nothing_compared(step, measured, precision, facts))
            continue
        facts = replace(facts, ranks_agree=measured.ranks_agree)
        gradient = next((row for row in judged if row.point == "grad"), None)
        if say_unresolved and beyond_its_precision(measured, precision, gradient):
            judged.append(unresolved_update(step, measured, precision, gradient))
        elif say_unresolved and carries_gradient_difference(measured, gradient):
            judged.append(carried_update(step, measured, precision, gradient))
        else:
            judged.append(judged_by_cause(step, measured, precision, facts,
                                          cause(measured, facts, judged), say_unresolved,
                                          rank_zero_only))
        if (step == 0 and measured.point == "grad"
                and measured.comparison.verdict is Equivalence.SCALED):
            memory = Memory(gradient_scale=measured.comparison.scale)
            facts = replace(facts, gradient_scale=memory.gradient_scale)  # its update's too
    return JudgedStep(judged, memory)


def judged_by_cause(step: int, measured: Compared, precision: torch.dtype, facts: Facts,
                    fix: str | None, say_unresolved: bool, rank_zero_only: bool) -> Judged:
    """A row whose fix is the front-end's cause, else the engine's (None: no cause of the
    front-end's own); a match left open by its precision says what it leaves open."""
    if fix is None:
        fix = suggest(measured.point, measured.comparison, facts)
    status = Status.OK
    residual = measured.comparison.residual
    if say_unresolved and measured.comparison.verdict is Equivalence.MATCHES and not fix:
        fix = unresolved_below(precision, facts.rtol, residual, measured.point)
        if above_float32_rounding(precision, residual, measured.point):
            status = Status.UNRESOLVED  # never a match above the rounding of what ran
    return Judged(step, measured.point, measured.comparison, precision, fix, status,
                  ranks_agree=measured.ranks_agree, own=measured.own,
                  ranks_differ=rank_zero_only and measured.ranks_agree is False,
                  rtol=measured.rtol)


def beyond_its_precision(measured: Compared, precision: torch.dtype,
                         gradient: Judged | None) -> bool:
    """An update off at scale 1 in a precision coarser than float32, right after a gradient
    of the same step that matched, on ranks that agree: in such a run an adaptive
    optimizer's magnified rounding (TRL's bf16 defaults with packing: the gradient 0.0017
    off, AdamW's update 0.068; both below 1e-5 in float32) and a difference of the
    optimizer's own look alike. A front-end with a twin at full precision lets the twin
    decide instead."""
    comparison = measured.comparison
    return (measured.point == "params" and coarser_than_float32(precision)
            and comparison.verdict is Equivalence.DIFFERS
            and abs(comparison.scale - 1.0) <= tolerance(precision)
            and measured.ranks_agree is not False
            and gradient is not None and gradient.status == Status.OK
            and gradient.verdict == Equivalence.MATCHES)


def carries_gradient_difference(measured: Compared, gradient: Judged | None) -> bool:
    """An update within its own bound (``FLOAT32_ROUNDING["params"]``, which holds what an
    adaptive optimizer can magnify float32's rounding to) right after a gradient of the
    same step known not to be the big batch's (``differs``, or ``unresolved`` above its
    rounding), and itself off by more than a gradient's rounding: the gradient's difference
    passed into the step undamped (SGD's update is the gradient times the lr), so the
    update is not known to match either. An update that an optimizer damped below the
    gradient's rounding is measured to match and keeps its verdict."""
    return (measured.point == "params" and gradient is not None
            and measured.comparison.verdict is Equivalence.MATCHES
            and measured.comparison.residual > FLOAT32_ROUNDING["grad"]
            and (gradient.status == Status.UNRESOLVED
                 or (gradient.status == Status.OK
                     and gradient.verdict == Equivalence.DIFFERS)))


def carried_update(step: int, measured: Compared, precision: torch.dtype,
                   gradient: Judged) -> Judged:
    """The update of :func:`carries_gradient_difference`: it reads as its gradient does
    (``differs``, or ``unresolved``), the gradient named as the cause."""
    comparison = measured.comparison
    fix = (f"the update is off by {comparison.residual:.3g}, as the step's gradient is "
           f"({gradient.residual:.3g}): it follows from that gradient, whose cause is this "
           "step's cause; the update's own bound, which holds what an adaptive optimizer "
           "can make of rounding, does not make it a match")
    unresolved = gradient.status == Status.UNRESOLVED
    return Judged(step, measured.point,
                  comparison if unresolved else replace(comparison, verdict=Equivalence.DIFFERS),
                  precision, fix, Status.UNRESOLVED if unresolved else Status.OK,
                  ranks_agree=measured.ranks_agree, own=measured.own,
                  rtol=FLOAT32_ROUNDING["grad"])  # judged at what a gradient's rounding leaves


def unresolved_update(step: int, measured: Compared, precision: torch.dtype,
                      gradient: Judged) -> Judged:
    name = dtype_name(precision)
    fix = (f"the update is {measured.comparison.residual:.2g} off, beyond {name}'s tolerance "
           f"{tolerance(precision):.2g}, after a gradient that matched (residual "
           f"{gradient.residual:.2g}): an adaptive optimizer (Adam) magnifies {name}'s "
           "rounding of the gradient in its step, and a run in "
           f"{name} cannot tell that from a difference of the optimizer's state or settings: "
           "run once in float32 to resolve it")
    return Judged(step, measured.point, measured.comparison, precision, fix,
                  Status.UNRESOLVED, ranks_agree=measured.ranks_agree, own=measured.own)


def nothing_compared(step: int, measured: Compared, precision: torch.dtype,
                     facts: Facts) -> Judged:
    """A point all zero on both sides: no verdict (a run that compared nothing is not a
    match), unless the step's learning rate was 0, where no update is expected."""
    if measured.point == "grad":
        status, fix = Status.NO_GRADIENT, (
            "the gradient is all zero, here and in the big batch alike: nothing was compared "
            "(a loss with no gradient, e.g. a cross-entropy over a single class; every "
            "parameter frozen; a gradient zeroed before it was read)")
    elif facts.learning_rates and all(rate == 0 for rate in facts.learning_rates):
        status, fix = skipped("the learning rate was 0 at this step (a warm-up from 0): no "
                              "update to compare"), ""
    else:
        status, fix = Status.NO_UPDATE, (
            "the step moved no parameter, here and in the big batch alike, at a learning "
            "rate other than 0: nothing was compared (a clip to 0, a gradient zeroed before "
            "the step, a step the optimizer skipped)")
    return Judged(step, measured.point, None, precision, fix, status,
                  ranks_agree=measured.ranks_agree, own=measured.own)


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

