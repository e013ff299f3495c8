"""Cause ``window-size``: a script's step fed another number of samples than the reference's
G: its window is another size (it derives its micro-steps from other arguments, or the
command passes {accum} or {batch} to the wrong flag)."""

from __future__ import annotations

from harness.check.causes import samples
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    script = evidence.script
    return (samples.sampled_otherwise(evidence)
            and len(script.samples) != len(script.reference_samples))


def fix(evidence: Evidence) -> str:
    script = evidence.script
    return (f"step {evidence.step} fed {len(script.samples)} sample(s) over all ranks where "
            f"the reference's fed {len(script.reference_samples)} (G = "
            f"{script.global_batch}): this split's window is another size, e.g. an "
            "accumulation or batch argument the script does not take as given (it derives "
            "its micro-steps from other arguments, or the command passes {accum} or {batch} "
            "to the wrong flag); make every split's window hold the same G samples")


CAUSE = Cause(id="window-size", summary="a window of another number of samples than G",
              applies=applies, fix=fix, reads=("samples",))
