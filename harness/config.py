"""The run's configuration: one dataclass whose fields document and validate themselves.

Every field is checked where it is defined (``__post_init__``) so that a bad
value is refused with a message naming it and what is allowed, before any
process group or file exists. Checks that need the launch (how many ranks there
are) live in :meth:`RunConfig.check_launch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from harness.errors import UsageError
from harness.options import (
    MAX_TIMEOUT_S,
    StudyOptions,
    check_known,
    check_positive_unique,
    check_seed,
    check_timeout,
)
from harness.placement import BACKENDS, DEVICES, Launch
from harness.strategies import STRATEGIES as STRATEGY_SPECS

DTYPES: dict[str, torch.dtype] = {"float64": torch.float64, "float32": torch.float32}


def add_dtype_flag(parser, what: str) -> None:
    """``--dtype``, as every entry point spells it: ``what`` says what takes the type."""
    parser.add_argument("--dtype", default="float64", metavar="|".join(DTYPES),
                        help=f"{what}; float64 makes verdicts exact to ~1e-12 "
                             "(default: float64)")


def add_timeout_flag(parser, what: str) -> None:
    """``--timeout``, as every entry point spells it: ``what`` is what may wait."""
    parser.add_argument("--timeout", default="300", metavar="SECONDS",
                        help=f"how long {what} may wait before the run fails instead of "
                             f"hanging (at most {MAX_TIMEOUT_S:g}, a day; default: 300)")


#: Strategies the harness can run (harness/strategies), each with its one-line description.
STRATEGIES: dict[str, str] = {name: spec.description for name, spec in STRATEGY_SPECS.items()}

MATRICES = ("default", "full")
#: Field metadata of settings that cannot change a measured number (where results go,
#: how the run talks): left out of the resume fingerprint and of a run's "settings".
NOT_RESULTS = {"results": False}


@dataclass(frozen=True)
class RunConfig:
    """What to measure and where to write it."""

    #: Studies to run, in order (names from ``--list``).
    studies: tuple[str, ...]
    #: Studies the harness knows; filled in by the CLI from the registry.
    known_studies: tuple[str, ...] = field(metadata=NOT_RESULTS)
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
    out: Path = field(default=Path("results"), metadata=NOT_RESULTS)
    #: Seed of every batch and initial weight; the same seed gives the same numbers.
    seed: int = 0
    #: Size of every study's matrix: 'default' is the committed run's (each study
    #: varies one group of axes at a time, a few sizes), 'full' measures every combination.
    matrix: str = "default"
    #: Seconds a collective may wait before the run fails instead of hanging.
    timeout: float = field(default=300.0, metadata=NOT_RESULTS)
    #: Reuse the finished cases of an interrupted run in ``out`` instead of recomputing them.
    resume: bool = field(default=False, metadata=NOT_RESULTS)
    #: No progress bar and no summary table.
    quiet: bool = field(default=False, metadata=NOT_RESULTS)
    #: Write REPORT.md and its plots at the end of the run.
    report: bool = field(default=True, metadata=NOT_RESULTS)
    #: The studies were named (--studies), not the default run's: a named study without a
    #: case is refused; a default one is left out, with a line saying so.
    studies_named: bool = field(default=True, metadata=NOT_RESULTS)
    #: Each selected study's own settings, by study name (see harness/studies/*/study.py).
    study_options: Mapping[str, StudyOptions] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.studies:
            raise UsageError("--studies is empty; allowed: " + ", ".join(self.known_studies))
        check_known("--studies", self.studies, self.known_studies)
        if len(set(self.studies)) != len(self.studies):
            raise UsageError(f"--studies {','.join(self.studies)} repeats a study")
        if not self.strategies:
            raise UsageError("--strategies is empty; allowed: " + ", ".join(STRATEGIES))
        check_known("--strategies", self.strategies, tuple(STRATEGIES))
        if self.world_sizes:
            check_positive_unique("--world-sizes", self.world_sizes)
        check_known("--backend", [self.backend], BACKENDS)
        check_known("--device", [self.device], DEVICES)
        check_known("--dtype", [self.dtype], tuple(DTYPES))
        check_known("--matrix", [self.matrix], MATRICES)
        check_timeout(self.timeout)
        check_seed(self.seed)

    def options_of(self, study: str) -> StudyOptions | None:
        return self.study_options.get(study)

    def results_settings(self) -> dict[str, Any]:
        """Every setting that can change a measured number, JSON-ready: the resume
        fingerprint hashes exactly these, so a new setting is covered the day it is added."""
        settings: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)
                                    if f.metadata.get("results", True)
                                    and f.name != "study_options"}
        settings["study_options"] = {name: options.as_dict()
                                     for name, options in self.study_options.items()}
        return settings

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
                    f"(or launch more ranks: --nproc, or torchrun --nproc_per_node)")
        return tuple(sorted(self.world_sizes))
