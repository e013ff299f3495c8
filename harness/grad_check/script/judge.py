"""Rows from the captures: the same data first, then the check's own comparison and fixes.

The reference split ran twice: its two runs must agree (:func:`check_deterministic`),
and how far they are apart is each row's ``reference_noise``. Each other split's steps
are then compared with the reference's first run, step by step, with the check's engine
(harness/check/compare.py: least-squares scale, residual, verdict at the tolerance of
the lowest precision either run used; fix.py: the fix). A step whose samples differ
from the reference's is named as such instead: its gradient would differ for a reason
no loss fix touches.
"""

from __future__ import annotations

import collections
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.check.compare import Comparison, Pair, compare, compare_each
from harness.check.fix import Facts, named_value
from harness.check.judge import WHAT, Compared, Judged, judge_step, judged_row
from harness.check.precision import lowest, tolerance
from harness.columns import POINTS
from harness.errors import UsageError
from harness.grad_check.script.records import Captured
from harness.grad_check.script.schema import COLUMNS
from harness.tolerances import dtype_name
from harness.verdicts import Equivalence, Status

CPU = torch.device("cpu")
#: Names shown where a list is named in a line.
SHOWN = 3


class Unmatched(Exception):
    """The split's optimizer holds other tensors than the reference's: nothing to fit."""


def shown(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")


def precision(*runs: Captured) -> torch.dtype:
    """The lowest floating type any of the runs used (parameters, gradients, losses,
    autocast)."""
    return lowest(dtype for run in runs for dtype in run.dtypes)


def pairs(measured: Captured, reference: Captured, step: int, point: str) -> tuple[list[Pair],
                                                                                 list[str]]:
    """Each tensor of ``point`` at ``step`` against the reference's; parameters as updates
    from where the reference started the step."""
    names = reference.names
    if measured.names != names:
        extra = [name for name in measured.names if name not in names]
        missing = [name for name in names if name not in measured.names]
        raise Unmatched("the optimizer holds other tensors than at the reference"
                        + (f" ({shown(extra)} only here" if extra else " (")
                        + (f"; {shown(missing)} only there)" if missing else ")"))
    ours, theirs = measured.tensors(step, point), reference.tensors(step, point)
    origin = reference.before(step) if point == "params" else {}
    return [Pair(name, ours[name], theirs[name], origin.get(name)) for name in names], names


def compared(measured: Captured, reference: Captured, step: int, point: str,
             rtol: float) -> Comparison:
    found, names = pairs(measured, reference, step, point)
    return compare(found, names, None, CPU, rtol)


def noise(again: Captured, first: Captured, step: int, point: str, rtol: float) -> float:
    """``||again - first|| / ||again||`` at scale 1 (updates for ``params``)."""
    found, names = pairs(again, first, step, point)
    return compare_each(found, names, set(), None, CPU, rtol).residual


def sample_difference(measured: collections.Counter, reference: collections.Counter
                      ) -> tuple[int, int]:
    """(samples fed that the reference did not feed, reference samples left out), counted
    with repeats: a sample fed twice where the reference fed it once is one too many."""
    return sum((measured - reference).values()), sum((reference - measured).values())


def unsharded_fix(step: int, world_size: int, each: int) -> str:
    return (f"in step {step} every one of the {world_size} ranks fed the same {each} "
            "sample(s): the data is not sharded across the ranks (no DistributedSampler, or "
            "a framework that did not take the run as distributed, e.g. Accelerate on a "
            "machine without GPUs unless Accelerator(cpu=True)); shard it so that the ranks "
            "together feed each step's G samples once")


def sampler_fix(step: int, extra: int, missing: int, total: int) -> str:
    return (f"step {step} fed {extra} sample(s) the reference's step did not and left out "
            f"{missing} of its {total}: the sampler does not give every split the same global "
            "batch (a per-rank shuffle, a DistributedSampler with drop_last or padding, a "
            "seed that depends on the rank or on N, a shuffle drawn from the global random "
            "state); give each step the same G samples at every split, e.g. a seeded "
            "DataLoader(shuffle=True, generator=torch.Generator().manual_seed(0)) or "
            "DistributedSampler(shuffle=True, seed=0), over a dataset whose length N divides")


def learning_rate_fix(update: Comparison, facts: Facts) -> str:
    """The optimizer got the reference's gradient, yet its update differs: the step itself
    (its learning rate) is not the reference's."""
    if update.verdict is Equivalence.MATCHES:
        return ""
    if update.verdict is Equivalence.SCALED:
        scale = named_value(update.scale, facts.world_size, facts.accum_steps, facts.rtol)
        return (f"the gradient matches but the update is {scale} times the reference's: the "
                "learning rate of this step differs, e.g. a scheduler stepped another number "
                "of times (once per micro-step, or once per rank as Accelerate steps a "
                "prepared scheduler) or an lr scaled with N or k; step it once per optimizer "
                "step")
    return ("the gradient matches but the update does not: the optimizer's state or settings "
            "differ from the reference's (a scheduler, an lr or weight decay set from N or k, "
            "state carried from an earlier step)")


def not_deterministic(label: str, what: str, dropout: list[str]) -> UsageError:
    modules = f" (the model's {shown(dropout)})" if dropout else ""
    return UsageError(f"the reference {label} ran twice and {what}: the script is not "
                      f"deterministic; allowed: a script that repeats its steps exactly: look at "
                      f"dropout{modules}, an unseeded sampler or generator (seed torch, numpy "
                      "and random at the start, DataLoader(generator=...)), nondeterministic "
                      "kernels (torch.use_deterministic_algorithms(True))")


def check_deterministic(first: Captured, again: Captured) -> dict[tuple[int, str], float]:
    """Refuse a reference whose two runs differ beyond its precision's tolerance; else the
    noise between them, by (step, point)."""
    label = first.run.split.label
    if again.steps != first.steps:
        raise not_deterministic(label, f"stepped {first.steps} then {again.steps} time(s)",
                                first.dropout)
    rtol = tolerance(precision(first, again))
    measured: dict[tuple[int, str], float] = {}
    for step in range(first.steps):
        if first.samples(step) != again.samples(step):
            raise not_deterministic(label, f"fed other samples in step {step}", first.dropout)
        for point in POINTS:
            try:
                comparison = compared(again, first, step, point, rtol)
            except Unmatched as unmatched:
                raise not_deterministic(label, str(unmatched), first.dropout) from None
            if comparison.verdict is not Equivalence.MATCHES:
                distance = noise(again, first, step, point, rtol)
                raise not_deterministic(
                    label, f"its step {step} {WHAT[point]} differed ({distance:.3g} relative, "
                    f"beyond {dtype_name(precision(first, again))}'s tolerance {rtol:g})",
                    first.dropout)
            measured[(step, point)] = noise(again, first, step, point, rtol)
    return measured


@dataclass
class SplitJudge:
    """The rows of one split: each step x point against the reference's first run."""

    measured: Captured
    reference: Captured
    reference_noise: dict[tuple[int, str], float]
    global_batch: int

    def rows(self) -> list[dict[str, Any]]:
        return [self.row(judged) for judged in self.judged()]

    def judged(self) -> list[Judged]:
        judged: list[Judged] = []
        split = self.measured.run.split
        facts = Facts(world_size=split.world_size,
                      accum_steps=split.accum_steps, batchnorm=self.measured.batchnorm)
        captured = self.measured.steps if self.measured.stepped else 0
        for step in range(min(captured, self.reference.steps)):
            try:
                judged += self.step_judged(step, facts)
            except Unmatched as unmatched:
                return judged + self.errors(step, str(unmatched))
        if captured < self.reference.steps:
            judged += self.errors(captured, self.missing_step(captured))
        return judged

    def missing_step(self, step: int) -> str:
        failure = self.measured.run.failure
        if failure is not None:
            return str(failure)
        if not self.measured.stepped:
            return "the script ended without stepping an optimizer"
        return (f"the script ended after {step} optimizer step(s); the reference took "
                f"{self.reference.steps}")

    def step_judged(self, step: int, facts: Facts) -> list[Judged]:
        ours, theirs = self.measured.samples(step), self.reference.samples(step)
        if ours != theirs:
            fix = self.samples_fix(step, ours, theirs)
            return [Judged(step, point, fix=fix, status=Status.DIFFERENT_SAMPLES)
                    for point in POINTS]
        dtype = precision(self.measured, self.reference)
        rtol = tolerance(dtype)
        facts.piece_counts = self.measured.counts(step)
        points = [Compared(point, compared(self.measured, self.reference, step, point, rtol),
                           self.measured.ranks_agree(step, point)) for point in POINTS]
        return judge_step(step, points, dtype, facts, cause=self.cause, say_unresolved=True)

    def samples_fix(self, step: int, ours: collections.Counter,
                    theirs: collections.Counter) -> str:
        each = [collections.Counter(record["samples"]) for record in self.measured.records(step)]
        if len(each) > 1 and each[0] and all(rank == each[0] for rank in each):
            return unsharded_fix(step, len(each), sum(each[0].values()))
        extra, missing = sample_difference(ours, theirs)
        return sampler_fix(step, extra, missing, sum(theirs.values()))

    def cause(self, measured: Compared, facts: Facts, judged: Sequence[Judged]) -> str | None:
        """What a script's step shows of a row's cause before the engine's fixes: an update
        off although its gradient matched, ranks that disagree, active dropout."""
        comparison = measured.comparison
        gradient = judged[0].comparison if judged else None
        if (measured.point == "params" and gradient is not None
                and gradient.verdict is Equivalence.MATCHES):
            return learning_rate_fix(comparison, facts)
        if comparison.verdict is Equivalence.MATCHES:
            return None
        if measured.ranks_agree is False:
            held = "gradients" if measured.point == "grad" else "parameters"
            return (f"the ranks held different {held}: nothing averages the gradients over "
                    "the N ranks before the step (wrap the model in DistributedDataParallel, "
                    "or all-reduce them), or something changes it on some ranks; compare the "
                    "ranks' gradients")
        if self.measured.dropout:
            return (f"the model's dropout ({shown(self.measured.dropout)}) is active: each "
                    "split draws other masks, so no split can give the reference's step; set "
                    "its probability to 0 while checking")
        return None

    def row(self, judged: Judged) -> dict[str, Any]:
        split = self.measured.run.split
        return judged_row(COLUMNS, judged, split=split.label, world_size=split.world_size,
                          accum_steps=split.accum_steps,
                          micro_batch=split.micro_batch(self.global_batch),
                          reference=self.reference.run.split.label,
                          reference_noise=self.reference_noise.get((judged.step, judged.point),
                                                                   math.nan),
                          command=shlex.join(self.measured.run.command))

    def errors(self, step: int, error: str) -> list[Judged]:
        return [Judged(step, point, status=Status.ERROR, error=error) for point in POINTS]
