"""Cause ``update-learning-rate``: a script's optimizer got the reference's gradient (to its
precision's rounding), yet its update differs: the step itself is not the reference's (a
scheduler stepped another number of times, an lr or weight decay set from N or k)."""

from __future__ import annotations

import torch

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import named_value
from harness.check.compare import Comparison
from harness.check.fix import Facts
from harness.check.precision import tolerance
from harness.tolerances import FLOAT32_ROUNDING
from harness.verdicts import Equivalence


def after_a_matching_gradient(evidence: Evidence) -> bool:
    """A script's update off after its step's gradient matched, where step 0's gradient
    was no scale (which would explain it)."""
    return (evidence.script is not None and evidence.point == "params"
            and evidence.gradient is not None
            and evidence.gradient.verdict is Equivalence.MATCHES
            and evidence.facts.gradient_scale is None)


def rounding_only(gradient: Comparison, facts: Facts) -> bool:
    """Whether a matching gradient is off by no more than its precision's rounding (float32:
    ``FLOAT32_ROUNDING``; float64: its tolerance, which sits at rounding). Below float32 no
    such bound is known: bfloat16's tolerance holds its rounding and small differences
    alike, so a gradient matching there is never called rounding alone."""
    if facts.rtol == tolerance(torch.float32):
        return gradient.residual <= FLOAT32_ROUNDING["grad"]
    return facts.rtol <= tolerance(torch.float64) and gradient.residual <= facts.rtol


def applies(evidence: Evidence) -> bool:
    return after_a_matching_gradient(evidence) and rounding_only(evidence.gradient,
                                                                 evidence.facts)


def fix(evidence: Evidence) -> str:
    update, facts = evidence.comparison, evidence.facts
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


CAUSE = Cause(id="update-learning-rate", summary="the gradient matches, the update does not: "
              "the step's learning rate or state", applies=applies, fix=fix)
