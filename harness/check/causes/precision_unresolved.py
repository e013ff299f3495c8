"""Cause ``precision-unresolved``: what a ``matches`` leaves open where no twin without
autocast was run (grad-check run: the script is the user's): at a precision coarser than
float32, any split off by less than the tolerance; in float32, one whose residual is above
float32's rounding (``FLOAT32_ROUNDING``), which only a run in float64 resolves."""

from __future__ import annotations

import torch

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.precision import coarser_than_float32
from harness.tolerances import FLOAT32_ROUNDING, dtype_name
from harness.verdicts import Equivalence


def _bound(evidence: Evidence) -> float | None:
    return (FLOAT32_ROUNDING.get(evidence.point) if evidence.precision == torch.float32
            else None)


def applies(evidence: Evidence) -> bool:
    if evidence.comparison.verdict is not Equivalence.MATCHES:
        return False
    if coarser_than_float32(evidence.precision):
        return True
    bound = _bound(evidence)
    return bound is not None and evidence.comparison.residual > bound


def fix(evidence: Evidence) -> str:
    rtol, residual = evidence.facts.rtol, evidence.comparison.residual
    if coarser_than_float32(evidence.precision):
        return (f"in {dtype_name(evidence.precision)} a split off by less than {rtol:.2g} "
                "matches too: run once in float32 to resolve it")
    return (f"residual {residual:.2g} is within float32's tolerance {rtol:.2g} but above its "
            f"rounding (~{_bound(evidence):.0e}): not rounding; run once in float64 to "
            "resolve it")


CAUSE = Cause(id="precision-unresolved", summary="a match its precision cannot resolve",
              applies=applies, fix=fix)
