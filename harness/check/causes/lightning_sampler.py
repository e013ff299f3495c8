"""Cause ``lightning-sampler``: Lightning's Trainer at N > 1 puts a DistributedSampler with
shuffle=True under every training DataLoader (trainer/connectors/data_connector.py
``_process_dataloader``: a training loader counts as shuffled whatever its own sampler),
and at N = 1 keeps the loader's own: no setting of the loader gives both the same batch."""

from __future__ import annotations

from harness.check.causes import samples
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    return (samples.sampled_otherwise(evidence) and "lightning" in evidence.script.frameworks
            and len(evidence.script.records) > 1)


def fix(evidence: Evidence) -> str:
    return (f"{samples.fed_other_samples(evidence)}: at N > 1 Lightning's Trainer replaces the "
            "training DataLoader's sampler with a DistributedSampler that shuffles (even a "
            "sequential one), while at N = 1 it keeps the loader's own; pass "
            "Trainer(use_distributed_sampler=False) and give the loader a sampler that draws "
            "the same global batch at every N: your own DistributedSampler(dataset, "
            "num_replicas=N, rank=RANK, shuffle=True, seed=0) at every N, N = 1 included")


CAUSE = Cause(id="lightning-sampler", summary="Lightning's Trainer swaps the sampler at N > 1",
              applies=applies, fix=fix, reads=("samples",))
