"""The contract between ``grad-check run`` and the processes it starts: what each process
of a split is told, through its environment, how it names itself to grad-check, and what
each rank reports back (:class:`RankSummary`: its steps' :class:`StepRecord`, each point's
:class:`PointFit`), each refusing on reading what it does not declare.

The launcher's side (processes.py) writes a :class:`RankSettings` into each process's
environment; the rank's side (guard.py, capture.py) reads it back. Both import this
module and nothing of each other, and it imports no torch: a launcher at the command's
head (torchrun, ``tune run``) reads it before any rank has loaded torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

#: The split's folder; the guard and the capture are installed only where it is set.
FOLDER_VARIABLE = "GRAD_CHECK_CAPTURE"
#: Optimizer steps to capture (S).
STEPS_VARIABLE = "GRAD_CHECK_STEPS"
#: "1": let the script run to its end after step S.
KEEP_GOING_VARIABLE = "GRAD_CHECK_KEEP_GOING"
#: Seconds a rank waits at step S for the other ranks' summaries.
TIMEOUT_VARIABLE = "GRAD_CHECK_TIMEOUT"
#: The split's micro-batch b, where the samples' axis is found by its size.
MICRO_BATCH_VARIABLE = "GRAD_CHECK_MICRO_BATCH"
#: The reference's first run's folder, where a run compares instead of writing.
REFERENCE_VARIABLE = "GRAD_CHECK_REFERENCE"
#: grad-check's process: its pid, its start time (``/proc``, '' where unknown) and its
#: process group, which the guard never signals.
PID_VARIABLE = "GRAD_CHECK_PID"
PID_START_VARIABLE = "GRAD_CHECK_PID_START"
PGID_VARIABLE = "GRAD_CHECK_PGID"
#: N: the split's ranks.
NPROC_VARIABLE = "GRAD_CHECK_NPROC"
#: The split's label (``2x1``), for the lines.
SPLIT_VARIABLE = "GRAD_CHECK_SPLIT"
#: "command": the command starts the split's ranks itself (a launcher at its head); the
#: process grad-check started is then its launcher, not a rank.
LAUNCHER_VARIABLE = "GRAD_CHECK_LAUNCHER"
#: The launcher's name as the messages say it (``torchrun``).
LAUNCHER_NAME_VARIABLE = "GRAD_CHECK_LAUNCHER_NAME"
#: "1": each compared point also records the tensor memory its work held at its peak
#: beyond what the process held before (harness/check/memory.py) and its pieces' bytes
#: (scripts/bench.py measures the capture's extra memory per rank with it).
MEMORY_VARIABLE = "GRAD_CHECK_MEMORY"

#: The training frameworks a fix may name in their own terms (a rank's summary lists those
#: the script imported), by the module that shows the script uses them.
FRAMEWORK_MODULES = {"trainer": "transformers.trainer", "trl": "trl", "accelerate": "accelerate",
                     "lightning": "lightning", "deepspeed": "deepspeed"}

#: What :class:`RankSettings` is carried in: a process inherits none of them from
#: grad-check's own environment (a check run inside another's split).
SETTINGS_VARIABLES = (FOLDER_VARIABLE, STEPS_VARIABLE, KEEP_GOING_VARIABLE, TIMEOUT_VARIABLE,
                      MICRO_BATCH_VARIABLE, REFERENCE_VARIABLE, PID_VARIABLE,
                      PID_START_VARIABLE, PGID_VARIABLE, NPROC_VARIABLE, SPLIT_VARIABLE,
                      LAUNCHER_VARIABLE, LAUNCHER_NAME_VARIABLE)

#: What the guards write in the split's folder, for grad-check to read: every process's
#: registration (``processes/<pid>``: :class:`ProcessEntry`), each rank's progress
#: (``progress/rank<R>``: :class:`Progress`), each RANK's claim (``claims/rank<R>``:
#: :class:`Claim`), and a failure that ends the split at once (``fatal``: :class:`Fatal`).
PROCESSES, PROGRESS, CLAIMS, FATAL = "processes", "progress", "claims", "fatal"


class BadSettings(ValueError):
    """An environment that names a split's folder but not a usable split."""


@dataclass(frozen=True)
class RankSettings:
    """What grad-check tells every process of one split."""

    folder: Path
    steps: int
    keep_going: bool
    timeout: float
    #: grad-check's own process, which the guard watches and never signals.
    pid: int
    pid_start: str
    pgid: int
    nproc: int
    split: str = ""
    micro_batch: int | None = None
    #: The reference's capture compared with (None: this run is the reference).
    against: Path | None = None
    #: The launcher at the command's head that starts the ranks (None: grad-check does).
    launcher: str | None = None

    def __post_init__(self) -> None:
        for name, value, least in (("steps", self.steps, 1), ("nproc", self.nproc, 1),
                                   ("micro_batch", self.micro_batch or 1, 1)):
            if value < least:
                raise BadSettings(f"{name} {value}: allowed: an integer from {least}")
        if not self.timeout > 0:
            raise BadSettings(f"timeout {self.timeout}: allowed: seconds above 0")

    def environment(self) -> dict[str, str]:
        """The variables that carry these settings to a process."""
        variables = {FOLDER_VARIABLE: str(self.folder), STEPS_VARIABLE: str(self.steps),
                     KEEP_GOING_VARIABLE: "1" if self.keep_going else "0",
                     TIMEOUT_VARIABLE: str(self.timeout), PID_VARIABLE: str(self.pid),
                     PID_START_VARIABLE: self.pid_start, PGID_VARIABLE: str(self.pgid),
                     NPROC_VARIABLE: str(self.nproc), SPLIT_VARIABLE: self.split}
        if self.micro_batch is not None:
            variables[MICRO_BATCH_VARIABLE] = str(self.micro_batch)
        if self.against is not None:
            variables[REFERENCE_VARIABLE] = str(self.against)
        if self.launcher is not None:
            variables.update({LAUNCHER_VARIABLE: "command",
                              LAUNCHER_NAME_VARIABLE: self.launcher})
        return variables

    @classmethod
    def from_environment(cls, environment: Mapping[str, str]) -> RankSettings | None:
        """The settings ``environment`` carries (None where it names no split's folder)."""
        folder = environment.get(FOLDER_VARIABLE)
        if not folder:
            return None
        try:
            micro_batch = environment.get(MICRO_BATCH_VARIABLE)
            against = environment.get(REFERENCE_VARIABLE)
            launched = environment.get(LAUNCHER_VARIABLE) == "command"
            return cls(Path(folder), int(environment.get(STEPS_VARIABLE, "2")),
                       environment.get(KEEP_GOING_VARIABLE) == "1",
                       float(environment.get(TIMEOUT_VARIABLE, "300")),
                       int(environment.get(PID_VARIABLE) or 0),
                       environment.get(PID_START_VARIABLE, ""),
                       int(environment.get(PGID_VARIABLE) or 0),
                       int(environment.get(NPROC_VARIABLE) or 1),
                       environment.get(SPLIT_VARIABLE, ""),
                       int(micro_batch) if micro_batch else None,
                       Path(against) if against else None,
                       environment.get(LAUNCHER_NAME_VARIABLE, "the launcher")
                       if launched else None)
        except ValueError as error:
            raise BadSettings(f"{FOLDER_VARIABLE}={folder}: {error}") from None

    @property
    def launched_by_command(self) -> bool:
        return self.launcher is not None


# ---------------------------------------------------------------- what a rank reports
class BadRecord(ValueError):
    """A rank's report that holds what this version does not know, or lacks what it must
    hold: written by another version of the capture, or not by the capture at all."""


def known_fields(kind: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` as ``kind``'s fields, refusing any field ``kind`` does not declare."""
    if not isinstance(data, Mapping):
        raise BadRecord(f"{kind.__name__}: {type(data).__name__} where a mapping was written")
    names = {item.name for item in fields(kind)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise BadRecord(f"{kind.__name__}: unknown field(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted(names))}")
    return dict(data)


# ---------------------------------------------------------------- what a guard writes
class JsonRecord:
    """A record of the guards' written as one JSON object of its fields, read back refusing
    any field it does not declare."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str):
        return cls(**known_fields(cls, json.loads(text)))


@dataclass(frozen=True)
class ProcessEntry(JsonRecord):
    """A process of the split, registered by its guard: grad-check ends what still runs of
    it after the split (a launcher's workers, in sessions of their own)."""

    pid: int
    #: Its start time (``/proc``), with ``pid`` naming one process and not a later one.
    start: str
    pgid: int
    #: Its RANK (None: the launcher at the command's head).
    rank: int | None
    command: str


@dataclass(frozen=True)
class Progress(JsonRecord):
    """A rank's optimizer steps and forward passes so far, and where it waits inside
    grad-check's own exchange (it reached that point), if it does."""

    steps: int
    forwards: int
    waiting: str | None = None


@dataclass(frozen=True)
class Claim(JsonRecord):
    """The live process that joined the process group as one RANK."""

    pid: int
    start: str
    command: str

    @property
    def named(self) -> str:
        """The process as a line names it: its pid and command, cut at 120 characters."""
        command = self.command
        return f"pid {self.pid} ({command[:120] + '...' if len(command) > 120 else command})"


@dataclass(frozen=True)
class RankError(JsonRecord):
    """A rank's Python error as its capture caught it: its type, the first sentence of its
    message (the failing source line where it says nothing, a bare ``assert``), and where
    it was raised (``file:line``: the innermost frame of the user's own code, else the
    innermost; "" where no frame is known)."""

    type: str
    message: str
    at: str = ""

    @property
    def line(self) -> str:
        """``Type: message (at file:line)``: the rank's one line."""
        return f"{self.type}: {self.message}" + (f" (at {self.at})" if self.at else "")


def error_record(folder: Path, rank: int) -> Path:
    """Where a rank's :class:`RankError` is kept, beside its line (``rank<R>.txt``)."""
    return folder / f"rank{rank}.error.json"


@dataclass(frozen=True)
class Fatal(JsonRecord):
    """A failure that ends the split at once: the rank that found it, its line, the exit
    code the rank ends with."""

    rank: int
    line: str
    exitcode: int



@dataclass(frozen=True)
class PointFit:
    """What a split's ranks found comparing one point of a step with the reference's first
    run (points.py): the fit over every rank's pieces (``fit``: scale and residual;
    ``errors``: each tensor's; ``nothing``: both sides all zero) and the residual at scale
    1 (``each``); or why nothing could be fitted (``unmatched``). ``memory``: the peak
    bytes the comparison's work and its pieces held, where asked (MEMORY_VARIABLE)."""

    fit: tuple[float, float] = (math.nan, math.nan)
    errors: dict[str, float] = field(default_factory=dict)
    nothing: bool = False
    each: float = math.nan
    unmatched: str = ""
    memory: dict[str, int] | None = None

    def recorded(self) -> dict[str, Any]:
        """The fit as harness/check/shards.py ``comparison_of`` reads it."""
        return {"fit": list(self.fit), "errors": self.errors, "nothing": self.nothing}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PointFit:
        found = known_fields(cls, data)
        if "fit" in found:
            found["fit"] = tuple(float(value) for value in found["fit"])
        return cls(**found)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as one rank saw it: its window's forwards (the samples fed, the
    labels counted per forward, the dataset indices handed), its clips and learning rates,
    the digests of its gradients and parameters (ranks holding whole copies), the norms
    around a clip, and what each point's comparison with the reference found."""

    optimizer: int
    step: int
    samples: list[list[Any]] = field(default_factory=list)
    forwards: int = 0
    per_forward: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    clips: list[str] = field(default_factory=list)
    clip_calls: int = 0
    indices: list[int] = field(default_factory=list)
    grad_digests: dict[str, float] | None = None
    params_digests: dict[str, float] | None = None
    kept_bytes: int = 0
    before_norm: float | None = None
    received_norm: float | None = None
    #: Each point's tensors holding a NaN or an infinity on this rank (``grad``, ``params``).
    non_finite: dict[str, list[str]] = field(default_factory=dict)
    compared: dict[str, PointFit | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # its PointFits too

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepRecord:
        found = known_fields(cls, data)
        found["compared"] = {point: PointFit.from_json(fit) if fit is not None else None
                             for point, fit in (found.get("compared") or {}).items()}
        return cls(**found)


@dataclass(frozen=True)
class OptimizerRecord:
    """An optimizer a rank stepped: its type, its tensors' names (the model's), the steps
    captured, and how the split spread it over the ranks (sharded.py SHARDINGS)."""

    kind: str
    names: list[str]
    steps: int = 0
    sharding: str = "none"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OptimizerRecord:
        return cls(**known_fields(cls, data))


@dataclass(frozen=True)
class RankSummary:
    """What one rank of a run reports when it ends (or at its last finished step): the
    optimizers and their steps, the floating types that ran, the frameworks imported,
    the model's BatchNorm tensors and training dropout, and what it could not read."""

    rank: int = 0
    world_size: int = 1
    frameworks: list[str] = field(default_factory=list)
    optimizers: list[OptimizerRecord] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    model_dtypes: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    batchnorm: list[str] = field(default_factory=list)
    dropout: list[str] = field(default_factory=list)
    #: The host the rank ran on.
    host: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # its optimizers and records too

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankSummary:
        found = known_fields(cls, data)
        found["optimizers"] = [OptimizerRecord.from_json(o) for o in found.get("optimizers", [])]
        found["records"] = [StepRecord.from_json(r) for r in found.get("records", [])]
        return cls(**found)
