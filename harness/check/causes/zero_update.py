"""Cause ``zero-update``: the step moved no parameter where the big batch's step did."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    return (branches.purely_scaled(evidence) and evidence.explained.scale == 0
            and evidence.point != "grad")


def fix(_evidence: Evidence) -> str:
    return ("the step moved no parameter where the big batch's step did (a learning rate of "
            "0 here only, a skipped step, a gradient zeroed before the step)")


CAUSE = Cause(id="zero-update", summary="the step moved nothing where the big batch's did",
              applies=applies, fix=fix)
