"""The schedule: which ranks run which case (harness/schedule.py), and a run that uses it.

Collective cases of a study that allows it share the launch's ranks: at N = 4,
two world-size-2 cases at once, four world-size-1 cases. What must hold whatever
the placement: the cases that run at the same time use disjoint ranks, every
rank runs its shared cases in one global order (no rank waits on a collective
the others have not reached), every case runs exactly once, the placement is
the same on every rank, and the rows are those of the sequential schedule.
"""

from __future__ import annotations

import itertools
import socket

import pandas as pd
import pytest

from harness.schedule import make_schedule, slot_groups, slots
from harness.studies import STUDIES
from harness.studies.base import Case
from tests.distributed import run_cli, shared_cli_run

N = 4


def matrix(world_sizes=(1, 2, 3, 4), singles: int = 6) -> list[Case]:
    """A study's mix: collective cases at each world size (DDP at k = 1 included) and
    single-process ones, with uneven costs."""
    cases = [Case.of("s", participants=k, collective=True, cost=1.0 + (i % 3), k=k, i=i)
             for k in world_sizes for i in range(4)]
    cases += [Case.of("s", cost=0.5 + (i % 2), i=i, single=True) for i in range(singles)]
    return cases


def ranks_of(schedule, case: Case) -> set[int]:
    if not case.collective:
        return {schedule.owner[case.id]}
    first = schedule.first_rank[case.id]
    return set(range(first, first + case.participants))


def test_slots_are_aligned_runs_of_k_ranks_within_the_launch():
    assert slots(2, 4, any_slot=True) == [0, 2]
    assert slots(1, 4, any_slot=True) == [0, 1, 2, 3]
    assert slots(3, 4, any_slot=True) == [0]
    assert slots(2, 4, any_slot=False) == [0]
    assert slot_groups((1, 2, 3, 4), 4) == [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (2, 2),
                                             (0, 3), (0, 4)]


@pytest.mark.parametrize("any_slot", [False, True])
def test_every_case_runs_exactly_once_on_the_ranks_of_its_slot(any_slot):
    cases = matrix()
    schedule = make_schedule(cases, N, any_slot)
    for case in cases:
        runners = {r for r in range(N) if case in schedule.runs(r)}
        assert runners == ranks_of(schedule, case), case.id
        assert sum(schedule.runs(r).count(case) for r in range(N)) == len(runners)
        assert schedule.owner[case.id] == min(runners), "the slot's first rank returns rows"


def test_without_any_slot_a_case_of_world_size_k_runs_on_ranks_0_to_k_minus_1():
    schedule = make_schedule(matrix(), N, any_slot=False)
    assert set(schedule.first_rank.values()) == {0}


@pytest.mark.parametrize("k, firsts", [(1, {0, 1, 2, 3}), (2, {0, 2})])
def test_narrow_cases_spread_over_disjoint_slots(k, firsts):
    """Four cases of world size 1 take the four ranks; of world size 2, both halves."""
    cases = matrix(world_sizes=(k,), singles=0)
    schedule = make_schedule(cases, N, any_slot=True)
    assert {schedule.first_rank[c.id] for c in cases} == firsts


def test_slots_lie_within_the_launch_at_multiples_of_their_size():
    schedule = make_schedule(matrix(), N, any_slot=True)
    for case in matrix():
        if case.collective:
            first = schedule.first_rank[case.id]
            assert first % case.participants == 0 and first + case.participants <= N


@pytest.mark.parametrize("any_slot", [False, True])
def test_cases_sharing_a_rank_run_in_the_same_order_on_every_rank_they_share(any_slot):
    """No rank can wait on a collective case another rank of its group has not reached:
    the shared cases of any two ranks come in one order on both."""
    schedule = make_schedule(matrix(), N, any_slot)
    for a, b in itertools.combinations(range(N), 2):
        shared = {c.id for c in schedule.runs(a)} & {c.id for c in schedule.runs(b)}
        order_a = [c.id for c in schedule.runs(a) if c.id in shared]
        order_b = [c.id for c in schedule.runs(b) if c.id in shared]
        assert order_a == order_b, (a, b)


def simulate(schedule) -> list[list[Case]]:
    """Every rank works through its queue; a collective case starts once each rank of its
    slot has reached it, and takes one time step. The cases running at each step; fails
    where the ranks would wait on each other forever."""
    position, steps = [0] * N, []
    while any(position[r] < len(schedule.runs(r)) for r in range(N)):
        heads = {r: schedule.runs(r)[position[r]] for r in range(N)
                 if position[r] < len(schedule.runs(r))}
        running = {c.id: c for c in heads.values()
                   if all(heads.get(r) == c for r in ranks_of(schedule, c))}
        assert running, f"deadlock: ranks wait on {heads}"
        steps.append(list(running.values()))
        for r, case in heads.items():
            position[r] += case.id in running
    return steps


@pytest.mark.parametrize("any_slot", [False, True])
def test_cases_running_at_once_use_disjoint_ranks_and_none_waits_forever(any_slot):
    schedule = make_schedule(matrix(), N, any_slot)
    steps = simulate(schedule)
    for running in steps:
        for x, y in itertools.combinations(running, 2):
            assert not ranks_of(schedule, x) & ranks_of(schedule, y), (x.id, y.id)
    pairs = [step for step in steps if sum(c.collective and c["k"] == 2 for c in step) == 2]
    assert bool(pairs) == any_slot, "two world-size-2 cases at once only on any slot"


def test_the_schedule_is_the_same_every_time_it_is_made():
    """Every rank makes it on its own: it must depend on nothing but the case list."""
    first, second = make_schedule(matrix(), N, True), make_schedule(matrix(), N, True)
    assert first == second
    assert [[c.id for c in first.runs(r)] for r in range(N)] == \
        [[c.id for c in second.runs(r)] for r in range(N)]


def test_using_idle_ranks_shortens_the_busiest_rank():
    def busiest(schedule):
        return max(sum(c.cost for c in schedule.runs(r)) for r in range(N))

    cases = matrix(world_sizes=(1, 2))
    assert busiest(make_schedule(cases, N, True)) < busiest(make_schedule(cases, N, False))


# ------------------------------------------------------------- a real run
ARGS = ["--studies", "reduction,seed001", "--strategies", "ddp,fsdp", "--world-sizes", "1,2",
        "--quiet", "--no-report"]


@pytest.mark.launches(seconds=4)
def test_rows_are_those_of_the_sequential_schedule(tmp_path_factory, tmp_path, monkeypatch):
    """At N = 4 the world-size-1 and -2 cases run on every slot; the CSVs must be the
    ones ranks 0..k-1 alone write, byte for byte."""
    assert STUDIES["reduction"].any_slot and STUDIES["seed001"].any_slot
    spread = shared_cli_run(tmp_path_factory, "schedule-any-slot", N, ARGS)
    for name in ("reduction", "seed001"):
        monkeypatch.setattr(STUDIES[name], "any_slot", False)
    sequential = tmp_path / "sequential"
    assert run_cli(N, [*ARGS, "--out", str(sequential)], store_dir=tmp_path) == [0] * N
    for name in ("reduction.csv", "seed001.csv"):
        spread_rows, sequential_rows = (pd.read_csv(folder / name, dtype=str,
                                                    keep_default_na=False)
                                        for folder in (spread, sequential))
        # Every cell but where the case ran, to the byte.
        pd.testing.assert_frame_equal(spread_rows.drop(columns="ran_on"),
                                      sequential_rows.drop(columns="ran_on"))
        host = socket.gethostname()
        assert set(sequential_rows.ran_on) <= {f"0@{host}", f"0@{host},1@{host}"}, name
        assert f"2@{host},3@{host}" in set(spread_rows.ran_on), name  # the second slot of 2
    frame = pd.read_csv(spread / "reduction.csv")
    assert sorted(frame.world_size.unique()) == [1, 2] and (frame.status == "ok").all()
