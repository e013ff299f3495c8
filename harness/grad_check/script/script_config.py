"""The settings of one ``grad-check run``, as a dataclass that refuses bad values itself.

Everything that can be refused before the command first runs is refused here: the
splits, the global batch, the placeholders, the command's program, a launcher at its
head that cannot run the splits, more ranks than the machine's GPUs (each rank takes the
GPU its LOCAL_RANK names). More ranks than CPU cores is allowed, as the studies allow it:
the verdicts are the same, the runs slower.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from harness.check.outcome import FAIL_ON
from harness.errors import UsageError
from harness.grad_check.script.launchers import (
    LAUNCHER_CHOICES,
    Launcher,
    adapted,
    check_launcher,
    is_python,
    launcher_of,
)
from harness.grad_check.script.splits import (
    MAX_GLOBAL_BATCH,
    Split,
    check_divides,
    check_placeholders,
    substituted,
)
from harness.options import check_known, check_timeout
from harness.verdicts import Equivalence

CSV_NAME = "script.csv"
#: What failed, by its fields, where anything did (harness/grad_check/script/failures.py
#: ``CheckFailures``).
FAILURES_NAME = "failures.json"
#: The folder in ``--out`` that keeps every run's output (matrix.py).
LOGS = "logs"
#: Optimizer steps compared per split: enough for a second step to show what the first
#: one's update did to the next gradient; more only costs time.
DEFAULT_STEPS = 2
#: ``--fail-on``'s default here: a script run unchanged means no scale of its gradient
#: (the Setup matrix's default, ``differs``, leaves a deliberate one, a summed loss with
#: its learning rate divided to match, to its ``params`` rows); a scale a clip or Adam
#: absorbs at one step is still not the big batch's gradient.
DEFAULT_FAIL_ON = str(Equivalence.SCALED)
#: Steps beyond this would only make a check slow: every step's tensors are kept on disk.
MAX_STEPS = 100


@dataclass(frozen=True)
class ScriptConfig:
    #: The user's command, with placeholders, as given after ``--``.
    command: tuple[str, ...]
    #: G: samples per optimizer step, the same at every split.
    global_batch: int
    splits: tuple[Split, ...]
    reference: Split = Split(1, 1)
    steps: int = DEFAULT_STEPS
    #: Let the script run to its end after the captured steps, instead of stopping it.
    keep_going: bool = False
    #: Run the reference split once where it is not among the splits too: a script's
    #: repeatability is then not checked (its randomness would read as the splits').
    reference_once: bool = False
    out: Path = Path("check-results")
    fail_on: str = DEFAULT_FAIL_ON
    #: Seconds one run of the command may take before it is stopped as hung.
    timeout: float = 300.0
    quiet: bool = False
    #: Who starts a split's N ranks: grad-check, the command (a launcher at its head), or
    #: auto: the command where its head is a launcher grad-check knows.
    launcher: str = "auto"
    #: N = 1 gets torchrun's variables too (RANK=0, WORLD_SIZE=1, ...).
    torchrun_env: bool = False
    #: GPUs the command's processes see (CUDA_VISIBLE_DEVICES; launchers.visible_gpus): one
    #: per rank at most; where there are none, accelerate launch is adapted to the CPUs.
    gpus: int = 0

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("no command after --; allowed: grad-check run [options] -- "
                             "python train.py --batch-size {batch} --grad-accum {accum}")
        if not 1 <= self.global_batch <= MAX_GLOBAL_BATCH:
            raise UsageError(f"--global-batch {self.global_batch} is not allowed; allowed: "
                             f"1..{MAX_GLOBAL_BATCH} (2^24: the capture records every "
                             "sample of a step)")
        for split in self.splits:
            check_divides(split, self.global_batch, "--splits")
        check_divides(self.reference, self.global_batch, "--reference")
        for split in self.runs:
            if self.gpus and split.world_size > self.gpus:
                raise UsageError(f"split {split.label} starts {split.world_size} ranks on this "
                                 f"machine, which shows {self.gpus} GPU(s), one per rank "
                                 f"(LOCAL_RANK); allowed: N <= {self.gpus}, or the ranks on "
                                 "CPU cores with CUDA_VISIBLE_DEVICES= (empty)")
        check_placeholders(self.command, self.runs, self.global_batch)
        check_known("--launcher", [self.launcher], LAUNCHER_CHOICES)
        head = launcher_of(self.command)
        if head is not None and self.launcher == "grad-check":
            raise UsageError(f"--launcher grad-check runs the command once per rank, but "
                             f"{head.name} at its head starts ranks itself: N of them would "
                             "start N x N; allowed: --launcher auto or command")
        if self.launched_by is not None:
            if self.torchrun_env:
                raise UsageError(f"--torchrun-env gives torchrun's variables to the one "
                                 f"process grad-check starts at N = 1, but here "
                                 f"{self.launched_by} starts the ranks and gives them theirs; "
                                 "allowed: --torchrun-env without a launcher in the command")
            if head is not None:
                check_launcher(head, self.command, self.runs)
        if not 1 <= self.steps <= MAX_STEPS:
            raise UsageError(f"--steps {self.steps} is not allowed; allowed: 1..{MAX_STEPS}")
        check_timeout(self.timeout)
        check_known("--fail-on", [self.fail_on], tuple(FAIL_ON))
        check_program(self.command)

    @property
    def most_ranks(self) -> int:
        return max(split.world_size for split in self.runs)

    @property
    def runs(self) -> tuple[Split, ...]:
        """The reference, then every other split, each once."""
        return (self.reference, *(split for split in self.splits if split != self.reference))

    @property
    def head(self) -> Launcher | None:
        """The launcher at the command's head, where it has one grad-check knows."""
        return launcher_of(self.command)

    @property
    def launched_by(self) -> str | None:
        """What starts the split's ranks where not grad-check: the launcher's name."""
        if self.launcher == "grad-check":
            return None
        head = self.head
        if head is not None:
            return head.name
        return "the command" if self.launcher == "command" else None

    def command_of(self, split: Split) -> list[str]:
        """The command as it runs at ``split``: placeholders substituted, and adapted where
        this machine forces it (launchers.adapted)."""
        return adapted(self.head, substituted(self.command, split, self.global_batch), split,
                       self.gpus)[0]

    def variables_of(self, split: Split) -> dict[str, str]:
        """What the command's processes get besides at ``split`` (launchers.adapted)."""
        return adapted(self.head, substituted(self.command, split, self.global_batch), split,
                       self.gpus)[1]

    def shown_of(self, split: Split) -> tuple[str, ...]:
        """The command as it runs at ``split``, as a shell types it: the variables it is
        given besides first (``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu ...``),
        so that the line shown and kept, run bare, is the run measured."""
        variables = self.variables_of(split)
        return (*(f"{name}={variables[name]}" for name in sorted(variables)),
                *self.command_of(split))


def check_program(command: tuple[str, ...]) -> None:
    """The program must exist; and where it is a Python interpreter given a script, the
    script too: either would otherwise fail only once the reference runs, in a
    traceback of the interpreter's rather than in one line."""
    program = command[0]
    if shutil.which(program) is None:
        raise UsageError(f"the command {program!r} is not found (not on PATH, or not an "
                         "executable file); allowed: a program such as python, e.g. -- "
                         "python train.py --batch-size {batch}")
    head = launcher_of(command)
    if head is not None:
        script = next((argument for argument in command[head.arguments_at:]
                       if argument.endswith(".py")), None)
        if script is not None and not Path(script).is_file():
            raise UsageError(f"the script {script!r} that {head.name} starts is not found (from "
                             f"{os.getcwd()}); allowed: a path to the training script, from "
                             "the current folder")
        return
    script = next((argument for argument in command[1:] if not argument.startswith("-")),
                  None)
    if (is_python(program) and script is not None and script.endswith(".py")
            and command[command.index(script) - 1] not in ("-m", "-c")
            and not Path(script).is_file()):
        raise UsageError(f"the script {script!r} is not found (from {os.getcwd()}); allowed: "
                         "a path to the training script, from the current folder")
