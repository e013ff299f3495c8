"""The update study's own flags: T, k and the linear-scaling sweep's learning rates.

Free of torch: the experiments' trials name it, and ``--help`` lists it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from harness.errors import UsageError
from harness.options import StudyOptions, option, parse_float_list, parse_int

#: Small-batch learning rates of the linear-scaling sweep: from where the rule holds on
#: this model (1e-3) to where one step overshoots (1).
DEFAULT_LRS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
MAX_STEPS = 50
MAX_ACCUM_STEPS = 64


@dataclass(frozen=True)
class UpdateOptions(StudyOptions):
    #: Optimizer steps T each recipe trains before its parameters are compared.
    steps: int = field(default=5, metadata=option(
        "--update-steps", "T", "optimizer steps each run of the update study trains before "
        "it is compared with the big batch", parse=parse_int))
    #: Micro-steps k of the update study's accumulation recipes.
    accum_steps: int = field(default=4, metadata=option(
        "--update-accum-steps", "K", "micro-steps per optimizer step in the update study's "
        "accumulation recipes", parse=parse_int))
    #: Small-batch learning rates of the linear-scaling sweep.
    lrs: tuple[float, ...] = field(default=DEFAULT_LRS, metadata=option(
        "--update-lrs", "LR[,LR]", "learning rates of the update study's linear-scaling sweep",
        parse=parse_float_list))

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= MAX_STEPS:
            raise UsageError(f"--update-steps {self.steps} is not allowed; allowed: "
                             f"1..{MAX_STEPS}")
        if not 2 <= self.accum_steps <= MAX_ACCUM_STEPS:
            raise UsageError(f"--update-accum-steps {self.accum_steps} is not allowed; "
                             f"allowed: 2..{MAX_ACCUM_STEPS}")
        if not self.lrs:
            raise UsageError("--update-lrs is empty; give at least one learning rate")
        for lr in self.lrs:
            if not (math.isfinite(lr) and lr > 0):
                raise UsageError(f"--update-lrs: {lr} is not allowed; allowed: finite "
                                 "numbers > 0")
        if len(set(self.lrs)) != len(self.lrs):
            raise UsageError(f"--update-lrs: {','.join(map(str, self.lrs))} repeats a value; "
                             "give each value once")
