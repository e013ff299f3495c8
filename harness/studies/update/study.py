"""The update study: from ``param.grad`` to the optimizer step.

Every other study stops at ``param.grad``. This one compares the *parameters
after the optimizer step* with one process training on the big batch (every
sample of the step, mean loss), in the run's dtype (float64 by default), in
several experiments: the learning-rate factor that restores a recipe's update,
where clipping runs, GradScaler with accumulation and a non-finite input, bf16
accumulation, Goyal's linear scaling rule and momentum correction.

Each experiment is a plug-in (``experiment.py``), a module of ``experiments/`` registered
there: its name, its CSV's columns, its grid of cases, its ``measure`` and its report
parts. The study iterates the registry; each experiment's rows go to its own CSV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.context import RunContext
from harness.strategies import STRATEGIES as SPECS
from harness.strategies import row_device, unavailable_reason
from harness.studies.base import Case, Study
from harness.studies.schema import Table
from harness.studies.update import experiments
from harness.studies.update.experiment import STUDY, Experiment, Grid
from harness.studies.update.options import UpdateOptions
from harness.studies.update.trial import ReferenceRuns, Trial

if TYPE_CHECKING:
    import pandas as pd

#: Every strategy some experiment measures, in the order the CSVs list them.
STRATEGIES = ("local", "ddp", "fsdp", "dp-emulated", "dp")


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
