"""Cause ``partial-window``: a script's step is a window the data ran out in: fewer samples
than G, or fewer micro-steps than k on a rank. A loss divided by k (or by the micro-batch's
own count) weighs it unlike the big batch of what is left: no loss-divisor fix applies."""

from __future__ import annotations

from harness.check.causes import samples
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    script = evidence.script
    if script is None or samples.fed_otherwise(evidence):
        return False
    theirs = script.reference_samples
    short = any(0 < count < script.accum_steps for count in script.forwards)
    return short or bool(theirs and len(theirs) < script.global_batch)


def fix(evidence: Evidence) -> str:
    script = evidence.script
    forwards, accum_steps = script.forwards, script.accum_steps
    short = [rank for rank, count in enumerate(forwards) if count < accum_steps]
    where = (f"rank {short[0]} ran {forwards[short[0]]} of its k = {accum_steps} micro-steps"
             if short else f"it held {len(script.reference_samples)} of the G = "
             f"{script.global_batch} samples")
    return (f"step {evidence.step} is a partial window, the end of the data: {where}. A loss "
            "divided by k (or by the micro-batch's own count) weighs such a window unlike the "
            "big batch of what is left, so this step differs even where every full window "
            "matches, and no loss-divisor fix applies to it; divide by the micro-steps the "
            "window really has, or drop the remainder (drop_last=True)")


CAUSE = Cause(id="partial-window", summary="a window the data ran out in",
              applies=applies, fix=fix, reads=("samples", "forwards"))
