"""Cause ``rank-seeded-data``: rank 0 fed the reference's samples while the other ranks fed
new ones: each rank draws its own stream of data (a generator seeded with the rank)."""

from __future__ import annotations

from harness.check.causes import samples
from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence


def applies(evidence: Evidence) -> bool:
    """Rank 0's samples are all the reference's, and most of every other rank's are not (a
    stream of its own may draw a few of the reference's samples by chance)."""
    if not samples.sampled_otherwise(evidence):
        return False
    each, reference = samples.by_rank(evidence), samples.of_reference(evidence)
    others = [rank for rank in each[1:] if rank]
    return (len(each) > 1 and not each[0] - reference and bool(others)
            and all(sum((rank & reference).values()) * 2 <= sum(rank.values())
                    for rank in others))


def fix(evidence: Evidence) -> str:
    world_size = len(evidence.script.records)
    return (f"in step {evidence.step} rank 0 fed samples of the reference's step while the "
            f"other {world_size - 1} rank(s) fed only samples it did not: each rank draws its "
            "own stream of data, e.g. a generator seeded with the rank (seed + rank), as a "
            "script that samples random batches per rank does; the global batch is then "
            "other data at every N, so no split can give the reference's step: draw the "
            "global batch with one seed and give each rank its share")


CAUSE = Cause(id="rank-seeded-data", summary="each rank draws its own stream of data",
              applies=applies, fix=fix, reads=("samples",))
