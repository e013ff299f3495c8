"""Cause ``trainer-count-ignored``: the model's forward takes ``**kwargs``, so the Trainer
passed ``num_items_in_batch`` and stopped dividing the loss by k (multiplying it by N
instead), but the loss ignores the count (measured: the same loss with twice the count)."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.verdicts import Equivalence


def passed_a_count(evidence: Evidence) -> bool:
    """A framework's step off the plain loop's, where it handed the loss a count."""
    framework = evidence.framework
    return (framework is not None and bool(framework.counts_passed)
            and evidence.comparison.verdict is not Equivalence.MATCHES)


def applies(evidence: Evidence) -> bool:
    return passed_a_count(evidence) and bool(evidence.framework.count_ignored)


def fix(evidence: Evidence) -> str:
    return (f"the model's forward takes **kwargs, so the Trainer passed num_items_in_batch = "
            f"{evidence.framework.counts_passed[0]} and stopped dividing the loss by k (it "
            "multiplies it by N instead, undoing DDP's average), but the loss ignores the "
            "count (the same loss with twice the count): divide the summed loss by "
            "num_items_in_batch, or set model.accepts_loss_kwargs = False (the Trainer then "
            "divides by k)")


CAUSE = Cause(id="trainer-count-ignored", summary="the Trainer's num_items_in_batch is "
              "ignored by the loss", applies=applies, fix=fix)
