"""Cause ``framework-schedule``: the framework's optimizer stepped at other learning rates than
the big batch's step (it stepped the setup's scheduler its own way)."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.tolerances import close
from harness.verdicts import Equivalence


def applies(evidence: Evidence) -> bool:
    framework = evidence.framework
    if framework is None or evidence.comparison.verdict is Equivalence.MATCHES:
        return False
    used, expected = framework.learning_rates
    return not all(close(a, b, evidence.facts.rtol) for a, b in zip(used, expected, strict=True))


def _rates(rates: tuple[float, ...]) -> str:
    return "/".join(f"{rate:.6g}" for rate in rates)


def fix(evidence: Evidence) -> str:
    used, expected = evidence.framework.learning_rates
    return (f"the optimizer stepped at learning rate {_rates(used)} where the big batch's "
            f"step used {_rates(expected)}: {evidence.framework.schedules}")


CAUSE = Cause(id="framework-schedule", summary="the framework stepped at other learning "
              "rates", applies=applies, fix=fix)
