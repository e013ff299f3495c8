"""The settings of one ``check.py`` run, as a dataclass that refuses bad values itself."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.check.outcome import DEFAULT_FAIL_ON, FAIL_ON
from harness.config import DTYPES
from harness.errors import UsageError
from harness.options import check_known, check_positive_unique, check_timeout
from harness.strategies import STRATEGIES

#: Strategies a check runs, in the order rows appear: those whose spec names a check case.
CHECK_STRATEGIES = {spec.name: spec.check_description for spec in STRATEGIES.values()
                    if spec.check_case}
#: Micro-steps beyond this would only make a check slow; no real recipe needs more.
MAX_ACCUM_STEPS = 64
CSV_NAME = "check.csv"


@dataclass(frozen=True)
class CheckConfig:
    #: ``module.path:factory`` of each setup to check, in this order.
    targets: tuple[str, ...]
    accum_steps: tuple[int, ...] = (1, 2)
    strategies: tuple[str, ...] = tuple(CHECK_STRATEGIES)
    #: Empty: every world size 1..N of the launch.
    world_sizes: tuple[int, ...] = ()
    dtype: str = "float64"
    out: Path = Path("check-results")
    drop_last: bool = False
    quiet: bool = False
    #: Seconds a collective inside a case may wait before the run fails instead of hanging.
    timeout: float = 300.0
    #: The verdicts that make the run exit 1 (see harness/check/outcome.py).
    fail_on: str = DEFAULT_FAIL_ON

    def __post_init__(self) -> None:
        # Absolute before any user code runs: a factory may change the working folder.
        object.__setattr__(self, "out", Path(os.path.abspath(self.out)))
        for target in self.targets:
            if ":" not in target:
                raise UsageError(f"{target!r} names no factory; allowed: module.path:factory, "
                                 "e.g. examples.mlp:make_setup")
        check_positive_unique("--accum-steps", self.accum_steps, MAX_ACCUM_STEPS)
        if not self.strategies:
            raise UsageError("--strategies is empty; allowed: "
                             + ", ".join(CHECK_STRATEGIES))
        check_known("--strategies", self.strategies, tuple(CHECK_STRATEGIES))
        if len(set(self.strategies)) != len(self.strategies):
            raise UsageError(f"--strategies: {','.join(self.strategies)} repeats a value; "
                             "give each strategy once")
        if self.world_sizes:
            check_positive_unique("--world-sizes", self.world_sizes)
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype {self.dtype!r} is unknown; allowed: {', '.join(DTYPES)}")
        check_timeout(self.timeout)
        check_known("--fail-on", [self.fail_on], tuple(FAIL_ON))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolved_world_sizes(self, launched: int) -> tuple[int, ...]:
        """The world sizes to measure in a launch of ``launched`` ranks."""
        sizes = self.world_sizes or tuple(range(1, launched + 1))
        for size in sizes:
            if size > launched:
                raise UsageError(f"--world-sizes: {size} is more than the {launched} rank(s) "
                                 f"launched; allowed: 1..{launched} (or launch more ranks)")
        return tuple(sorted(sizes))
