"""Cause ``sampler``: a script's step fed samples the reference's did not and left out some of
its own: the sampler does not give every split the same global batch (a shuffle drawn from
the global random state or that depends on N, drop_last, a seed that depends on the rank)."""

from __future__ import annotations

from harness.check.causes import samples
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def fix(evidence: Evidence) -> str:
    return (f"{samples.fed_other_samples(evidence)}: the sampler does not give every split the "
            "same global batch (a shuffle drawn from the global random state or that depends "
            "on N, a DistributedSampler with drop_last, a seed that depends on the rank); "
            "give each step the same G samples at every split, e.g. a seeded "
            "DataLoader(shuffle=True, generator=torch.Generator().manual_seed(0)) or "
            "DistributedSampler(shuffle=True, seed=0), over a dataset whose length N divides")


CAUSE = Cause(id="sampler", summary="the sampler gives the splits other global batches",
              applies=samples.sampled_otherwise, fix=fix, reads=("samples", "indices"))
