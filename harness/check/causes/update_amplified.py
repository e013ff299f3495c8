"""Cause ``update-amplified``: a script's gradient is within its precision's tolerance but
not known to be only its rounding, and the update is off: an adaptive optimizer magnifies
what is left in its step, so the gradient's small difference is the cause."""

from __future__ import annotations

import torch

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.update_learning_rate import after_a_matching_gradient, rounding_only
from harness.check.precision import tolerance


def applies(evidence: Evidence) -> bool:
    return after_a_matching_gradient(evidence) and not rounding_only(evidence.gradient,
                                                                     evidence.facts)


def fix(evidence: Evidence) -> str:
    gradient, facts = evidence.gradient, evidence.facts
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


CAUSE = Cause(id="update-amplified", summary="an update that magnifies a small gradient "
              "difference", applies=applies, fix=fix)
