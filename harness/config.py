"""The run's configuration: one dataclass whose fields document and validate themselves.

Every field is checked where it is defined (``__post_init__``) so that a bad
value is refused with a message naming it and what is allowed, before any
process group or file exists. Checks that need the launch (how many ranks there
are) live in :meth:`RunConfig.check_launch`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.errors import UsageError
from harness.launch import BACKENDS, DEVICES, Launch

DTYPES: dict[str, torch.dtype] = {"float64": torch.float64, "float32": torch.float32}

#: Strategies the harness can run, each in its own module under harness/strategies.
STRATEGIES: dict[str, str] = {
    "local": "one process, no reduction: the single-device reference",
    "ddp": "torch.nn.parallel.DistributedDataParallel over a process subgroup",
    "fsdp": "FSDP2 (torch.distributed.fsdp.fully_shard) over a process subgroup",
    "dp-emulated": "CPU emulation of DataParallel's scatter/replicate/gather dataflow",
    "dp": "torch.nn.DataParallel over CUDA devices (rows say 'skipped' without them)",
}

MATRICES = ("default", "full")


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); a one-line error naming the flag and the bad item otherwise."""
    items = [item.strip() for item in text.split(",")]
    values = []
    for item in items:
        try:
            values.append(int(item))
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {item!r} is not an integer; "
                             "allowed: comma-separated integers, e.g. 1,2,4") from None
    return tuple(values)


def parse_name_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _check_known(flag: str, names: Iterable[str], allowed: Sequence[str]) -> None:
    for name in names:
        if name not in allowed:
            raise UsageError(f"{flag}: {name!r} is unknown; allowed: {', '.join(allowed)}")


def _check_positive_unique(flag: str, values: Sequence[int], upper: int | None = None) -> None:
    if not values:
        raise UsageError(f"{flag} is empty; give at least one value")
    for value in values:
        if value < 1:
            allowed = f"1..{upper}" if upper else "integers >= 1"
            raise UsageError(f"{flag}: {value} is not allowed; allowed: {allowed}")
    if len(set(values)) != len(values):
        raise UsageError(f"{flag}: {','.join(map(str, values))} repeats a value; "
                         "give each value once")


@dataclass(frozen=True)
class RunConfig:
    """What to measure and where to write it."""

    #: Studies to run, in order (names from ``--list``).
    studies: tuple[str, ...]
    #: Studies the harness knows; filled in by the CLI from the registry.
    known_studies: tuple[str, ...]
    #: World sizes k to measure, each on the process subgroup of ranks 0..k-1;
    #: empty means 1..N for a launch of N ranks.
    world_sizes: tuple[int, ...] = ()
    #: Strategies to measure (see STRATEGIES); each study runs those it supports.
    strategies: tuple[str, ...] = tuple(STRATEGIES)
    #: Collective backend: auto picks nccl when every rank has its own GPU, else gloo.
    backend: str = "auto"
    #: Device the model and batch live on: auto picks cuda when present.
    device: str = "auto"
    #: Floating-point type of models, data and gradients; float64 makes verdicts exact.
    dtype: str = "float64"
    #: Folder the CSVs, the report and its plots are written to.
    out: Path = Path("results")
    #: Seed of every batch and initial weight; the same seed gives the same numbers.
    seed: int = 0
    #: Samples per rank (per device) in the reduction study's global batch.
    shard_size: int = 4
    #: Accumulation steps k the accumulation study measures.
    accum_steps: tuple[int, ...] = (1, 2, 4, 8)
    #: Accumulation matrix: 'default' varies one group of axes at a time,
    #: 'full' measures the whole cartesian product.
    matrix: str = "default"
    #: Epochs of the training study.
    epochs: int = 5
    #: Seconds a collective may wait before the run fails instead of hanging.
    timeout: float = 300.0
    #: Reuse the finished cases of an interrupted run in ``out`` instead of recomputing them.
    resume: bool = False
    #: No progress bar and no summary table.
    quiet: bool = False
    #: Write REPORT.md and its plots at the end of the run.
    report: bool = True

    def __post_init__(self) -> None:
        if not self.studies:
            raise UsageError("--studies is empty; allowed: " + ", ".join(self.known_studies))
        _check_known("--studies", self.studies, self.known_studies)
        if len(set(self.studies)) != len(self.studies):
            raise UsageError(f"--studies {','.join(self.studies)} repeats a study")
        if not self.strategies:
            raise UsageError("--strategies is empty; allowed: " + ", ".join(STRATEGIES))
        _check_known("--strategies", self.strategies, tuple(STRATEGIES))
        if self.world_sizes:
            _check_positive_unique("--world-sizes", self.world_sizes)
        _check_known("--backend", [self.backend], BACKENDS)
        _check_known("--device", [self.device], DEVICES)
        _check_known("--dtype", [self.dtype], tuple(DTYPES))
        _check_known("--matrix", [self.matrix], MATRICES)
        if self.shard_size < 1:
            raise UsageError(f"--shard-size {self.shard_size} is not allowed; "
                             "allowed: integers >= 1")
        _check_positive_unique("--accum-steps", self.accum_steps)
        if self.epochs < 1:
            raise UsageError(f"--epochs {self.epochs} is not allowed; allowed: integers >= 1")
        if not self.timeout > 0:
            raise UsageError(f"--timeout {self.timeout} is not allowed; "
                             "allowed: seconds > 0")
        if self.seed < 0:
            raise UsageError(f"--seed {self.seed} is not allowed; allowed: integers >= 0")
        if self.out.exists() and not self.out.is_dir():
            raise UsageError(f"--out {str(self.out)!r} is a file; allowed: a folder "
                             "(it is created when missing)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolved_world_sizes(self, launch: Launch) -> tuple[int, ...]:
        """The world sizes to measure for this launch, checked against its size."""
        if not self.world_sizes:
            return tuple(range(1, launch.world_size + 1))
        for k in self.world_sizes:
            if k > launch.world_size:
                ranks = f"{launch.world_size} rank{'s' if launch.world_size > 1 else ''}"
                raise UsageError(
                    f"--world-sizes: {k} is larger than the launch's {ranks}; "
                    f"allowed: 1..{launch.world_size} "
                    f"(or launch more ranks with torchrun --nproc_per_node)")
        return tuple(sorted(self.world_sizes))
