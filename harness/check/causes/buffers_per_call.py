"""Cause ``buffers-per-call``: buffers the forward updates per call or per piece (a counter of
calls, of each rank's own samples) change otherwise than in one big batch."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.batchnorm_running_stats import differing
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import shown


def fix(evidence: Evidence) -> str:
    facts = evidence.facts
    return (f"the buffers {shown(differing(evidence))} change differently from the big batch: "
            f"the forward updates them per call or per piece ({facts.world_size} rank(s) x "
            f"{facts.accum_steps} micro-step(s)), e.g. a counter of calls or of each rank's "
            "own samples; update them once per optimizer step, or all-reduce them")


CAUSE = Cause(id="buffers-per-call", summary="buffers updated per call or per piece",
              applies=branches.of_buffers, fix=fix)
