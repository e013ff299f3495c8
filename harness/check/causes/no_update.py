"""Cause ``no-update``: the step moved no parameter, here and in the big batch alike, at a
learning rate other than 0: nothing was compared (a step at rate 0 is skipped instead)."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def at_rate_0(evidence: Evidence) -> bool:
    rates = evidence.facts.learning_rates
    return bool(rates) and all(rate == 0 for rate in rates)


def applies(evidence: Evidence) -> bool:
    return (evidence.comparison.nothing and evidence.point != "grad"
            and not at_rate_0(evidence))


def fix(_evidence: Evidence) -> str:
    return ("the step moved no parameter, here and in the big batch alike, at a learning rate "
            "other than 0: nothing was compared (a clip to 0, a gradient zeroed before the "
            "step, a step the optimizer skipped)")


CAUSE = Cause(id="no-update", summary="no parameter moved on either side",
              applies=applies, fix=fix)
