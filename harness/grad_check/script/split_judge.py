"""Rows from the captures: each optimizer's steps compared with the reference's, judged by
the check's engine.

The reference split ran twice: its two runs must agree (:func:`check_deterministic`),
and how far they are apart is each row's ``reference_noise``. Each other split's
optimizers are paired with the reference's (by the order of their first step and the
tensors they hold); each of their steps was compared by the split's own ranks, shard by
shard, with the engine's compare (harness/grad_check/script/points.py,
harness/check/compare.py: least-squares scale, residual), and is judged here by the
engine's judge (harness/check/judge.py) at the tolerance of the lowest precision either
run used. What only a script's step shows explains a difference before the engine's fixes do: other
samples (explain.py: the fingerprints explain, they never overrule a measurement), a
partial window, ranks that disagree, active dropout, an update off although its gradient
matched, a clip that hid the gradient's scale.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from harness.check.compare import Comparison
from harness.check.fix import Facts, named_value, suggest, window_count_fix
from harness.check.judge import (
    WHAT,
    Compared,
    Judged,
    JudgedStep,
    Memory,
    judge_step,
    judged_row,
)
from harness.check.precision import lowest, tolerance
from harness.check.shards import comparison_of
from harness.columns import POINTS
from harness.grad_check.script import explain, factors
from harness.grad_check.script.records import Captured
from harness.grad_check.script.schema import COLUMNS
from harness.grad_check.script.wire import PointFit
from harness.tolerances import CLIPPED_ALIKE, FLOAT32_ROUNDING, close
from harness.verdicts import Equivalence, Status

#: Names shown where a list is named in a line.
SHOWN = 3
#: (optimizer, step, point) -> the reference's noise there.
Noise = dict[tuple[int, int, str], float]


class Unmatched(Exception):
    """The split's optimizer holds other tensors than the reference's: nothing to fit."""


def shown(names: Sequence[str]) -> str:
    return ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")


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


def learning_rate_fix(update: Comparison, facts: Facts) -> str:
    """The optimizer got the reference's gradient, yet its update differs: the step itself
    (its learning rate) is not the reference's."""
    if update.verdict is Equivalence.MATCHES:
        return ""
    if update.verdict is Equivalence.SCALED:
        scale = named_value(update.scale, facts.world_size, facts.accum_steps, facts.rtol,
                            facts.tie)
        return (f"the gradient matches but the update is {scale} times the reference's: the "
                "learning rate of this step differs, e.g. a scheduler stepped another number "
                "of times (once per micro-step, or once per rank as Accelerate steps a "
                "prepared scheduler) or an lr scaled with N or k; step it once per optimizer "
                "step")
    return ("the gradient matches but the update does not: the optimizer's state or settings "
            "differ from the reference's (a scheduler, an lr or weight decay set from N or k, "
            "state carried from an earlier step, a clip that bound differently)")


def rounding_only(gradient: Comparison, facts: Facts) -> bool:
    """Whether a matching gradient is off by no more than its precision's rounding (float32:
    ``FLOAT32_ROUNDING``; float64: its tolerance, which sits at rounding). Below float32 no
    such bound is known: bfloat16's tolerance holds its rounding and small differences
    alike, so a gradient matching there is never called rounding alone."""
    if facts.rtol == tolerance(torch.float32):
        return gradient.residual <= FLOAT32_ROUNDING["grad"]
    return facts.rtol <= tolerance(torch.float64) and gradient.residual <= facts.rtol


def amplified_fix(gradient: Comparison, facts: Facts) -> str:
    """An update off where the gradient is within its tolerance but not known to be only
    its rounding: an adaptive optimizer magnifies what is left in its step."""
    if facts.rtol <= tolerance(torch.float32):
        return (f"the gradient is within the precision's tolerance but off by more than its "
                f"rounding (residual {gradient.residual:.2g}), and the update follows from it: "
                "an adaptive optimizer (Adam) magnifies a small gradient difference in its "
                "step; the gradient's difference is the cause: run once in float64 to "
                "resolve it")
    return (f"the gradient is within the precision's tolerance (residual "
            f"{gradient.residual:.2g}), where its rounding and a small difference look alike, "
            "and the update follows from it: an adaptive optimizer (Adam) magnifies either in "
            "its step: run once in float32 to tell them apart")


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
        return judge_step(step, points, dtype, facts, memory, cause=self.cause(optimizer, step),
                          say_unresolved=True, rank_zero_only=True)

    def own_cells(self, optimizer: int, step: int) -> dict[str, Any]:
        clips = self.measured.clips(optimizer, step)
        return {"optimizer": self.reference.label(optimizer),
                "sharding": self.measured.sharding(optimizer),
                "clip": "; ".join(dict.fromkeys(clips)),
                "clip_factor": self.measured.clip_factor(optimizer, step) if clips else math.nan}

    def cause(self, optimizer: int, step: int):
        """What a script's step shows of a row's cause before the engine's fixes."""
        def cause(measured: Compared, facts: Facts, judged: Sequence[Judged]) -> str | None:
            comparison = measured.comparison
            gradient = judged[0].comparison if judged else None
            if comparison.verdict is Equivalence.MATCHES and measured.ranks_agree is not False:
                return None
            if measured.ranks_agree is False:  # before a clip every micro-step, which
                return self.ranks_fix(optimizer, step, measured.point)  # leaves ranks alike
            if (why := self.repeated_clip_fix(optimizer, step)) is not None:
                return why
            if (why := self.data_fix(optimizer, step)) is not None:
                return why
            if self.measured.dropout:
                return (f"the model's dropout ({shown(self.measured.dropout)}) is active: "
                        "each split draws other masks, so no split can give the reference's "
                        "step; set its probability to 0 while checking")
            if (measured.point == "params" and gradient is not None
                    and gradient.verdict is Equivalence.MATCHES
                    and facts.gradient_scale is None):  # else the step-0 scale explains it
                return (learning_rate_fix(comparison, facts)
                        if rounding_only(gradient, facts) else amplified_fix(gradient, facts))
            return (self.scaled_fix(optimizer, step, measured, facts)
                    or self.trainer_count_fix(measured, facts))

        return cause

    def repeated_clip_fix(self, optimizer: int, step: int) -> str | None:
        """A clip called once per micro-step: each clips the gradient accumulated so far, so
        the window is not the big batch's gradient clipped once."""
        calls = self.measured.clip_calls(optimizer, step)
        if calls < 2:
            return None
        clip = self.measured.clips(optimizer, step)[0]
        return (f"{clip} ran {calls} times in this step's window, once per micro-step: each "
                "call clips the gradient accumulated so far, so the step is not the big "
                "batch's gradient clipped once (the gradient compared is the one before the "
                "window's last clip); clip once per window, after the last micro-step's "
                "backward, right before optimizer.step()")

    def data_fix(self, optimizer: int, step: int) -> str | None:
        """Other samples, or a window the data ran out in, where the samples show one."""
        ours = [record.samples for record in self.measured.records(optimizer, step)]
        theirs = self.reference.samples(optimizer, step)
        if not explain.same_samples([s for rank in ours for s in rank], theirs):
            drawn = self.measured.indices(optimizer, step)
            if explain.drawn_alike(drawn, self.reference.indices(optimizer, step)):
                return explain.augmentation_fix(step, len(drawn))
            return explain.samples_fix(step, ours, theirs, self.global_batch,
                                       frozenset(self.measured.frameworks))
        forwards = self.measured.forwards(optimizer, step)
        split = self.measured.run.split
        short = any(0 < count < split.accum_steps for count in forwards)
        if short or (theirs and len(theirs) < self.global_batch):
            return explain.partial_window_fix(step, len(theirs), self.global_batch, forwards,
                                              split.accum_steps)
        return None

    def trainer_count_fix(self, measured: Compared, facts: Facts) -> str | None:
        """Micro-batches of different token counts under the Trainer or TRL: the window's
        count, said in their terms."""
        if (measured.comparison.verdict is not Equivalence.DIFFERS
                or len(set(facts.piece_counts)) < 2
                or not self.measured.frameworks & {"trainer", "trl"}):
            return None
        return (f"{window_count_fix(facts.piece_counts)}; with the Trainer or TRL that count "
                "is num_items_in_batch: keep average_tokens_across_devices=True "
                "(TrainingArguments, SFTConfig) and a model whose forward takes **kwargs, so "
                "that the count reaches the loss and spans every rank's window")

    def ranks_fix(self, optimizer: int, step: int, point: str) -> str:
        disagreement = self.measured.disagreement(optimizer, step, point)
        ranks = ", ".join(map(str, disagreement.ranks)) if disagreement else "some"
        tensors = shown(list(disagreement.tensors)) if disagreement else "some tensors"
        held = "gradients" if point == "grad" else "parameters"
        return (f"rank(s) {ranks} held other {held} than rank 0 ({tensors}): nothing averages "
                "the gradients over the N ranks before the step (wrap the model in "
                "DistributedDataParallel, or all-reduce them), or something changes them on "
                "some ranks only (a clip, a scheduler or a condition on the rank)")

    def scaled_fix(self, optimizer: int, step: int, measured: Compared,
                   facts: Facts) -> str | None:
        """A scaled gradient's fix, the engine's, with what the script shows besides: that
        the window's clip hid the scale at this step, that the Trainer's loss contract
        explains it. None where neither does (the engine's fix then stands alone)."""
        comparison = measured.comparison
        if measured.point != "grad" or comparison.verdict is not Equivalence.SCALED:
            return None
        notes = [note for note in (self.clip_note(optimizer, step, comparison, facts),
                                   self.trainer_scale_note(comparison.scale, facts))
                 if note is not None]
        return "; ".join([suggest("grad", comparison, facts), *notes]) if notes else None

    def clip_note(self, optimizer: int, step: int, comparison: Comparison,
                  facts: Facts) -> str | None:
        """That the window's clip undid the gradient's scale at this step (the optimizer
        received the reference's gradient)."""
        clips = self.measured.clips(optimizer, step)
        if not clips:
            return None
        ours = self.measured.clip_factor(optimizer, step)
        theirs = self.reference.clip_factor(optimizer, step)
        received = ours * comparison.scale / theirs if theirs else math.nan
        if not close(received, 1.0, max(facts.rtol, CLIPPED_ALIKE)):
            return None
        return (f"at this step {clips[0]} hid it: it scaled this gradient and the "
                "reference's to the same norm, so the optimizer received the reference's "
                "gradient (a clip that does not bind lets the scale through)")

    def trainer_scale_note(self, scale: float, facts: Facts) -> str | None:
        """Under the Trainer (TRL's included) a gradient k, N or N*k times the big batch's
        is its loss contract broken: a loss given num_items_in_batch (a compute_loss_func,
        or a model whose forward takes **kwargs) is not divided by k, and is multiplied by
        N under average_tokens_across_devices (transformers' Trainer.training_step and
        compute_loss), so it must be the window's sum divided by that count."""
        split = self.measured.run.split
        factors = {split.accum_steps, split.world_size, split.world_size * split.accum_steps}
        if (not self.measured.frameworks & {"trainer", "trl"}
                or not any(factor > 1 and close(scale, factor, facts.rtol)
                           for factor in factors)):
            return None
        return ("with the Trainer or TRL: a loss given num_items_in_batch (a "
                "compute_loss_func, or a model whose forward takes **kwargs) is divided by "
                "neither k nor N (and is multiplied by N under "
                "average_tokens_across_devices): it must return the window's summed loss "
                "divided by num_items_in_batch, not a micro-batch's mean")

    def row(self, judged: Judged) -> dict[str, Any]:
        split = self.measured.run.split
        return judged_row(COLUMNS, judged, split=split.label, world_size=split.world_size,
                          accum_steps=split.accum_steps,
                          micro_batch=split.micro_batch(self.global_batch),
                          reference=self.reference.run.split.label,
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
