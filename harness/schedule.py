"""Which rank runs which case, decided identically on every rank.

Collective cases (DDP at world size k) must run on the subgroup of ranks
0..k-1, in the same order on each of them: widest first, so that a rank's
last collective case comes early and it is free afterwards. Single-process
cases can run anywhere; each goes to the rank with the least work so far
(longest cases first), which puts them on the ranks that sit out the narrower
collective cases -- they compute while the others wait on the network.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.studies.base import Case


@dataclass(frozen=True)
class Schedule:
    #: For every rank, the cases it takes part in, in the order it runs them.
    cases_of_rank: tuple[tuple[Case, ...], ...]
    #: For every case id, the rank that returns its rows.
    owner: dict[str, int]

    def runs(self, rank: int) -> tuple[Case, ...]:
        return self.cases_of_rank[rank]


def make_schedule(cases: list[Case], world_size: int) -> Schedule:
    """Place ``cases`` on ``world_size`` ranks; deterministic in the order of ``cases``."""
    load = [0.0] * world_size
    collective = sorted((c for c in cases if c.collective), key=lambda c: -c.participants)
    for case in collective:
        for rank in range(case.participants):
            load[rank] += case.cost
    owner = {case.id: 0 for case in collective}
    singles = [c for c in cases if not c.collective]
    for case in sorted(singles, key=lambda c: -c.cost):
        # Ties go to the highest rank: rank 0 already carries every collective case.
        rank = min(range(world_size), key=lambda r: (load[r], -r))
        load[rank] += case.cost
        owner[case.id] = rank
    cases_of_rank = tuple(
        tuple(c for c in collective if r < c.participants)
        + tuple(c for c in singles if owner[c.id] == r)
        for r in range(world_size))
    return Schedule(cases_of_rank, owner)
