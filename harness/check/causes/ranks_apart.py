"""Cause ``ranks-apart``: a script's ranks held other gradients (or parameters) than rank 0:
nothing averages them over the N ranks before the step, or something changes them on
some ranks only. Said before a clip every micro-step, which leaves the ranks alike."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import shown


def applies(evidence: Evidence) -> bool:
    return evidence.script is not None and evidence.facts.ranks_agree is False


def fix(evidence: Evidence) -> str:
    disagreement = evidence.script.disagreement
    ranks = ", ".join(map(str, disagreement.ranks)) if disagreement else "some"
    tensors = shown(list(disagreement.tensors)) if disagreement else "some tensors"
    held = "gradients" if evidence.point == "grad" else "parameters"
    return (f"rank(s) {ranks} held other {held} than rank 0 ({tensors}): nothing averages "
            "the gradients over the N ranks before the step (wrap the model in "
            "DistributedDataParallel, or all-reduce them), or something changes them on "
            "some ranks only (a clip, a scheduler or a condition on the rank)")


CAUSE = Cause(id="ranks-apart", summary="the ranks hold different tensors",
              applies=applies, fix=fix)
