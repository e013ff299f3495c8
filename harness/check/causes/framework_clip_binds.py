"""Cause ``framework-clip-binds``: a framework clips the window's gradient by default and the
clip binds: its step is the big batch's clipped the same way (once per window), which a
plain loop's step is not."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.verdicts import Equivalence


def clipped_off(evidence: Evidence) -> bool:
    """A framework's step off the plain loop's, where it clipped the window's gradient."""
    framework = evidence.framework
    return (framework is not None and bool(framework.clip)
            and evidence.comparison.verdict is not Equivalence.MATCHES)


def applies(evidence: Evidence) -> bool:
    return clipped_off(evidence) and evidence.framework.recipe.verdict is Equivalence.MATCHES


def fix(evidence: Evidence) -> str:
    framework = evidence.framework
    return (f"{framework.name}'s clip binds: {framework.clip_setting} clipped the window's "
            f"gradient to norm {framework.clip:g}, scaling the step by "
            f"{evidence.comparison.scale:.4g} (once per window, as a big batch clipped the "
            f"same way); for the plain loop's step set {framework.clip_off}")


CAUSE = Cause(id="framework-clip-binds", summary="a framework's default clip binds",
              applies=applies, fix=fix)
