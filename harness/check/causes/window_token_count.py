"""Cause ``window-token-count``: the window's micro-batches counted different tokens, and a
loss that divides each by its own count (or by a count of other labels than it averages,
as labels counted before a causal shift) weighs them unequally: no single scale."""

from __future__ import annotations

from harness.check.causes import branches
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import window_count_fix


def applies(evidence: Evidence) -> bool:
    return (branches.unexplained_by_a_scale(evidence)
            and len(set(evidence.facts.piece_counts)) > 1)


def fix(evidence: Evidence) -> str:
    return window_count_fix(evidence.facts.piece_counts)


CAUSE = Cause(id="window-token-count", summary="micro-batches of different token counts, "
              "each divided by another count than the window's", applies=applies, fix=fix)
