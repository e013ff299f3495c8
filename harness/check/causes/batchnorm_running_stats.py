"""Cause ``batchnorm-running-stats``: BatchNorm's running statistics, updated once per
micro-batch and per rank from that piece alone, cannot follow one big-batch update."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import batchnorm_fix


def differing(evidence: Evidence) -> list[str]:
    """The buffers off by more than the tolerance."""
    return [name for name, error in evidence.explained.errors.items()
            if error > evidence.facts.rtol]


def applies(evidence: Evidence) -> bool:
    names = differing(evidence)
    return (branches.of_buffers(evidence) and bool(names)
            and all(name in evidence.facts.batchnorm for name in names))


def fix(evidence: Evidence) -> str:
    return ("BatchNorm's running statistics are updated once per micro-batch and per rank, "
            "from that piece alone: expected to differ from one big-batch update; "
            + batchnorm_fix(evidence.facts))


CAUSE = Cause(id="batchnorm-running-stats", summary="BatchNorm's running statistics follow "
              "each piece, not the big batch", applies=applies, fix=fix)
