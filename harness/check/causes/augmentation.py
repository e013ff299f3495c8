"""Cause ``augmentation``: a script's step was handed the reference's dataset items (the same
indices from the sampler) but fed other values for them: the data is transformed at random
as it loads, from each DataLoader worker's seed, so its draw depends on the batch size."""

from __future__ import annotations

from harness.check.causes import samples
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    script = evidence.script
    return samples.fed_otherwise(evidence) and samples.drawn_alike(
        script.indices, script.reference_indices)


def fix(evidence: Evidence) -> str:
    return (f"step {evidence.step} was handed the reference's {len(evidence.script.indices)} "
            "dataset items (the same indices from the sampler) but fed other values for "
            "them: the data is transformed at random as it loads (a random augmentation "
            "drawn from each DataLoader worker's own seed or from the global random state: "
            "which worker loads which batch, and so each sample's draw, depends on the batch "
            "size), so no split can give the reference's step; turn random augmentation off "
            "while checking (timm: --no-aug; no Random* transforms), or draw it from a "
            "generator seeded with the sample's index")


CAUSE = Cause(id="augmentation", summary="random augmentation drawn as the data loads",
              applies=applies, fix=fix, reads=("samples", "indices"))
