"""The accumulation study: does my accumulation recipe equal big-batch training?

A case trains for ``WINDOWS`` optimizer steps; each step accumulates k
micro-steps, each micro-step feeds every device one shard. At the last step,
the gradient in ``param.grad`` is fitted against the *big-batch* gradient: one
process, the same weights, every sample of that window (all micro-steps of all
devices) in one batch, loss = mean over all its elements (samples or tokens).

Axes of a case (a row; which combinations run: recipes.py):

- ``zero_grad``: ``never`` (seed 000/001's bug: gradients of earlier steps stay),
  ``every-micro-step`` (only the last micro-batch survives), ``every-step``
  (zero after each optimizer step: the textbook recipe);
- ``loss_scaling``: ``none`` (k micro-batch means summed: k times too large) or ``1/k``;
- ``sync``: DDP all-reducing at ``every-micro-step`` or under ``no_sync`` for the
  first k-1 micro-steps; DataParallel reduces at ``every-micro-step`` (it has no
  ``no_sync``); one process has nothing to reduce (``none``);
- ``norm``: none, BatchNorm, GroupNorm (SyncBatchNorm on CUDA under DDP);
- ``shards``: ``even`` (4 samples per device per micro-step), ``uneven`` (2..6,
  varying per device and micro-step), ``tokens`` (4 sequences of 1..6 tokens);
- ``loss_normalization``: ``micro-batch-mean`` (each micro-batch's loss is the mean
  over its own elements) or ``window-total`` (the sum over the micro-batch divided
  by the element count of the whole window on all devices, times DDP's world size
  to undo its averaging: the re-weighting that makes uneven batches exact).

Two windows per case, because ``never`` only differs from ``every-step`` once a
previous step has left gradients behind. ``cumulative_scale`` fits the gradient
against the sum of the big-batch gradients of *all* windows so far: that is what
a never-zeroed gradient grows into.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from harness.context import RunContext
from harness.fit import ScaleFit, equivalence_verdict, fit_scale, relative_error
from harness.options import StudyOptions, check_positive_unique, option, parse_int_list
from harness.seeding import generator_for
from harness.strategies import STRATEGIES, row_device, step_cost, unavailable_reason
from harness.strategies.common import StrategyTrainer, relative_spread
from harness.strategies.ddp import DDPTrainer
from harness.strategies.dp import DPTrainer
from harness.strategies.dp_emulated import EmulatedDPTrainer
from harness.strategies.local import local_gradient
from harness.studies.accumulation.recipes import SUPPORTED, Recipe, matrix, world_sizes
from harness.studies.accumulation.schema import COLUMNS
from harness.studies.base import Case, Study, named_multiple
from harness.tasks import Batch, Task, task_by_name
from harness.verdicts import Equivalence

#: Optimizer steps per case; the gradient of the last one is measured.
WINDOWS = 2
#: Plain SGD between windows, so the second window starts from new weights.
LEARNING_RATE = 0.05
#: Samples (or sequences) per device per micro-step with even shards.
MICRO_BATCH = 4
#: Inclusive range of samples per device per micro-step with uneven shards
#: (from 2: BatchNorm cannot normalise a batch of one sample).
UNEVEN_SIZES = (2, 6)

#: More micro-steps than this only cost time: every verdict shows by k = 8.
MAX_ACCUM_STEPS = 64


@dataclass(frozen=True)
class AccumulationOptions(StudyOptions):
    #: Accumulation steps k measured (micro-steps per optimizer step).
    accum_steps: tuple[int, ...] = field(default=(1, 2, 4, 8), metadata=option(
        "--accum-steps", "K[,K]", "accumulation steps k of the accumulation study",
        parse=parse_int_list))

    def __post_init__(self) -> None:
        check_positive_unique("--accum-steps", self.accum_steps, MAX_ACCUM_STEPS)


def window_data(recipe: Recipe, task: Task, seed: int, dtype: torch.dtype
                ) -> list[list[list[Batch]]]:
    """[window][micro-step][device slot] shards, the same for every recipe of a
    (shards, world size, k): recipes are compared on identical samples."""
    generator = generator_for(seed, "accumulation-data", recipe.shards, recipe.world_size,
                              recipe.accum_steps)
    low, high = UNEVEN_SIZES

    def size() -> int:
        if recipe.shards == "uneven":
            return int(torch.randint(low, high + 1, (1,), generator=generator))
        return MICRO_BATCH

    return [[[task.make_shard(size(), slot, generator, dtype)
              for slot in range(recipe.world_size)]
             for _ in range(recipe.accum_steps)]
            for _ in range(WINDOWS)]


def _state_on_cpu(module: nn.Module) -> dict[str, torch.Tensor]:
    """Weights and buffers at the start of a window (a copy: the window changes them)."""
    return {name: t.detach().cpu().clone() for name, t in module.state_dict().items()}


def micro_step_loss(recipe: Recipe, task: Task, output: torch.Tensor, batch: Batch,
                    window_elements: int, average_divisor: int) -> torch.Tensor:
    if recipe.loss_normalization == "micro-batch-mean":
        loss = task.loss(output, batch, "mean")
    else:
        loss = task.loss(output, batch, "sum") * (average_divisor / window_elements)
    return loss * recipe.scale


@dataclass
class WindowResult:
    """What rank 0 keeps of one optimizer step."""

    grads: list[torch.Tensor] | None
    big_batch_grad: torch.Tensor | None
    elements: int


class AccumulationStudy(Study):
    name = "accumulation"
    any_slot = True
    summary = ("accumulation recipes (zero_grad, loss/k, no_sync, norm layers, uneven and "
               "token batches) against the big-batch gradient, with all-reduce counts")
    example = ("torchrun --standalone --nproc_per_node=4 scripts/study.py --studies accumulation "
               "--accum-steps 1,4 --matrix full")
    Options = AccumulationOptions
    columns = COLUMNS

    def __init__(self, options: AccumulationOptions | None = None) -> None:
        super().__init__(options)
        #: Collective trainers by (strategy, world size, task): wrapped once, reset between
        #: cases.
        self._collective_trainers: dict[tuple[str, int, str], StrategyTrainer] = {}

    def cases(self, run: RunContext) -> list[Case]:
        full = run.config.matrix == "full"
        return [Case.of(self.name, participants=STRATEGIES[strategy].participants(n),
                        collective=STRATEGIES[strategy].collective,
                        cost=WINDOWS * k * step_cost(strategy, n), **asdict(recipe))
                for strategy in run.strategies(SUPPORTED)
                for n in world_sizes(strategy, run)
                for k in self.options.accum_steps
                for recipe in matrix(strategy, n, k, full)]

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        recipe = Recipe(**case.params)
        reports = run.reports(case)
        if reason := self._unavailable(recipe, run):
            return [self._row(recipe, {"status": reason})] if reports else None
        task = task_by_name(recipe.task_name)
        data = window_data(recipe, task, run.seed, run.dtype)
        trainer = self._trainer(recipe, task, run)
        if reason := self._unbatchable(recipe, trainer, data):
            return [self._row(recipe, {"status": reason})] if reports else None
        windows = [self._train_window(recipe, task, trainer, shards, reports,
                                      last=w == WINDOWS - 1)
                   for w, shards in enumerate(data)]
        if not reports:
            return None
        measured = self._measurements(windows, trainer, run.rtol)
        return [self._row(recipe, {**measured, **multiples(measured, recipe.accum_steps,
                                                           run.rtol)})]

    # ------------------------------------------------------------ set-up
    @staticmethod
    def _unavailable(recipe: Recipe, run: RunContext) -> str | None:
        if reason := unavailable_reason(recipe.strategy, recipe.world_size, run):
            return reason
        if recipe.norm == "syncbatchnorm" and not torch.cuda.is_available():
            return "skipped: SyncBatchNorm needs CUDA devices"
        return None

    @staticmethod
    def _unbatchable(recipe: Recipe, trainer: StrategyTrainer, data) -> str | None:
        """DataParallel's scatter can hand a replica one sample, which BatchNorm refuses."""
        if "batchnorm" not in recipe.norm:
            return None
        for micro_steps in data:
            for shards in micro_steps:
                sizes = trainer.chunk_sizes(Batch.cat(shards))
                if min(sizes) < 2:
                    return ("skipped: DataParallel gave a replica 1 sample (chunk sizes "
                            f"{';'.join(map(str, sizes))}); BatchNorm cannot normalise it")
        return None

    def _trainer(self, recipe: Recipe, task: Task, run: RunContext) -> StrategyTrainer:
        initial = self._initial_model(recipe, task, run)
        spec = STRATEGIES[recipe.strategy]
        if not spec.collective:
            return spec.trainer(initial, recipe.world_size, run)
        # Collective trainers are built once per (strategy, world size, model) and reset:
        # their constructor is a collective of its own (a broadcast and a shape check).
        key = (recipe.strategy, recipe.world_size, recipe.task_name)
        if key not in self._collective_trainers:
            module = copy.deepcopy(initial)
            if recipe.norm == "syncbatchnorm":
                # Synchronise statistics over the case's subgroup, not the whole launch.
                module.norm.process_group = run.group(recipe.world_size)
            self._collective_trainers[key] = spec.trainer(module, recipe.world_size, run)
        trainer = self._collective_trainers[key]
        trainer.reset(initial.state_dict())
        return trainer

    @staticmethod
    def _initial_model(recipe: Recipe, task: Task, run: RunContext) -> nn.Module:
        """The same initial weights for every case of a task, whatever the strategy."""
        return task.build_model(generator_for(run.seed, "accumulation-model", recipe.task_name),
                                run.dtype)

    # ------------------------------------------------------------ training
    def _train_window(self, recipe: Recipe, task: Task, trainer: StrategyTrainer,
                      micro_steps: list[list[Batch]], reports: bool, last: bool
                      ) -> WindowResult:
        """k micro-steps and one optimizer step; the reporting rank keeps the gradient
        and its big-batch reference."""
        elements = sum(shard.elements for shards in micro_steps for shard in shards)
        start = _state_on_cpu(trainer.module) if reports else None
        optimizer = torch.optim.SGD(trainer.module.parameters(), lr=LEARNING_RATE)
        trainer.allreduce.reset()
        trainer.reduce_add.reset()
        for i, shards in enumerate(micro_steps):
            if recipe.zero_grad == "every-micro-step":
                optimizer.zero_grad(set_to_none=True)
            skip_sync = recipe.sync == "no_sync" and i < len(micro_steps) - 1
            batch = trainer.batch_for_this_process(shards)
            with trainer.no_sync() if skip_sync else contextlib.nullcontext():
                output = trainer.forward(batch.x)
                micro_step_loss(recipe, task, output, batch, elements,
                                trainer.average_divisor).backward()
            trainer.after_backward()
        grads = trainer.grads_of_every_rank() if last else None
        big_batch = self._big_batch_gradient(recipe, start, micro_steps) if start else None
        optimizer.step()
        if recipe.zero_grad == "every-step":
            optimizer.zero_grad(set_to_none=True)
        return WindowResult(grads, big_batch, elements)

    @staticmethod
    def _big_batch_gradient(recipe: Recipe, start: dict[str, torch.Tensor],
                            micro_steps: list[list[Batch]]) -> torch.Tensor:
        """One process, the window's weights, every sample of the window in one batch."""
        reference_task = task_by_name(recipe.reference_task_name)
        model = reference_task.build_model(torch.Generator(), start["hidden.weight"].dtype)
        model.load_state_dict(start)
        every_shard = [shard for shards in micro_steps for shard in shards]
        return local_gradient(reference_task, model, [Batch.cat(every_shard)], "mean")

    # ------------------------------------------------------------ results
    @staticmethod
    def _measurements(windows: list[WindowResult], trainer: StrategyTrainer, rtol: float
                      ) -> dict[str, Any]:
        last = windows[-1]
        grad = last.grads[0]
        fit = fit_scale(grad, last.big_batch_grad)
        cumulative = fit_scale(grad, torch.stack([w.big_batch_grad for w in windows]).sum(0))
        is_ddp = isinstance(trainer, DDPTrainer)
        is_dp = isinstance(trainer, EmulatedDPTrainer | DPTrainer)
        return {
            "window_elements": last.elements,
            "allreduce_calls": trainer.allreduce.calls if is_ddp else math.nan,
            "allreduce_bytes": trainer.allreduce.bytes if is_ddp else math.nan,
            "reduce_add_calls": trainer.reduce_add.calls if is_dp else math.nan,
            "reduce_add_bytes": trainer.reduce_add.bytes if is_dp else math.nan,
            "full_batch_scale": fit.scale, "fit_residual": fit.residual,
            "relative_error": relative_error(grad, last.big_batch_grad),
            "cumulative_scale": cumulative.scale, "cumulative_residual": cumulative.residual,
            "verdict": equivalence_verdict(fit, rtol),
            "rank_spread": relative_spread(grad, last.grads),
            "status": "ok",
        }

    @staticmethod
    def _row(recipe: Recipe, measured: dict[str, Any]) -> dict[str, Any]:
        numbers = ("window_elements", "allreduce_calls", "allreduce_bytes", "reduce_add_calls",
                   "reduce_add_bytes", "full_batch_scale", "fit_residual", "relative_error",
                   "cumulative_scale", "cumulative_residual", "rank_spread")
        row = {**asdict(recipe), "emulated": STRATEGIES[recipe.strategy].emulated,
               "optimizer_steps": WINDOWS, **dict.fromkeys(numbers, math.nan), "verdict": "",
               "full_batch_multiple": "", "cumulative_verdict": "", "cumulative_multiple": ""}
        row.update(measured)
        row["device"] = row_device(recipe.strategy)
        return row

    def summary_table(self, frame) -> str:
        shown = frame[(frame.status == "ok") & (frame.norm == "none") & (frame.shards == "even")
                      & (frame.loss_normalization == "micro-batch-mean")]
        table = shown.pivot_table(index=["zero_grad", "loss_scaling"], columns="strategy",
                                  values="verdict",
                                  aggfunc=lambda v: "/".join(sorted(set(v))))
        return ("verdicts of the plain recipes over all world sizes and k (matches = equals the "
                "big batch):\n" + table.to_string())


def multiples(measured: dict[str, Any], k: int, rtol: float) -> dict[str, Any]:
    """The verdict on the cumulative fit, and the named multiples of k that the last step's
    and the cumulative scale equal (where their fit holds), from the measured fits."""
    cumulative = equivalence_verdict(ScaleFit(measured["cumulative_scale"],
                                              measured["cumulative_residual"]), rtol)
    return {"cumulative_verdict": cumulative,
            "full_batch_multiple": _multiple(measured["full_batch_scale"], measured["verdict"],
                                             k, rtol),
            "cumulative_multiple": _multiple(measured["cumulative_scale"], cumulative, k, rtol)}


def _multiple(scale: float, verdict: Equivalence, k: int, rtol: float) -> str:
    return "" if verdict == Equivalence.DIFFERS else named_multiple(scale, k, rtol, "k")
