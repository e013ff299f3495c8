"""Cause ``micro-step-edit``: the setup's own micro_step edits what it accumulates (a clip,
a GradScaler) or steps an LR scheduler, once per micro-step where the big batch does it once
per window."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.verdicts import Equivalence


def applies(evidence: Evidence) -> bool:
    return (evidence.matrix is not None and bool(evidence.matrix.edits)
            and evidence.comparison.verdict is not Equivalence.MATCHES)


def fix(evidence: Evidence) -> str:
    edits = evidence.matrix.edits
    if "an LR scheduler's step()" in edits:
        return ("step the scheduler once per optimizer step (Setup.make_scheduler's is "
                "stepped after each): micro_step calls an LR scheduler's step(), once per "
                "micro-step, k times per window")
    if "GradScaler" in edits:
        return ("scale and unscale once per window: micro_step uses a GradScaler, so each "
                "micro-step's gradient is scaled or unscaled on its own; set "
                "Setup.grad_scaler=True and return the unscaled loss")
    return (f"clip once per window, in before_step: micro_step calls "
            f"{' and '.join(sorted(edits))}, which clips the gradient of each micro-step (and "
            "rank) so far, not the window's")


CAUSE = Cause(id="micro-step-edit", summary="the setup's micro_step clips, scales or steps a "
              "scheduler per micro-step", applies=applies, fix=fix)
