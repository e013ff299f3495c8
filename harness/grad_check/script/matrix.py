"""Every run of one ``grad-check run``: the reference twice, then each other split once.

The reference runs first, so that a command that fails, refuses its arguments, never
steps an optimizer or is not deterministic is said in one line before any other split
runs. A split that is the reference itself is judged from the reference's second run
(its rows say how far two runs of the same split are apart). Captures live in a
temporary folder, removed at the end.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.grad_check.script.config import ScriptConfig
from harness.grad_check.script.judge import SplitJudge, check_deterministic
from harness.grad_check.script.processes import CommandLauncher
from harness.grad_check.script.records import Captured
from harness.grad_check.script.splits import Split


class ReferenceFailed(Exception):
    """The reference's run failed: there is nothing to compare with (one line)."""


class ScriptCheck:
    def __init__(self, config: ScriptConfig, launch: CommandLauncher,
                 say: Callable[[str], None] = lambda _: None) -> None:
        self.config, self.launch, self.say = config, launch, say

    def rows(self) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory(prefix="grad-check-run-") as scratch:
            return self._rows(Path(scratch))

    def _rows(self, scratch: Path) -> list[dict[str, Any]]:
        reference = self.config.reference
        first = self.reference_run(scratch / "reference-1", 1)
        again = self.reference_run(scratch / "reference-2", 2, against=first.run.folder)
        noise = check_deterministic(first, again)
        self.say_what_the_reference_left_out(first)
        rows: list[dict[str, Any]] = []
        for split in self.config.splits:
            measured = again if split == reference else self.run(
                split, scratch / split.label, "split", against=first.run.folder)
            rows += SplitJudge(measured, first, noise, self.config.global_batch).rows()
        return rows

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

    def run(self, split: Split, folder: Path, what: str, attempt: str = "",
            against: Path | None = None) -> Captured:
        """One run; ``against``: the reference's first run, which it compares with."""
        command = self.config.command_of(split)
        self.say(f"{what} {split.label} (N={split.world_size}, k={split.accum_steps}, "
                 f"b={split.micro_batch(self.config.global_batch)}){attempt}: "
                 f"{shlex.join(command)}")
        return Captured.read(self.launch.run(split, command, folder, against))

    def reference_run(self, folder: Path, attempt: int, against: Path | None = None
                      ) -> Captured:
        """One of the reference's two runs; its failure ends the check."""
        split = self.config.reference
        captured = self.run(split, folder, "reference", f", run {attempt} of 2", against)
        failure = captured.run.failure
        where = f"the reference {split.label}"
        if failure is not None and failure.refused:
            raise UsageError(f"{where}: {failure}")
        if failure is not None:
            raise ReferenceFailed(f"{where} failed: {failure}")
        if not captured.stepped:
            raise UsageError(f"{where}: the command ended without stepping an optimizer (no "
                             "torch.optim.Optimizer's step() ran in it); allowed: a command "
                             "that trains for at least one step, e.g. python train.py")
        return captured
