"""Cause ``update-scale``: the update is a pure multiple s of the big batch's (a learning
rate scaled with N or k, or a gradient's scale passed on): multiply lr by 1/s."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import scale_fix


def applies(evidence: Evidence) -> bool:
    return branches.purely_scaled(evidence) and evidence.point != "grad"


def fix(evidence: Evidence) -> str:
    return scale_fix(evidence.point, evidence.explained.scale, evidence.facts)


CAUSE = Cause(id="update-scale", summary="the update is a multiple of the big batch's",
              applies=applies, fix=fix)
