"""Cause ``trainer-window-count``: under the Trainer or TRL, the window's micro-batches counted
different tokens and each rank divided by another count than the window's (its own
``num_items_in_batch``): the count is to span every rank's window."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.words import window_count_fix
from harness.verdicts import Equivalence

#: The frameworks whose count is ``num_items_in_batch`` (wire.py FRAMEWORK_MODULES' names).
COUNTING = frozenset({"trainer", "trl"})


def applies(evidence: Evidence) -> bool:
    return (evidence.script is not None
            and evidence.comparison.verdict is Equivalence.DIFFERS
            and len(set(evidence.facts.piece_counts)) >= 2
            and bool(evidence.script.frameworks & COUNTING))


def fix(evidence: Evidence) -> str:
    return (f"{window_count_fix(evidence.facts.piece_counts)}; with the Trainer or TRL that "
            "count is num_items_in_batch: keep average_tokens_across_devices=True "
            "(TrainingArguments, SFTConfig) and a model whose forward takes **kwargs, so that "
            "the count reaches the loss and spans every rank's window")


CAUSE = Cause(id="trainer-window-count", summary="the Trainer's count does not span the "
              "window", applies=applies, fix=fix)
