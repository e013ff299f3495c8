"""Cause ``per-piece-mean``: the whole batch's loss is no combination of its pieces' losses
(measured: the user's loss of the window against its N x k pieces'): the loss divides each
micro-batch by its own count, so the pieces weigh unequally."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.verdicts import Combination


def applies(evidence: Evidence) -> bool:
    measure = evidence.facts.loss_combination
    return (branches.unexplained_by_a_scale(evidence) and measure is not None
            and measure() is Combination.NEITHER)


def fix(_evidence: Evidence) -> str:
    return ("normalize by the window's token count: the loss divides each micro-batch by its "
            "own count (e.g. a token mean), so pieces weigh unequally; sum the per-token "
            "losses, divide by the window's count (times N under DDP/FSDP)")


CAUSE = Cause(id="per-piece-mean", summary="the loss averages each piece by its own count",
              applies=applies, fix=fix)
