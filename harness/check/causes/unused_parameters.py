"""Cause ``unused-parameters``: parameters that get no gradient leave DDP's bucket that holds
them never all-reduced, unless DDP is told to look for them."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import shown


def applies(evidence: Evidence) -> bool:
    facts = evidence.facts
    return (branches.unexplained_by_a_scale(evidence) and facts.reduces_in_buckets
            and bool(facts.unused) and not facts.finds_unused)


def fix(evidence: Evidence) -> str:
    facts = evidence.facts
    return (f"the unused parameters ({shown(facts.unused)}) get no gradient, so DDP never "
            f"all-reduces the bucket that holds them: {facts.find_unused}")


CAUSE = Cause(id="unused-parameters", summary="DDP never all-reduces a bucket of unused "
              "parameters", applies=applies, fix=fix)
