"""Cause ``batchnorm``: BatchNorm's tensors differ: it normalizes each rank's shard (and each
micro-batch) by its own statistics, which no loss scale undoes. First among the
differences no scale explains: where its tensors differ, it is a cause whatever else is."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import batchnorm_fix


def applies(evidence: Evidence) -> bool:
    errors, facts = evidence.explained.errors, evidence.facts
    return branches.unexplained_by_a_scale(evidence) and any(
        errors.get(name, 0.0) > facts.rtol for name in facts.batchnorm)


def fix(evidence: Evidence) -> str:
    return batchnorm_fix(evidence.facts)


CAUSE = Cause(id="batchnorm", summary="BatchNorm normalizes each piece by its own statistics",
              applies=applies, fix=fix)
