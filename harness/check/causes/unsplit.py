"""Cause ``unsplit``: at N = 1, k = 1 the Setup matrix's case feeds the whole batch to one
micro-step, as the reference does: a difference cannot come from any split."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.verdicts import Equivalence


def applies(evidence: Evidence) -> bool:
    facts = evidence.facts
    return (evidence.matrix is not None and facts.world_size == facts.accum_steps == 1
            and evidence.comparison.verdict is not Equivalence.MATCHES)


def fix(evidence: Evidence) -> str:
    comparison = evidence.comparison
    cause = ("the custom micro_step computes something other than Setup.loss (or the "
             "reference is not deterministic)" if evidence.matrix.custom_micro_step else
             "the reference is not deterministic: the same loss on the same batch gave "
             "another result")
    what = {"grad": "gradient", "params": "update"}.get(evidence.point, evidence.point)
    return (f"nothing is split at N = 1, k = 1, yet the {what} differs from the big "
            f"batch's (scale {comparison.scale:.6g}, residual {comparison.residual:.3g}): "
            f"{cause}")


CAUSE = Cause(id="unsplit", summary="a difference where nothing is split",
              applies=applies, fix=fix)
