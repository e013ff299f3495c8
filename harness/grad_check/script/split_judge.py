"""Rows from the captures: each optimizer's steps compared with the reference's, judged by
the check's engine.

The reference split ran twice: its two runs must agree (:func:`check_deterministic`),
and how far they are apart is each row's ``reference_noise``. Each other split's
optimizers are paired with the reference's (by the order of their first step and the
tensors they hold); each of their steps was compared by the split's own ranks, shard by
shard, with the engine's compare (harness/grad_check/script/points.py,
harness/check/compare.py: least-squares scale, residual), and is judged here by the
engine's judge (harness/check/judge.py) at the tolerance of the lowest precision either
run used. What only a script's step shows (each rank's record of it and the reference's:
other samples, a partial window, ranks that disagree, active dropout, a clip per
micro-step, a clip that hid the gradient's scale) is handed to the causes
(harness/check/causes/), which explain a difference before the check's own do: the
fingerprints explain, they never overrule a measurement.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from harness.check.causes.evidence import ScriptStep
from harness.check.causes.words import WHAT, shown
from harness.check.compare import Comparison
from harness.check.fix import Facts
from harness.check.judge import (
    Compared,
    Judged,
    JudgedStep,
    Memory,
    Seeing,
    Seen,
    judge_step,
    judged_row,
)
from harness.check.precision import lowest, tolerance
from harness.check.shards import comparison_of
from harness.columns import POINTS
from harness.grad_check.script import factors
from harness.grad_check.script.records import Captured
from harness.grad_check.script.schema import COLUMNS
from harness.grad_check.script.wire import PointFit
from harness.tolerances import FLOAT32_ROUNDING
from harness.verdicts import Status

#: (optimizer, step, point) -> the reference's noise there.
Noise = dict[tuple[int, int, str], float]


class Unmatched(Exception):
    """The split's optimizer holds other tensors than the reference's: nothing to fit."""


def precision(*runs: Captured) -> torch.dtype:
    """The lowest floating type any of the runs used (parameters, gradients, losses, every
    operation behind a loss: harness/grad_check/script/graph.py)."""
    return lowest(dtype for run in runs for dtype in run.dtypes)


def cast_rounding(point: str, *runs: Captured) -> float | None:
    """Where a float64 model rounds to float32 only in some operations (a loss that casts
    its logits, as transformers' and torchtune's do), the most that float32 rounding can
    leave in the step (``FLOAT32_ROUNDING``): the point is judged at it, since no run in
    a higher precision can resolve more. None for any other run."""
    models = [dtype for run in runs for dtype in run.model_dtypes]
    if models and lowest(models) == torch.float64 and precision(*runs) == torch.float32:
        return FLOAT32_ROUNDING[point]
    return None


def recorded(measured: Captured, reference: Captured, optimizer: int, step: int,
             point: str) -> PointFit:
    """What the measured run's ranks found comparing ``point`` of ``step`` with the
    reference's first run (harness/grad_check/script/points.py); parameters as updates
    from where the reference started the step."""
    if (optimizer >= len(measured.optimizers)
            or measured.names(optimizer) != reference.names(optimizer)):
        raise Unmatched(unmatched(measured, reference, optimizer))
    found = measured.compared(optimizer, step, point)
    if found is None:
        raise Unmatched(f"{reference.label(optimizer)}'s step {step} {WHAT[point]} was not "
                        "compared: the capture could not read it")
    if found.unmatched:
        raise Unmatched(f"{reference.label(optimizer)} {found.unmatched}")
    return found


def unmatched(measured: Captured, reference: Captured, optimizer: int) -> str:
    label = reference.label(optimizer)
    if optimizer >= len(measured.optimizers):
        return (f"the reference steps {len(reference.optimizers)} optimizer(s), this split "
                f"{len(measured.optimizers)}: {label} never stepped here")
    ours, theirs = measured.names(optimizer), reference.names(optimizer)
    extra = [name for name in ours if name not in theirs]
    missing = [name for name in theirs if name not in ours]
    return (f"{label} holds other tensors than at the reference"
            + (f" ({shown(extra)} only here" if extra else " (")
            + (f"; {shown(missing)} only there)" if missing else ")"))


def compared(measured: Captured, reference: Captured, optimizer: int, step: int, point: str,
             rtol: float) -> Comparison:
    return comparison_of(recorded(measured, reference, optimizer, step, point).recorded(), rtol)


def noise(again: Captured, first: Captured, optimizer: int, step: int, point: str) -> float:
    """``||again - first|| / ||again||`` at scale 1 (updates for ``params``)."""
    return recorded(again, first, optimizer, step, point).each


@dataclass
class SplitJudge:
    """The rows of one split: each optimizer's steps x points against the reference's first
    run."""

    measured: Captured
    reference: Captured
    reference_noise: Noise
    global_batch: int
    #: (optimizer, step, point) -> how a value that is both N and k is named there, as the
    #: other splits of the run tell (factors.py); "N or k" where they do not.
    ties: Mapping[factors.Key, str] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        return [self.row(judged) for judged in self.judged()]

    def judged(self) -> list[Judged]:
        if not self.measured.stepped:
            return self.errors(0, 0, self.missing_step(0, 0))
        judged: list[Judged] = []
        for optimizer in range(len(self.reference.optimizers)):
            judged += self.optimizer_judged(optimizer)
        return judged

    def optimizer_judged(self, optimizer: int) -> list[Judged]:
        split = self.measured.run.split
        facts = Facts(world_size=split.world_size, accum_steps=split.accum_steps,
                      batchnorm=frozenset(self.measured.batchnorm))
        wanted = self.reference.steps(optimizer)
        taken = (self.measured.steps(optimizer)
                 if optimizer < len(self.measured.optimizers) else 0)
        judged: list[Judged] = []
        memory = Memory()
        for step in range(min(wanted, taken)):
            try:
                rows, memory = self.step_judged(optimizer, step, facts, memory)
                judged += rows
            except Unmatched as unmatched_:
                return judged + self.errors(optimizer, step, str(unmatched_))
        if taken < wanted:
            judged += self.errors(optimizer, taken, self.missing_step(optimizer, taken))
        return judged

    def missing_step(self, optimizer: int, step: int) -> str:
        failure = self.measured.run.failure
        if failure is not None:
            return str(failure)
        if not self.measured.stepped:
            return "the script ended without stepping an optimizer"
        if optimizer >= len(self.measured.optimizers):
            return unmatched(self.measured, self.reference, optimizer)
        return (f"the script ended after {step} step(s) of "
                f"{self.reference.label(optimizer)}; the reference took "
                f"{self.reference.steps(optimizer)}")

    def step_judged(self, optimizer: int, step: int, facts: Facts,
                    memory: Memory) -> JudgedStep:
        dtype = precision(self.measured, self.reference)
        rtol = tolerance(dtype)
        facts = replace(facts, piece_counts=self.measured.counts(optimizer, step),
                        tie=factors.step_tie(self.ties, self.reference.label(optimizer), step),
                        learning_rates=tuple(self.reference.learning_rates(optimizer, step)))
        own = self.own_cells(optimizer, step)
        points = []
        for point in POINTS:
            cast = cast_rounding(point, self.measured, self.reference)
            points.append(Compared(
                point, compared(self.measured, self.reference, optimizer, step, point,
                                cast or rtol),
                self.measured.ranks_agree(optimizer, step, point),
                {**own, "reference_noise": self.reference_noise.get((optimizer, step, point),
                                                                   math.nan)}, cast))
        return judge_step(step, points, dtype, facts, memory, seen=self.seen(optimizer, step),
                          say_unresolved=True, rank_zero_only=True)

    def own_cells(self, optimizer: int, step: int) -> dict[str, Any]:
        clips = self.measured.clips(optimizer, step)
        return {"optimizer": self.reference.label(optimizer),
                "sharding": self.measured.sharding(optimizer),
                "clip": "; ".join(dict.fromkeys(clips)),
                "clip_factor": self.measured.clip_factor(optimizer, step) if clips else math.nan}

    def seen(self, optimizer: int, step: int) -> Seeing:
        """What the split's and the reference's ranks recorded of the step, for the causes
        only a script's run shows (harness/check/causes/: its samples, clips, dropout)."""
        split = self.measured.run.split
        records = tuple(self.measured.records(optimizer, step))
        reference = tuple(self.reference.records(optimizer, step))

        def seeing(measured: Compared) -> Seen:
            return Seen(script=ScriptStep(
                split.world_size, split.accum_steps, self.global_batch, records, reference,
                tuple(self.measured.dropout), frozenset(self.measured.frameworks),
                self.measured.disagreement(optimizer, step, measured.point)))

        return seeing

    def row(self, judged: Judged) -> dict[str, Any]:
        split = self.measured.run.split
        return judged_row(COLUMNS, judged, split=split.label, world_size=split.world_size,
                          accum_steps=split.accum_steps,
                          micro_batch=split.micro_batch(self.global_batch),
                          reference=self.reference.run.split.label,
                          ran_on=self.measured.ran_on,
                          command=shlex.join(self.measured.run.command))

    def errors(self, optimizer: int, step: int, error: str) -> list[Judged]:
        label = (self.reference.label(optimizer)
                 if optimizer < len(self.reference.optimizers) else "")
        sharding = (self.measured.sharding(optimizer)
                    if optimizer < len(self.measured.optimizers) else "")
        own = {"optimizer": label, "sharding": sharding, "clip": "", "clip_factor": math.nan,
               "reference_noise": math.nan}
        return [Judged(step, point, status=Status.ERROR, error=error, own=own)
                for point in POINTS]
