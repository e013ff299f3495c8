"""Cause ``ranks-disagree``: after DDP's all-reduce the ranks hold different values, which
its reduction promises never happens: something skips or changes it on some ranks."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    return branches.unexplained_by_a_scale(evidence) and evidence.facts.ranks_agree is False


def fix(_evidence: Evidence) -> str:
    return ("the ranks hold different values after DDP's all-reduce: something skips or "
            "changes the reduction on some ranks (a comm hook, a parameter only some ranks "
            "use, a gradient edited after backward); compare the ranks' gradients")


CAUSE = Cause(id="ranks-disagree", summary="the ranks disagree after DDP's all-reduce",
              applies=applies, fix=fix)
