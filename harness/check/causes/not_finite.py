"""Cause ``not-finite``: a script's step whose gradient (or update) held a NaN or an infinity
where the reference's is finite: nothing equals it, not even the same run's again."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import WHAT, shown


def tensors(evidence: Evidence) -> list[str]:
    """The point's tensors that held a NaN or an infinity on any rank, in order."""
    if evidence.script is None:
        return []
    return list(dict.fromkeys(name for record in evidence.script.records
                              for name in record.non_finite.get(evidence.point, [])))


def not_finite_text(step: int, what: str, names: str) -> str:
    """A step whose gradient (or update) held a NaN or an infinity: nothing equals it."""
    return (f"step {step}'s {what} is not finite (a NaN or an infinity in {names}): no "
            "step equals it, not even the same run's again")


def fix(evidence: Evidence) -> str:
    return (f"{not_finite_text(evidence.step, WHAT[evidence.point], shown(tensors(evidence)))}"
            ", while the reference's is finite: this split's loss or gradient overflowed or "
            "took a NaN (a loss summed where the reference averages, a learning rate or a "
            "loss scale grown with N or k, a micro-batch of padding only); find where it "
            "first goes non-finite, e.g. with torch.autograd.set_detect_anomaly(True)")


CAUSE = Cause(id="not-finite", summary="a NaN or an infinity in the step",
              applies=lambda evidence: bool(tensors(evidence)), fix=fix, reads=("non_finite",))
