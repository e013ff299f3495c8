"""Cause ``carried-update``: an update within its own bound (``FLOAT32_ROUNDING["params"]``,
which holds what an adaptive optimizer can magnify float32's rounding to) right after a
gradient of the same step known not to be the big batch's (``differs``, or ``unresolved``
above its rounding), and itself off by more than a gradient's rounding: the gradient's
difference passed into the step undamped (SGD's update is the gradient times the lr), so
the update is not known to match either. An update an optimizer damped below the
gradient's rounding is measured to match and keeps its verdict."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.tolerances import FLOAT32_ROUNDING
from harness.verdicts import Equivalence, Status


def applies(evidence: Evidence) -> bool:
    gradient = evidence.gradient
    return (evidence.point == "params" and gradient is not None
            and evidence.comparison.verdict is Equivalence.MATCHES
            and evidence.comparison.residual > FLOAT32_ROUNDING["grad"]
            and (evidence.gradient_status == Status.UNRESOLVED
                 or (evidence.gradient_status == Status.OK
                     and evidence.gradient_verdict == Equivalence.DIFFERS)))


def fix(evidence: Evidence) -> str:
    return (f"the update is off by {evidence.comparison.residual:.3g}, as the step's gradient "
            f"is ({evidence.gradient.residual:.3g}): it follows from that gradient, whose "
            "cause is this step's cause; the update's own bound, which holds what an adaptive "
            "optimizer can make of rounding, does not make it a match")


CAUSE = Cause(id="carried-update", summary="an update that carries its gradient's difference",
              applies=applies, fix=fix)
