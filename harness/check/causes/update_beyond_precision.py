"""Cause ``update-beyond-precision``: an update off at scale 1 in a precision coarser than
float32, right after a gradient of the same step that matched, on ranks that agree: an
adaptive optimizer's magnified rounding (TRL's bf16 defaults with packing: the gradient
0.0017 off, AdamW's update 0.068; both below 1e-5 in float32) and a difference of the
optimizer's own look alike there. The row is unresolved: a run in float32 tells them apart."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.precision import coarser_than_float32, tolerance
from harness.tolerances import dtype_name
from harness.verdicts import Equivalence, Status


def applies(evidence: Evidence) -> bool:
    comparison, precision = evidence.comparison, evidence.precision
    return (evidence.point == "params" and coarser_than_float32(precision)
            and comparison.verdict is Equivalence.DIFFERS
            and abs(comparison.scale - 1.0) <= tolerance(precision)
            and evidence.facts.ranks_agree is not False
            and evidence.gradient is not None and evidence.gradient_status == Status.OK
            and evidence.gradient_verdict == Equivalence.MATCHES)


def fix(evidence: Evidence) -> str:
    name, precision = dtype_name(evidence.precision), evidence.precision
    return (f"the update is {evidence.comparison.residual:.2g} off, beyond {name}'s tolerance "
            f"{tolerance(precision):.2g}, after a gradient that matched (residual "
            f"{evidence.gradient.residual:.2g}): an adaptive optimizer (Adam) magnifies "
            f"{name}'s rounding of the gradient in its step, and a run in {name} cannot tell "
            "that from a difference of the optimizer's state or settings: run once in float32 "
            "to resolve it")


CAUSE = Cause(id="update-beyond-precision", summary="an update its precision cannot resolve "
              "after a matching gradient", applies=applies, fix=fix)
