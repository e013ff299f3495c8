"""Cause ``zero-gradient``: the gradient is all zero where the big batch's is not; no scale of
the loss brings it back."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    return (branches.purely_scaled(evidence) and evidence.explained.scale == 0
            and evidence.point == "grad")


def fix(_evidence: Evidence) -> str:
    return ("the gradient is all zero where the big batch's is not: nothing flowed back to "
            "the parameters in this case (an output detached or computed without autograd, "
            "a loss of no sample, a gradient zeroed before the step)")


CAUSE = Cause(id="zero-gradient", summary="nothing flowed back to the parameters",
              applies=applies, fix=fix)
