"""Cause ``unsharded-data``: every rank of a script's split fed the same samples: the data is
not sharded across the ranks (no DistributedSampler, or a framework that did not take the
run as distributed)."""

from __future__ import annotations

from harness.check.causes import samples
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    if not samples.sampled_otherwise(evidence):
        return False
    each = samples.by_rank(evidence)
    return len(each) > 1 and bool(each[0]) and all(rank == each[0] for rank in each)


def fix(evidence: Evidence) -> str:
    each = samples.by_rank(evidence)
    return (f"in step {evidence.step} every one of the {len(each)} ranks fed the same "
            f"{sum(each[0].values())} sample(s): the data is not sharded across the ranks (no "
            "DistributedSampler, or a framework that did not take the run as distributed, "
            "e.g. Accelerate on a machine without GPUs unless told to use the CPU: "
            "Accelerator(cpu=True), ACCELERATE_USE_CPU=true, or the Trainer's --use_cpu); "
            "shard it so that the ranks together feed each step's G samples once")


CAUSE = Cause(id="unsharded-data", summary="every rank fed the same samples",
              applies=applies, fix=fix, reads=("samples",))
