"""Cause ``follows-gradient-scale``: step 0's gradient is a pure multiple of the big batch's,
and a later row that this scale alone does not describe follows from it (an adaptive
optimizer such as Adam turns a scaled gradient into updates no single scale describes)."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import scale_fix


def fix(evidence: Evidence) -> str:
    scale = evidence.facts.gradient_scale
    return (f"step 0's gradient is scaled by {scale:.6g}, which this row follows from: "
            f"{scale_fix('grad', scale, evidence.facts)}")


CAUSE = Cause(id="follows-gradient-scale", summary="a later row follows step 0's scaled "
              "gradient", applies=branches.follows_gradient_scale, fix=fix)
