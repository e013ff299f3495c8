"""Cause ``no-gradient``: the gradient is all zero in the step and in the big batch alike:
nothing was compared (the row's status says so, never a match)."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    return evidence.comparison.nothing and evidence.point == "grad"


def fix(_evidence: Evidence) -> str:
    return ("the gradient is all zero, here and in the big batch alike: nothing was compared "
            "(a loss with no gradient, e.g. a cross-entropy over a single class; every "
            "parameter frozen; a gradient zeroed before it was read)")


CAUSE = Cause(id="no-gradient", summary="an all-zero gradient on both sides",
              applies=applies, fix=fix)
