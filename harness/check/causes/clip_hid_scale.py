"""Note ``clip-hid-scale``: at this step the script's window clip scaled its gradient and the
reference's to the same norm, so the optimizer received the reference's gradient: the scale
its fix names did not reach this step (a clip that does not bind lets it through)."""

from __future__ import annotations

import math

from harness.check.causes.cause import Note
from harness.check.causes.evidence import Evidence, clip_factor
from harness.tolerances import CLIPPED_ALIKE, close


def applies(evidence: Evidence) -> bool:
    script = evidence.script
    if script is None or not script.records or not script.records[0].clips:
        return False
    theirs = clip_factor(script.reference[0])
    received = (clip_factor(script.records[0]) * evidence.comparison.scale / theirs
                if theirs else math.nan)
    return close(received, 1.0, max(evidence.facts.rtol, CLIPPED_ALIKE))


def text(evidence: Evidence) -> str:
    return (f"at this step {evidence.script.records[0].clips[0]} hid it: it scaled this "
            "gradient and the reference's to the same norm, so the optimizer received the "
            "reference's gradient (a clip that does not bind lets the scale through)")


NOTE = Note(id="clip-hid-scale", applies=applies, text=text,
            reads=("clips", "before_norm", "received_norm"))
