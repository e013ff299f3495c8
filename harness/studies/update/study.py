"""The update study: from ``param.grad`` to the optimizer step.

Every other study stops at ``param.grad``. This one compares the *parameters
after the optimizer step* with one process training on the big batch (every
sample of the step, mean loss), in the run's dtype (float64 by default):

- ``lr-factor``: each loss recipe (``mean``, ``sum``, Goyal's ``sum/b`` and
  ``sum/(N*k*b)``; with accumulation ``mean/k`` under DDP's ``no_sync``) x each
  optimizer (SGD, momentum, Nesterov, three kinds of weight decay, Adam and
  AdamW with default and large eps), T steps; which learning-rate factor, if
  any, makes the run equal the big batch's (lr_factor.py);
- ``clipping``: ``clip_grad_norm_`` per window vs per micro-step, after vs
  before DDP's reduction, FSDP2's total norm over shards vs each rank's local
  shard; the coefficient each applied and the error it caused (clipping.py);
- ``grad-scaler`` and ``non-finite``: GradScaler with accumulation, and a
  non-finite input on one rank skipping the whole step everywhere (amp.py);
- ``bf16-accumulation``: the error of bf16 against fp32 gradients as k grows (amp.py);
- ``linear-scaling``: Goyal's rule, one step at lr*N against N steps at lr,
  over a sweep of learning rates, at the start and later in training
  (linear_scaling.py);
- ``momentum-correction``: momentum SGD with lr inside the velocity (Goyal's form),
  with and without their correction at an lr change, against torch.optim.SGD,
  which keeps lr outside (momentum.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.context import RunContext
from harness.errors import UsageError
from harness.options import StudyOptions, option, parse_float_list, parse_int
from harness.strategies import STRATEGIES as SPECS
from harness.strategies import row_device, unavailable_reason
from harness.studies.base import Case, Study
from harness.studies.update import amp, clipping, linear_scaling, lr_factor, momentum
from harness.studies.update.recipes import MICRO_BATCH
from harness.studies.update.schema import COLUMNS, blank_row
from harness.studies.update.training import ReferenceRuns

STRATEGIES = ("local", "ddp", "fsdp", "dp-emulated", "dp")
#: The strategies of the GradScaler experiments: one process, and DDP's reduction.
SCALER_STRATEGIES = ("local", "ddp")
#: The strategy of the single-process experiments (bf16, linear scaling, momentum).
ONE_PROCESS = ("local",)

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
    name = "update"
    any_slot = True
    summary = ("parameters after the optimizer step vs the big batch: loss recipes x "
               "optimizers, the learning-rate factor that fixes them, clipping, GradScaler, "
               "bf16 accumulation, the linear scaling rule")
    example = ("torchrun --standalone --nproc_per_node=4 scripts/study.py --studies update "
               "--update-steps 5 --update-accum-steps 4")
    Options = UpdateOptions
    columns = COLUMNS
    in_default_run = True

    def __init__(self, options: UpdateOptions | None = None) -> None:
        super().__init__(options)
        #: Big-batch runs computed by this process, shared by the cases that compare with them.
        self._references = ReferenceRuns()

    # ------------------------------------------------------------------ cases
    def cases(self, run: RunContext) -> list[Case]:
        """The default matrix keeps DDP/FSDP cases few: one optimizer step per batch at every
        world size for DDP, everything else at the widest only; the full one, every size."""
        full = run.config.matrix == "full"
        sizes = _device_counts(run, full)
        wide = sizes if full else [max(run.world_sizes)]
        k = self.options.accum_steps
        strategies = run.strategies(STRATEGIES)
        cases = [self._case("lr-factor", strategy, n, steps) for strategy in strategies
                 for n, steps in _lr_factor_grid(strategy, sizes, wide, k)]
        cases += [self._case("clipping", strategy, n, steps)
                  for strategy, n, steps in _clipping_grid(strategies, wide, k)]
        cases += [self._case(experiment, strategy, n, k)
                  for experiment in ("grad-scaler", "non-finite")
                  for strategy in run.strategies(SCALER_STRATEGIES)
                  for n in ([1] if SPECS[strategy].reference else wide)]
        for strategy in run.strategies(ONE_PROCESS):
            ks = amp.BF16_STEPS["full" if full else "default"]
            cases.append(self._case("bf16-accumulation", strategy, 1, f"{min(ks)}..{max(ks)}"))
            cases += [self._case("linear-scaling", strategy, n, 1) for n in sizes if n >= 2]
            if max(sizes) >= 2:
                cases.append(self._case("momentum-correction", strategy, max(sizes), 1))
        return cases

    def _case(self, experiment: str, strategy: str, world_size: int, accum_steps: int | str
              ) -> Case:
        """One case; ``accum_steps`` is text for bf16-accumulation, whose rows sweep k."""
        collective = SPECS[strategy].collective
        micro_steps = accum_steps if isinstance(accum_steps, int) else 1
        cost = EXPERIMENTS[experiment].cost_ms * micro_steps * (1 + 0.25 * world_size)
        return Case.of(self.name, participants=world_size if collective else 1,
                       collective=collective, cost=cost, experiment=experiment,
                       strategy=strategy, world_size=world_size, accum_steps=accum_steps)

    # ---------------------------------------------------------------- measure
    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        strategy, n = case["strategy"], case["world_size"]
        reports = run.reports(case)
        if reason := unavailable_reason(strategy, n, run):
            return [self._row(case, {"status": reason})] if reports else None
        rows = EXPERIMENTS[case["experiment"]].measure(self, case, run, reports)
        if rows is None:
            return None
        return [self._row(case, row) for row in rows]

    def _lr_factor(self, case: Case, run: RunContext, reports: bool) -> MeasuredRows:
        return lr_factor.run(case["strategy"], case["world_size"], case["accum_steps"],
                             self.options.steps, run.config.matrix == "full", run, reports,
                             self._references)

    def _clipping(self, case: Case, run: RunContext, reports: bool) -> MeasuredRows:
        return clipping.run(case["strategy"], case["world_size"], case["accum_steps"],
                            self.options.steps, run, reports, self._references)

    def _grad_scaler(self, case: Case, run: RunContext, reports: bool) -> MeasuredRows:
        return amp.grad_scaler(case["strategy"], case["world_size"], case["accum_steps"],
                               self.options.steps, run, reports, self._references)

    def _non_finite(self, case: Case, run: RunContext, reports: bool) -> MeasuredRows:
        return amp.non_finite(case["strategy"], case["world_size"], case["accum_steps"], run,
                              reports)

    def _bf16(self, case: Case, run: RunContext, reports: bool) -> MeasuredRows:
        return amp.bf16_accumulation(run.config.matrix == "full", run)

    def _linear_scaling(self, case: Case, run: RunContext, reports: bool) -> MeasuredRows:
        # Early training over 2W windows is the costly part: the widest N alone by default.
        n = case["world_size"]
        early = run.config.matrix == "full" or n == max(run.world_sizes)
        return linear_scaling.run(n, self.options.lrs, run, early)

    def _momentum(self, case: Case, run: RunContext, reports: bool) -> MeasuredRows:
        return momentum.run(case["world_size"], self.options.steps, run)

    @staticmethod
    def _row(case: Case, measured: dict[str, Any]) -> dict[str, Any]:
        strategy = case["strategy"]
        row: dict[str, Any] = blank_row()
        row.update(experiment=case["experiment"], strategy=strategy,
                   emulated=SPECS[strategy].emulated, world_size=case["world_size"],
                   accum_steps=case["accum_steps"], micro_batch=MICRO_BATCH, status="ok")
        row.update(measured)
        row.setdefault("device", row_device(strategy))
        return row

    def summary_table(self, frame) -> str:
        shown = frame[(frame.experiment == "lr-factor") & (frame.status == "ok")
                      & (frame.world_size == frame.world_size.max())]
        if shown.empty:
            return "no lr-factor rows measured"
        table = shown.pivot_table(index=["strategy", "accum_steps", "loss"], columns="optimizer",
                                  values="lr_factor_verdict", aggfunc="first", sort=False)
        return ("learning-rate factor that gives the big-batch update, at the widest world "
                "size (exact / approximate / none):\n" + table.to_string())


def _device_counts(run: RunContext, full: bool) -> list[int]:
    """World sizes of the multi-device recipes: every one of the run in the full matrix;
    in the default one those >= 2 (one device is the big batch itself), or 1 if none is."""
    if full:
        return list(run.world_sizes)
    return [n for n in run.world_sizes if n >= 2] or [1]


def _lr_factor_grid(strategy: str, sizes: list[int], accumulating: list[int], k: int
                    ) -> list[tuple[int, int]]:
    """(world size, k) pairs of a strategy's lr-factor cases: one optimizer step per batch
    at every world size; k-step accumulation at the widest (every size in the full matrix).
    A sharded strategy's cases (FSDP) are the costliest: the widest sizes only, unless the
    matrix is full."""
    spec = SPECS[strategy]
    if spec.reference:
        return [(1, k)]
    single = accumulating if spec.sharded else sizes
    return [(n, 1) for n in single] + [(n, k) for n in accumulating]


def _clipping_grid(strategies: list[str], sizes: list[int], k: int
                   ) -> list[tuple[str, int, int]]:
    """One process clips k micro-steps; DDP and FSDP, one micro-step per step on N ranks.
    The strategies are those ``clipping.SETTINGS`` knows where to clip for."""
    return [(s, 1, k) if SPECS[s].reference else (s, n, 1)
            for s in strategies if s in clipping.SETTINGS
            for n in ([1] if SPECS[s].reference else sizes)]


MeasuredRows = list[dict[str, Any]] | None


@dataclass(frozen=True)
class Experiment:
    """One question of the study: how to measure a case of it, and its rough cost."""

    measure: Callable[[UpdateStudy, Case, RunContext, bool], MeasuredRows]
    #: Rough milliseconds per micro-step, for spreading single-process cases over idle ranks.
    cost_ms: float


#: The experiments, in the order the ``experiment`` column documents them.
EXPERIMENTS = {
    "lr-factor": Experiment(UpdateStudy._lr_factor, 60.0),
    "clipping": Experiment(UpdateStudy._clipping, 10.0),
    "grad-scaler": Experiment(UpdateStudy._grad_scaler, 10.0),
    "non-finite": Experiment(UpdateStudy._non_finite, 5.0),
    "bf16-accumulation": Experiment(UpdateStudy._bf16, 60.0),
    "linear-scaling": Experiment(UpdateStudy._linear_scaling, 30.0),
    "momentum-correction": Experiment(UpdateStudy._momentum, 5.0),
}
