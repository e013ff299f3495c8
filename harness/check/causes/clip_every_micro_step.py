"""Cause ``clip-every-micro-step``: a script's clip ran once per micro-step, each clipping the
gradient accumulated so far: the step is not the big batch's gradient clipped once."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    script = evidence.script
    return script is not None and bool(script.records) and script.records[0].clip_calls >= 2


def fix(evidence: Evidence) -> str:
    record = evidence.script.records[0]
    return (f"{record.clips[0]} ran {record.clip_calls} times in this step's window, once per "
            "micro-step: each call clips the gradient accumulated so far, so the step is not "
            "the big batch's gradient clipped once (the gradient compared is the one before "
            "the window's last clip); clip once per window, after the last micro-step's "
            "backward, right before optimizer.step()")


CAUSE = Cause(id="clip-every-micro-step", summary="a clip per micro-step, not per window",
              applies=applies, fix=fix, reads=("clips", "clip_calls"))
