"""Cause ``framework-clip-hides-scale``: a framework's binding clip scales the window's
gradient to the big batch's norm, hiding the accumulation's own scale (the step, clipped
alike, is nearly the big batch's clipped one)."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.framework_clip_binds import clipped_off
from harness.tolerances import CLIPPED_ALIKE


def applies(evidence: Evidence) -> bool:
    return clipped_off(evidence) and abs(evidence.framework.recipe.scale - 1) < CLIPPED_ALIKE


def fix(evidence: Evidence) -> str:
    framework = evidence.framework
    return (f"{framework.name}'s clip binds and hides the accumulation's own scale: "
            f"{framework.clip_setting} clipped the window's gradient to norm "
            f"{framework.clip:g}, as it clips the big batch's; set {framework.clip_off} "
            "to see the scale, or fix it where the loss is computed")


CAUSE = Cause(id="framework-clip-hides-scale", summary="a framework's binding clip hides "
              "the accumulation's scale", applies=applies, fix=fix)
