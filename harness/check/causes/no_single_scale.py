"""Cause ``no-single-scale``: a difference none of the causes before explains; what is known
is that it depends on how the batch is split."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def fix(_evidence: Evidence) -> str:
    return ("no single scale explains it: something in the worst tensors' computation "
            "depends on how the batch is split")


CAUSE = Cause(id="no-single-scale", summary="a difference no cause before names",
              applies=branches.unexplained_by_a_scale, fix=fix)
