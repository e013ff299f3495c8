"""The update study: from ``param.grad`` to the optimizer step.

Every other study stops at ``param.grad``. This one compares the *parameters
after the optimizer step* with one process training on the big batch (every
sample of the step, mean loss), in the run's dtype (float64 by default), in
several experiments: the learning-rate factor that restores a recipe's update,
where clipping runs, GradScaler with accumulation and a non-finite input, bf16
accumulation, Goyal's linear scaling rule and momentum correction.

Each experiment is a plug-in (``experiment.py``, registered in ``experiments/``):
its name, its CSV's columns, its grid of cases, its measuring code and its report
parts. The study iterates the registry; each experiment's rows go to its own CSV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harness.context import RunContext
from harness.errors import UsageError
from harness.options import StudyOptions, option, parse_float_list, parse_int
from harness.strategies import STRATEGIES as SPECS
from harness.strategies import row_device, unavailable_reason
from harness.studies.base import Case, Study
from harness.studies.schema import Table
from harness.studies.update import experiments
from harness.studies.update.experiment import STUDY, Experiment, Grid, Trial
from harness.studies.update.training import ReferenceRuns

if TYPE_CHECKING:
    import pandas as pd

#: Every strategy some experiment measures, in the order the CSVs list them.
STRATEGIES = ("local", "ddp", "fsdp", "dp-emulated", "dp")

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


class UpdateStudy(Study):
    name = STUDY
    any_slot = True
    summary = ("parameters after the optimizer step vs the big batch: loss recipes x "
               "optimizers, the learning-rate factor that fixes them, clipping, GradScaler, "
               "bf16 accumulation, the linear scaling rule")
    example = ("torchrun --standalone --nproc_per_node=4 scripts/study.py --studies update "
               "--update-steps 5 --update-accum-steps 4")
    Options = UpdateOptions

    def __init__(self, options: UpdateOptions | None = None) -> None:
        super().__init__(options)
        #: Big-batch runs computed by this process, shared by the cases that compare with them.
        self._references = ReferenceRuns()

    @classmethod
    def tables(cls) -> tuple[Table, ...]:
        """One CSV per experiment, in the registry's order."""
        return tuple(experiment.table for experiment in experiments.EXPERIMENTS)

    def table_of(self, case: Case) -> Table:
        return experiments.experiment_named(case["experiment"]).table

    # ------------------------------------------------------------------ cases
    def cases(self, run: RunContext) -> list[Case]:
        """Every registered experiment's cases, in turn. The default matrix keeps DDP/FSDP
        cases few (see each experiment's grid); the full one measures every world size."""
        offered = _grid(run, self.options.accum_steps)
        return [self._case(experiment, coordinates) for experiment in experiments.EXPERIMENTS
                for coordinates in experiment.grid(offered)]

    def _case(self, experiment: Experiment, coordinates: dict[str, Any]) -> Case:
        strategy, n = coordinates["strategy"], coordinates["world_size"]
        collective = SPECS[strategy].collective
        return Case.of(self.name, participants=n if collective else 1, collective=collective,
                       cost=experiment.cost(coordinates), experiment=experiment.name,
                       **coordinates)

    # ---------------------------------------------------------------- measure
    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        experiment = experiments.experiment_named(case["experiment"])
        coordinates = {axis: value for axis, value in case.spec if axis != "experiment"}
        # Where the strategy computes; a row may say otherwise (single-process ones: the CPU).
        where = {"device": row_device(case["strategy"])}
        if reason := unavailable_reason(case["strategy"], case["world_size"], run):
            unmeasured = experiment.unmeasured(coordinates, reason)
            return [{**unmeasured, **where}] if run.reports(case) else None
        rows = experiment.measure(Trial(case, run, self.options, self._references))
        if rows is None:
            return None
        return [{**coordinates, **where, **row} for row in rows]

    def table_summary(self, table: Table, frame: pd.DataFrame) -> str:
        experiment = next(e for e in experiments.EXPERIMENTS if e.table == table)
        return experiment.summary(frame) if experiment.summary else self.summary_table(frame)


def _grid(run: RunContext, accum_steps: int) -> Grid:
    """What this run offers the experiments: its strategies among the study's, its world
    sizes, k and its matrix."""
    return Grid(strategies=tuple(run.strategies(STRATEGIES)), world_sizes=tuple(run.world_sizes),
                accum_steps=accum_steps, full=run.config.matrix == "full")
