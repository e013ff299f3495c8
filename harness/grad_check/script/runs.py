"""Every run of one ``grad-check run``: the reference twice, then each other split once.

The reference runs first, so that a command that fails, refuses its arguments, never
steps an optimizer or is not deterministic is said in one line before any other split
runs. A split that is the reference itself is judged from the reference's second run
(its rows say how far two runs of the same split are apart). Captures live in a
temporary folder, removed at the end; every run's output stays in ``--out``'s ``logs/``
(``reference-1/``, ``reference-2/``, then one folder per split: ``rank<R>.log``, or
``launcher.log`` where the command's launcher started the ranks).
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.check.causes.not_finite import not_finite_text
from harness.check.causes.words import WHAT, shown
from harness.errors import INTERRUPTED_EXIT
from harness.failure import STOPPED_EXIT
from harness.grad_check.script import factors
from harness.grad_check.script.failures import (
    ReferenceUnusable,
    RunFailure,
    SplitFailure,
    Unusable,
)
from harness.grad_check.script.processes import CommandLauncher, SplitRun
from harness.grad_check.script.records import Captured
from harness.grad_check.script.repeatable import check_deterministic
from harness.grad_check.script.schema import COLUMN_NAMES
from harness.grad_check.script.script_config import CSV_NAME, LOGS, ScriptConfig
from harness.grad_check.script.split_judge import Noise, SplitJudge
from harness.grad_check.script.splits import Split
from harness.launcher import Stopped


class Interrupted(Exception):
    """Ctrl-C or SIGTERM stopped the check: ``exit_code`` (130, 143) and ``line`` to end
    with, once the finished rows are written (``ScriptCheck.finished``)."""

    def __init__(self, exit_code: int, line: str) -> None:
        super().__init__(line)
        self.exit_code, self.line = exit_code, line


class ScriptCheck:
    def __init__(self, config: ScriptConfig, launch: CommandLauncher,
                 say: Callable[[str], None] = lambda _: None) -> None:
        self.config, self.launch, self.say = config, launch, say
        #: The rows of every split judged so far, by split in the order they ran: what a
        #: check that ends early (a reference found unusable, Ctrl-C, SIGTERM) still writes.
        self.judged: dict[Split, list[dict[str, Any]]] = {}
        #: The splits of N == k, kept until the others have run (name_ties).
        self.tied: dict[Split, Captured] = {}
        #: Every run of the command that failed, in the order they ran.
        self.failed: list[RunFailure] = []

    @property
    def finished(self) -> list[dict[str, Any]]:
        return [row for rows in self.judged.values() for row in rows]

    @property
    def logs(self) -> Path:
        return self.config.out / LOGS

    def rows(self) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory(prefix="grad-check-run-") as scratch:
            self._rows(Path(scratch))
        return self.finished

    def _rows(self, scratch: Path) -> None:
        reference = self.config.reference
        twice = not self.config.reference_once or reference in self.config.splits
        first = self.reference_run(scratch, "reference-1", 1, runs=2 if twice else 1)
        again, noise = None, {}
        if twice:
            again = self.reference_run(scratch, "reference-2", 2, against=first.run.folder)
            noise = check_deterministic(first, again)
        self.say_what_the_reference_left_out(first)
        for split in self.config.splits:
            try:
                measured = again if split == reference else self.captured_at(
                    split, scratch, split.label, "split", against=first.run.folder)
            except Interrupted as interrupted:
                # The split's steps that finished before it was stopped are kept, judged.
                self.judge(self.stopped_run(split, scratch, interrupted), first, noise)
                raise
            if measured.run.failure is not None and split != reference:
                self.say(f"split {split.label} failed{self.after_steps(measured)}: "
                         f"{measured.run.failure} (its output: {measured.run.logs})")
            self.judge(measured, first, noise)
        self.name_ties(first, noise)

    def judge(self, measured: Captured, first: Captured, noise: Noise,
              ties: dict | None = None) -> None:
        self.judged[measured.run.split] = SplitJudge(
            measured, first, noise, self.config.global_batch, ties or {}).rows()
        if measured.run.split.world_size == measured.run.split.accum_steps > 1:
            self.tied[measured.run.split] = measured
        self.keep()

    def keep(self) -> None:
        """Every row judged so far into ``script.csv``, replacing what it held: a check that
        cannot go on (a full disk, SIGKILL) leaves the splits that finished before."""
        from harness.results import write_csv_atomic

        write_csv_atomic(self.config.out / CSV_NAME, self.finished, COLUMN_NAMES)

    def name_ties(self, first: Captured, noise: Noise) -> None:
        """A split of N == k judged again once every split ran: whether its scale follows
        N or k, the other splits tell (factors.py)."""
        others = [row for split, rows in self.judged.items() if split not in self.tied
                  for row in rows]
        seen = factors.evidence(others)
        ties = {key: factors.tie_name(powers) for key, powers in seen.items()}
        for measured in self.tied.values():
            self.judge(measured, first, noise, ties)

    def stopped_run(self, split: Split, scratch: Path, interrupted: Interrupted) -> Captured:
        """What a split stopped by Ctrl-C or SIGTERM left: its ranks' finished steps."""
        stopped = SplitRun(split, self.config.shown_of(split), scratch / split.label,
                      math.nan, SplitFailure(None, interrupted.exit_code, interrupted.line),
                      self.logs / split.label)
        return Captured.read(stopped)

    def say_what_the_reference_left_out(self, first: Captured) -> None:
        """Steps fewer than --steps (the script ended first), and what the capture could not
        read, each in a line: the rows cover what was captured, no more."""
        for optimizer in range(len(first.optimizers)):
            taken = first.steps(optimizer)
            if taken < self.config.steps:
                self.say(f"the reference's script ended after {taken} step(s) of "
                         f"{first.label(optimizer)}, fewer than --steps "
                         f"{self.config.steps}: its rows compare {taken}")
        for line in first.unknown:
            self.say(f"the capture could not read everything (recorded as unknown): {line}")

    def captured_at(self, split: Split, scratch: Path, name: str, what: str,
            attempt: str = "", against: Path | None = None) -> Captured:
        """One run of the command at ``split``: its capture in ``scratch/name``, its output
        in ``--out``'s ``logs/name``; ``against``: the reference's first run, which it
        compares with."""
        command = self.config.command_of(split)
        # An earlier check's output of the same run (more ranks, say) is not this one's; the
        # rest of --out is the user's (a --out that holds their own logs/, for one).
        shutil.rmtree(self.logs / name, ignore_errors=True)
        self.say(f"{what} {split.label} (N={split.world_size}, k={split.accum_steps}, "
                 f"b={split.micro_batch(self.config.global_batch)}){attempt}: "
                 f"{shlex.join(self.config.shown_of(split))}")
        try:
            run = self.launch.run_split(split, command, scratch / name, self.logs / name,
                                  self.config.variables_of(split), against)
        except KeyboardInterrupt:
            raise Interrupted(INTERRUPTED_EXIT, "interrupted") from None
        except Stopped:
            raise Interrupted(STOPPED_EXIT, "stopped by SIGTERM") from None
        if (failure := run.failure) is not None:
            self.failed.append(RunFailure(name, split.label, failure.line, failure.rank,
                                          failure.exitcode, failure.error))
        # Its rows keep the command with the variables it was given: the run, repeatable.
        return Captured.read(dataclasses.replace(run, command=self.config.shown_of(split)))

    def after_steps(self, captured: Captured) -> str:
        """Where a run failed after every step it was to capture (``--keep-going`` let the
        script go on), the words saying so: its steps are compared as any run's."""
        if not (self.config.keep_going and captured.holds(self.config.steps)):
            return ""
        return (f" after its {self.config.steps} captured step(s), as --keep-going let it "
                "go on (its steps are compared)")

    def reference_run(self, scratch: Path, name: str, attempt: int,
                      against: Path | None = None, runs: int = 2) -> Captured:
        """One of the reference's runs (two, unless --reference-once); its failure ends the
        check."""
        split = self.config.reference
        captured = self.captured_at(split, scratch, name, "reference", f", run {attempt} of {runs}",
                            against)
        failure = captured.run.failure
        where = f"the reference {split.label}"
        if failure is not None and (after := self.after_steps(captured)):
            # What failed ran after the steps compared (an evaluation, a checkpoint): the
            # steps stand, and so does every split's comparison with them.
            self.say(f"{where} failed{after}: {failure}")
            failure = None
        if failure is not None and failure.refused:
            raise ReferenceUnusable(f"{where}: {failure}", Unusable.REFUSED,
                                    f"{where}: {failure.line}")
        if failure is not None:
            raise ReferenceUnusable(f"{where} failed: {failure} (its output: "
                                    f"{captured.run.logs})", Unusable.FAILED,
                                    f"{where} failed: {failure.line}")
        if not captured.stepped:
            raise ReferenceUnusable(f"{where}: the command ended without stepping an optimizer (no "
                             "torch.optim.Optimizer's step() ran in it); allowed: a command "
                             "that trains for at least one step, e.g. python train.py",
                             Unusable.NEVER_STEPPED)
        if (found := captured.first_not_finite()) is not None:
            _, step, point, tensors = found
            text = not_finite_text(step, WHAT[point], shown(tensors))
            raise ReferenceUnusable(
                f"{where}: {text}; allowed: a script whose loss and gradients stay finite over "
                "--steps (look at its loss, its learning rate, its data, a GradScaler's "
                "unscale)", Unusable.NOT_FINITE)
        return captured
