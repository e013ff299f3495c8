"""Cause ``loss-scale``: the gradient is a pure multiple s of the big batch's (a loss divided
by the wrong count, not divided by k, summed where it must average): divide or multiply
the loss by 1/s, named as k, N or N*k where it is one."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import scale_fix


def applies(evidence: Evidence) -> bool:
    return branches.purely_scaled(evidence) and evidence.point == "grad"


def fix(evidence: Evidence) -> str:
    return scale_fix("grad", evidence.explained.scale, evidence.facts)


CAUSE = Cause(id="loss-scale", summary="the gradient is k, N, N*k (or another) times the "
              "big batch's", applies=applies, fix=fix)
