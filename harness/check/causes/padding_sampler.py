"""Cause ``padding-sampler``: a script's step fed samples more than once that the reference's
fed once: a sampler that pads each rank's share with repeats (a DistributedSampler over a
dataset whose length N does not divide)."""

from __future__ import annotations

import collections

from harness.check.causes import samples
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    if not samples.sampled_otherwise(evidence):
        return False
    together = sum(samples.by_rank(evidence), collections.Counter())
    return (any(count > 1 for count in together.values())
            and not any(count > 1 for count in samples.of_reference(evidence).values()))


def fix(evidence: Evidence) -> str:
    extra, missing = samples.extra_and_missing(evidence)
    return (f"step {evidence.step} fed {extra} sample(s) more than once and left out "
            f"{missing} of the reference's: a sampler that pads each rank's share with "
            "repeats (a DistributedSampler over a dataset whose length N does not divide); "
            "use a dataset whose length every N divides, or drop_last=True at every split")


CAUSE = Cause(id="padding-sampler", summary="a sampler that pads with repeats",
              applies=applies, fix=fix, reads=("samples",))
