"""Which ranks run which case, decided identically on every rank.

A collective case of world size k runs on a *slot*: k consecutive ranks
starting at a multiple of k (ranks 0..k-1, k..2k-1, ...), whose process group
the runner creates up front. In a study that allows it (``Study.any_slot``)
a case may take any slot, so at N ranks two cases of world size N/2 run at
once, or N cases of world size 1; elsewhere every case of world size k takes
ranks 0..k-1, as the study assumes.

Cases are placed widest first, each on the slot whose busiest rank has the
least work so far (ties: the lowest slot), so that a rank's last collective
case comes early and it is free afterwards. Every rank runs its collective
cases in that one global order: two cases that share ranks run in the same
order on each of them, so no rank waits on a collective the others have not
reached. Single-process cases can run anywhere; each goes to the rank with the
least work so far (longest cases first), which puts them on the ranks that sit
out the narrower collective cases -- they compute while the others wait on the
network.

Where a case runs changes no number it measures: cases use ranks relative to
their group, and every row is returned to rank 0, which writes the rows in case
order whatever the placement.
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
    #: For every collective case id, the first rank of the slot it runs on.
    first_rank: dict[str, int]

    def runs(self, rank: int) -> tuple[Case, ...]:
        return self.cases_of_rank[rank]


def slots(participants: int, world_size: int, any_slot: bool) -> list[int]:
    """First ranks of the slots a case of ``participants`` ranks may take."""
    if not any_slot:
        return [0]
    return list(range(0, world_size - participants + 1, participants))


def slot_groups(world_sizes: tuple[int, ...], world_size: int) -> list[tuple[int, int]]:
    """(first rank, size) of every slot a case may take, in the order every rank creates
    their process groups."""
    return [(first, k) for k in world_sizes for first in slots(k, world_size, any_slot=True)]


def make_schedule(cases: list[Case], world_size: int, any_slot: bool = False) -> Schedule:
    """Place ``cases`` on ``world_size`` ranks; deterministic in the order of ``cases``.

    ``any_slot``: collective cases may take any slot (else ranks 0..k-1).
    """
    load = [0.0] * world_size
    collective = sorted((c for c in cases if c.collective), key=lambda c: -c.participants)
    first_rank: dict[str, int] = {}
    for case in collective:
        first = _least_loaded_slot(load, case.participants, any_slot)
        first_rank[case.id] = first
        for rank in range(first, first + case.participants):
            load[rank] += case.cost
    owner = dict(first_rank)
    singles = [c for c in cases if not c.collective]
    for case in sorted(singles, key=lambda c: -c.cost):
        # Ties go to the highest rank: rank 0 carries the most collective cases.
        rank = min(range(world_size), key=lambda r: (load[r], -r))
        load[rank] += case.cost
        owner[case.id] = rank
    cases_of_rank = tuple(
        tuple(c for c in collective if first_rank[c.id] <= r < first_rank[c.id] + c.participants)
        + tuple(c for c in singles if owner[c.id] == r)
        for r in range(world_size))
    return Schedule(cases_of_rank, owner, first_rank)


def _least_loaded_slot(load: list[float], participants: int, any_slot: bool) -> int:
    """The slot whose busiest rank has the least work so far; ties: the lowest."""
    return min(slots(participants, len(load), any_slot),
               key=lambda first: (max(load[first:first + participants]), first))
