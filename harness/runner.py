"""Runs the selected studies inside one torchrun launch.

Every rank builds the same case list and the same schedule (harness/schedule.py):
a collective case of world size k runs on a slot of k ranks (a process subgroup
created once, up front: ranks 0..k-1, or in studies that allow it any k ranks
from a multiple of k, so that narrow cases run side by side); single-process
cases are spread over the ranks that are idle. The rank that finishes a case
journals its rows; at the end of each study rank 0 gathers every row and writes
the study's CSV atomically, in case order.

Waiting is split in two on purpose: collectives *inside* a case time out after
``--timeout`` (a rank that hangs fails the run instead of stalling it), while
ranks that have finished their share wait for the others at the end of a study
on a separate group with no practical limit (a rank may legitimately compute
alone for a while).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import fields
from datetime import datetime, timedelta, timezone
from typing import Any

import torch
import torch.distributed as dist

from harness.config import RunConfig
from harness.context import RunContext
from harness.errors import UsageError, launched_by_harness, refuse
from harness.failure import report_failure, running_case, withdraw_on_stop
from harness.manifest import RunManifest, StudyEntry, json_ready, results_settings, settings_hash
from harness.out_lock import out_lock
from harness.placement import Launch, Placement
from harness.progress import Progress
from harness.results import MANIFEST, Journal, write_csv_atomic, write_text_atomic
from harness.schedule import make_schedule, slot_groups
from harness.studies.base import Case, Study, rows_by_table, tables_written

#: How long idle ranks wait for rank 0 between studies (a week: "no limit").
IDLE_WAIT = timedelta(days=7)

#: Test hook: "rank=R,case=SUBSTRING,mode=raise|kill|hang" makes rank R fail in
#: the first case whose id contains SUBSTRING. Used by the fault-tolerance tests.
FAULT_VARIABLE = "HARNESS_FAULT"


def _inject_fault(case: Case, rank: int) -> None:
    spec = os.environ.get(FAULT_VARIABLE)
    if not spec:
        return
    fields = dict(item.split("=", 1) for item in spec.split(","))
    if int(fields.get("rank", -1)) != rank or fields.get("case", "") not in case.id:
        return
    mode = fields.get("mode", "raise")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        while True:
            time.sleep(60)
    raise RuntimeError(f"fault injected by {FAULT_VARIABLE}")


def runnable_plan(plan: list[tuple[Study, list[Case]]], config: RunConfig,
                  world_sizes: tuple[int, ...]) -> tuple[list, list[str]]:
    """The studies that have cases, and the names of those left out.

    A study the user named (``--studies``) without a case is refused, as is a run left with
    none; a default study without a case (e.g. hooks at world size 1) is left out.
    """
    empty = [study.name for study, cases in plan if not cases]
    if empty and (config.studies_named or len(empty) == len(plan)):
        raise UsageError(f"{', '.join(empty)}: no case for --strategies "
                         f"{','.join(config.strategies)} at world sizes "
                         f"{','.join(map(str, world_sizes))}; `study.py --list` and --help say "
                         "what each study runs")
    return [(study, cases) for study, cases in plan if cases], empty


class Runner:
    def __init__(self, config: RunConfig, launch: Launch, placement: Placement,
                 world_sizes: tuple[int, ...], studies: list[Study]) -> None:
        self.config, self.launch, self.placement = config, launch, placement
        self.world_sizes, self.studies = world_sizes, studies
        self.leader = launch.is_leader

    # ----------------------------------------------------------------- set-up
    def _init_distributed(self) -> RunContext:
        if self.placement.device.type == "cuda":
            torch.cuda.set_device(self.placement.device)
        timeout = timedelta(seconds=self.config.timeout)
        if not dist.is_initialized():  # tests initialise it themselves, through a FileStore
            dist.init_process_group(self.placement.backend, timeout=timeout)
        # new_group is collective: every rank creates every group, in the same order.
        # The full-size one too, rather than reusing WORLD: then --timeout holds
        # however the default group was initialised.
        groups = {(first, k): dist.new_group(list(range(first, first + k)), timeout=timeout)
                  for first, k in slot_groups(self.world_sizes, self.launch.world_size)}
        self.idle_group = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
        hostnames: list[str] = [""] * self.launch.world_size
        dist.all_gather_object(hostnames, self.launch.hostname, group=self.idle_group)
        return RunContext(self.config, self.launch, self.placement, self.world_sizes,
                          groups, hosts=len(set(hostnames)), hostnames=tuple(hostnames))

    def _hold_out(self, held: contextlib.ExitStack) -> UsageError | None:
        """--out for this run alone, held by rank 0 until the run ends, unless the launcher
        that started the ranks holds it (``--nproc``); why not, where another run holds it."""
        if not self.leader or launched_by_harness():
            return None
        try:
            held.enter_context(out_lock(self.config.out, "grad-study"))
        except UsageError as error:
            return error
        return None

    def _resumed_rows(self, journal: Journal, refused: UsageError | None = None
                      ) -> dict[str, list[dict]]:
        """Every rank reads its own journal; all learn every finished case (or why not:
        ``refused``, this rank's reason to run nothing).

        Journals are per rank because single-process cases finish on whichever
        rank ran them -- and on multi-node runs the ranks may share no folder.
        """
        try:
            mine: dict | UsageError = refused or (
                journal.load() if self.config.resume else {})
        except UsageError as error:
            mine = error
        everyone: list[Any] = [None] * self.launch.world_size
        dist.all_gather_object(everyone, mine, group=self.idle_group)
        for entry in everyone:
            if isinstance(entry, UsageError):
                raise entry
        done: dict[str, list[dict]] = {}
        for entry in everyone:
            done.update(entry)
        self.kept = mine if isinstance(mine, dict) else {}
        return done

    # ------------------------------------------------------------------- run
    def run(self) -> int:
        """The plan: process groups, resume, every study's cases, CSVs, manifest, report."""
        # SIGTERM exits at once, even inside a collective (harness/failure.py says how).
        withdraw_on_stop(self.launch.rank)
        started = time.time()
        ctx = self._init_distributed()
        with contextlib.ExitStack() as held:
            return self._run_holding(ctx, started, self._hold_out(held))

    def _run_holding(self, ctx: RunContext, started: float,
                     refused: UsageError | None) -> int:
        self.settings = results_settings(self.config, self.placement, self.world_sizes)
        journal = Journal(self.config.out, settings_hash(self.settings), self.launch.rank)
        try:
            done = self._resumed_rows(journal, refused)
        except UsageError as error:
            return self._refuse(error)
        try:
            plan, left_out = runnable_plan([(study, study.cases(ctx)) for study in self.studies],
                                           self.config, self.world_sizes)
        except UsageError as error:
            return self._refuse(error)
        if self.leader:
            self._announce(ctx, plan, done, left_out)
        journal.start(self.kept)
        study_times = self._run_plan(plan, ctx, done, journal)
        journal.finish()
        dist.barrier(group=self.idle_group)
        if self.leader:
            journal.remove_folder()
            self._finish(ctx, plan, study_times, started)
        dist.destroy_process_group()
        return self._write_report() if self.leader and self.config.report else 0

    def _refuse(self, error: UsageError) -> int:
        """Every rank reaches the same refusal (its inputs were gathered), so the quiet
        ranks wait on a barrier for rank 0's line instead of sleeping."""
        code = refuse(error, self.launch.rank, wait=False)
        dist.barrier(group=self.idle_group)
        dist.destroy_process_group()
        return code

    def _run_plan(self, plan: list, ctx: RunContext, done: dict[str, list[dict]],
                  journal: Journal) -> dict[str, float]:
        """Every study in turn; rank 0 writes each study's CSV as soon as it completes."""
        study_times: dict[str, float] = {}
        total = sum(len(cases) for _, cases in plan)
        with Progress(total, len(done), self.leader and not self.config.quiet) as progress:
            for study, cases in plan:
                begun = time.perf_counter()
                rows = self._run_study(study, cases, ctx, done, journal, progress)
                if self.leader:
                    for table, table_rows in rows_by_table(study, cases, rows).items():
                        write_csv_atomic(self.config.out / table.csv, table_rows,
                                         table.column_names())
                study_times[study.name] = time.perf_counter() - begun
        return study_times

    def _write_report(self) -> int:
        """REPORT.md from the CSVs just written; they are safe on disk whatever happens here."""
        from harness.report import write_report
        from harness.studies import catalogue

        try:
            path = write_report(self.config.out, catalogue())
        except Exception as error:  # a report bug must not hide that the CSVs are fine
            print(f"study.py: error: the CSVs in {self.config.out} are complete, but "
                  f"REPORT.md could not be written: {type(error).__name__}: {error}",
                  file=sys.stderr)
            return 1
        if not self.config.quiet:
            print(f"\nstudy.py: report -> {path}")
        return 0

    def _run_study(self, study: Study, cases: list[Case], ctx: RunContext,
                   done: dict[str, list[dict]], journal: Journal, progress: Progress
                   ) -> list[dict]:
        """Run this rank's share of ``study``; on rank 0, return every row in case order."""
        pending = [case for case in cases if case.id not in done]
        schedule = make_schedule(pending, self.launch.world_size,
                                 any_slot=study.any_slot)
        finished: dict[str, list[dict]] = {}
        for case in schedule.runs(ctx.rank):
            ctx.first_rank = schedule.first_rank.get(case.id, 0)
            rows = self._run_case(study, case, ctx)
            if schedule.owner[case.id] == ctx.rank:
                finished[case.id] = rows
                journal.append(case.id, rows)
                progress.advance()
        gathered: list[Any] = [None] * self.launch.world_size if self.leader else None
        dist.gather_object(finished, gathered, dst=0, group=self.idle_group)
        if not self.leader:
            return []
        every = dict(done)
        for part in gathered:
            every.update(part)
        return [row for case in cases for row in every[case.id]]

    def _run_case(self, study: Study, case: Case, ctx: RunContext) -> list[dict] | None:
        with running_case(ctx.rank, case.id):
            try:
                _inject_fault(case, ctx.rank)
                own_rows = study.run_case(case, ctx)
            except Exception as error:
                cause = f"in case {case.id}: {type(error).__name__}: {error}"
                report_failure(ctx.rank, cause)
                if not launched_by_harness():
                    print(f"study.py: rank {ctx.rank} failed {cause}", file=sys.stderr,
                          flush=True)
                error.reported = True  # type: ignore[attr-defined]
                raise
        if own_rows is None:
            return None
        rows = []
        for own in own_rows:
            device = own.pop("device", None)
            status = own.pop("status", "ok")
            rows.append({"study": study.name, "case_id": case.id, **own,
                         **ctx.context_columns(device), "ran_on": ctx.ran_on(case),
                         "status": status})
        return rows

    # ---------------------------------------------------------------- output
    def _announce(self, ctx: RunContext, plan: list, done: dict, left_out: list[str]) -> None:
        if self.config.quiet:
            return
        sizes = ",".join(map(str, self.world_sizes))
        total = sum(len(cases) for _, cases in plan)
        print(f"study.py: {self.launch.world_size} rank(s) on {ctx.hosts} host(s), "
              f"{self.placement.description} dtype={self.config.dtype}, world sizes {sizes}; "
              f"{total} cases in {', '.join(s.name for s, _ in plan)}"
              + (f" ({len(done)} resumed)" if done else "")
              + (f"; left out, no case at world sizes {sizes}: {', '.join(left_out)}"
                 if left_out else ""), flush=True)

    def _finish(self, ctx: RunContext, plan: list, study_times: dict[str, float],
                started: float) -> None:
        manifest = RunManifest(
            command=self._command(),
            settings=self.settings,
            config={f.name: json_ready(getattr(self.config, f.name))
                    for f in fields(self.config) if f.name not in ("known_studies",
                                                                    "study_options")},
            world_sizes=list(self.world_sizes),
            context=ctx.context_columns(),
            started=datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
            wall_time_s=round(time.time() - started, 3),
            studies={study.name: StudyEntry(tuple(t.csv for t in tables_written(study, cases)),
                                            len(cases), round(study_times[study.name], 3))
                     for study, cases in plan},
        )
        write_text_atomic(self.config.out / MANIFEST, manifest.to_json())
        if not self.config.quiet:
            self._print_summaries(plan)

    def _command(self) -> str:
        """The command that started this run, as the user would type it again.

        Neither torchrun's own flags nor ``--nproc`` reach the ranks' argv: this is the
        launch's equivalent.
        """
        if launched_by_harness():
            launcher = ["python scripts/study.py", f"--nproc {self.launch.local_world_size}"]
        else:
            launcher = [f"torchrun --nnodes={self.launch.nodes}",
                        f"--nproc_per_node={self.launch.local_world_size}", "scripts/study.py"]
        return " ".join([*launcher, *sys.argv[1:]])

    def _print_summaries(self, plan: list) -> None:
        import pandas as pd

        for study, cases in plan:
            for table in tables_written(study, cases):
                frame = pd.read_csv(self.config.out / table.csv)
                print(f"\n== {table.name} ({len(frame)} rows) -> "
                      f"{self.config.out / table.csv}\n{study.table_summary(table, frame)}")
