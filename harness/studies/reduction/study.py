"""The reduction study: summed or averaged across devices?

For every strategy, world size N, model and loss reduction, one global batch
(seeded, split into N equal shards) goes through one training step. What lands
in ``param.grad`` (g) is fitted against two references computed in one process:

- ``sum_r g_r``: each device's gradient of *its own shard alone*, same loss.
  ``rank_weight`` w in ``g ~ w * sum_r g_r``: 1/N means averaged, 1 summed;
- ``g_full``: the gradient of the whole global batch. ``full_batch_scale`` s in
  ``g ~ s * g_full``: 1 means "the same as single-device big-batch training".

A third fit, ``reduce_weight``, compares g with the sum of what each device
actually fed into the reduction (DDP: its local gradient; DataParallel: each
replica's gradient of the *gathered* loss), which isolates the collective itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.context import RunContext
from harness.errors import UsageError
from harness.fit import equivalence_verdict, fit_scale, reduction_verdict
from harness.options import StudyOptions, check_positive, option, parse_int
from harness.seeding import generator_for
from harness.strategies import (
    STRATEGIES,
    measure_step,
    row_device,
    step_cost,
    unavailable_reason,
)
from harness.strategies.common import StepMeasurement, StepSpec
from harness.strategies.local import local_gradient, per_device_gradients, running_stats_after
from harness.studies.base import Case, Study, named_multiple
from harness.studies.reduction.schema import COLUMNS
from harness.tasks import (
    LOSS_REDUCTIONS,
    Batch,
    LossInForward,
    Task,
    make_shards,
    task_by_name,
)
from harness.verdicts import Equivalence

#: The strategies this study runs, in row order.
SUPPORTED = ("ddp", "fsdp", "dp-emulated", "dp")
MODELS = ("toy", "mlp", "mlp-batchnorm", "loss-in-forward")
#: Beyond this a shard only costs time: the verdicts need a few samples per device.
MAX_SHARD_SIZE = 4096
#: The forward-returns-the-loss pitfall only exists where outputs are gathered.
DATAPARALLEL_ONLY_MODELS = ("loss-in-forward",)


@dataclass(frozen=True)
class ReductionOptions(StudyOptions):
    #: Samples per device in the global batch (N shards of this size).
    shard_size: int = field(default=4, metadata=option(
        "--shard-size", "INT", "samples per device in the reduction study's global batch",
        parse=parse_int))

    def __post_init__(self) -> None:
        check_positive("--shard-size", self.shard_size)
        if self.shard_size > MAX_SHARD_SIZE:
            raise UsageError(f"--shard-size {self.shard_size} is not allowed; allowed: "
                             f"1..{MAX_SHARD_SIZE} (a verdict needs a handful of samples)")


def _join(values) -> str:
    return ";".join(str(v) for v in values)


class ReductionStudy(Study):
    name = "reduction"
    any_slot = True
    summary = ("one step per strategy x world size x model x loss: is param.grad the sum "
               "or the mean over devices, and does it equal the big-batch gradient?")
    example = "torchrun --standalone --nproc_per_node=4 scripts/study.py --studies reduction"
    Options = ReductionOptions
    columns = COLUMNS

    def cases(self, run: RunContext) -> list[Case]:
        cases = []
        for strategy in run.strategies(SUPPORTED):
            spec = STRATEGIES[strategy]
            for n in run.world_sizes:
                for model in MODELS:
                    if model in DATAPARALLEL_ONLY_MODELS and spec.collective:
                        continue
                    for reduction in LOSS_REDUCTIONS:
                        cases.append(Case.of(
                            self.name, participants=spec.participants(n),
                            collective=spec.collective, cost=2 * step_cost(strategy, n),
                            strategy=strategy, world_size=n, model=model,
                            loss_reduction=reduction))
        return cases

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        strategy, n = case["strategy"], case["world_size"]
        spec = self._spec(case, run)
        shard_sizes = _join(len(s) for s in spec.shards)
        if reason := unavailable_reason(strategy, n, run):
            return [_skipped_row(case, shard_sizes, reason)]
        measurement = measure_step(strategy, spec, n, run)
        if measurement is None:
            return None
        return [{**_identity(case, shard_sizes), **_analyse(spec, measurement, run.rtol),
                 "status": "ok", "device": row_device(strategy)}]

    def _spec(self, case: Case, run: RunContext) -> StepSpec:
        """The same weights and batch for every strategy and loss of a (model, N) pair."""
        model_name, n = case["model"], case["world_size"]
        task_name = "mlp" if model_name == "loss-in-forward" else model_name
        task = task_by_name(task_name)
        generator = generator_for(run.seed, "reduction", task_name, n)
        model = task.build_model(generator, run.dtype)
        shards = make_shards(task, [self.options.shard_size] * n, generator, run.dtype)
        loss_in_forward = model_name == "loss-in-forward"
        if loss_in_forward:
            model = LossInForward(model, task)
        return StepSpec(task=task, model=model, shards=shards, reduction=case["loss_reduction"],
                        loss_in_forward=loss_in_forward)

    def summary_table(self, frame) -> str:
        table = frame[frame["status"] == "ok"].pivot_table(
            index=["strategy", "model", "loss_reduction"], columns="world_size",
            values="verdict", aggfunc="first")
        return "verdict (param.grad vs the sum of per-device gradients) by world size:\n" + \
            table.to_string()



def _identity(case: Case, shard_sizes: str) -> dict[str, Any]:
    return {"strategy": case["strategy"], "emulated": STRATEGIES[case["strategy"]].emulated,
            "world_size": case["world_size"], "model": case["model"],
            "loss_reduction": case["loss_reduction"], "shard_sizes": shard_sizes}


def _skipped_row(case: Case, shard_sizes: str, reason: str) -> dict[str, Any]:
    numbers = ("devices_used", "rank_weight", "rank_weight_residual", "full_batch_scale",
               "full_batch_residual", "fit_residual", "reduce_weight", "rank_spread",
               "running_stats_vs_full", "running_stats_vs_first_shard")
    return {**_identity(case, shard_sizes), **dict.fromkeys(numbers, math.nan),
            "chunk_sizes": "", "verdict": "", "full_batch_verdict": "", "reduce_op": "",
            "full_batch_multiple": "", "ranks_agree": None, "running_stats_from_first_shard": None,
            "status": reason,
            "device": row_device(case["strategy"])}


def _references(spec: StepSpec, chunks: list) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``g_r`` per device and ``g_full``, each device computing on the chunk it really got.

    With the loss inside forward, every device's own loss is the mean over its
    chunk, and a single device's loss is the mean over the whole batch.
    """
    task: Task = spec.task
    reduction = "mean" if spec.loss_in_forward else spec.reduction
    model = spec.model.model if spec.loss_in_forward else spec.model
    per_device = per_device_gradients(task, model, chunks, reduction)
    full = local_gradient(task, model, chunks, reduction)
    return per_device, full


def _running_stats_errors(spec: StepSpec, measured: dict, chunks: list) -> tuple[float, float]:
    if not measured:
        return math.nan, math.nan
    model = spec.model.model if spec.loss_in_forward else spec.model
    full = running_stats_after(model, chunks)
    first = running_stats_after(model, chunks[:1])
    return _buffer_distance(measured, full), _buffer_distance(measured, first)


def _buffer_distance(measured: dict, reference: dict) -> float:
    names = [n for n in measured if n.endswith(("running_mean", "running_var"))]
    if not names:
        return math.nan
    a = torch.cat([measured[n].reshape(-1).to(torch.float64) for n in names])
    b = torch.cat([reference[n].reshape(-1).to(torch.float64) for n in names])
    return float((a - b).norm() / b.norm())


def _analyse(spec: StepSpec, m: StepMeasurement, rtol: float) -> dict[str, Any]:
    chunks = _device_chunks(spec, m)
    per_device, full = _references(spec, chunks)
    grad = m.grads[0]
    weight = fit_scale(grad, torch.stack(per_device).sum(0))
    scale = fit_scale(grad, full)
    reduce = fit_scale(grad, torch.stack(m.contributions).sum(0))
    vs_full, vs_first = _running_stats_errors(spec, m.buffers, chunks)
    big_batch = equivalence_verdict(scale, rtol)
    return {
        "devices_used": m.devices_used, "chunk_sizes": _join(m.chunk_sizes),
        "rank_weight": weight.scale, "rank_weight_residual": weight.residual,
        "full_batch_scale": scale.scale, "full_batch_residual": scale.residual,
        "fit_residual": max(weight.residual, scale.residual),
        "verdict": reduction_verdict(weight, m.devices_used, rtol),
        "full_batch_verdict": big_batch,
        "reduce_weight": reduce.scale,
        "reduce_op": reduction_verdict(reduce, m.devices_used, rtol),
        "rank_spread": m.rank_spread,
        "running_stats_vs_full": vs_full, "running_stats_vs_first_shard": vs_first,
        "full_batch_multiple": "" if big_batch == Equivalence.DIFFERS
        else named_multiple(scale.scale, m.devices_used, rtol, "N"),
        "ranks_agree": within_tolerance(m.rank_spread, rtol),
        "running_stats_from_first_shard": within_tolerance(vs_first, rtol),
    }


def within_tolerance(distance: float, rtol: float) -> bool | None:
    """A distance judged against the tolerance; None (empty) where it was not measured."""
    return None if math.isnan(distance) else distance <= rtol


def _device_chunks(spec: StepSpec, m: StepMeasurement) -> list[Batch]:
    """The samples each device really computed on: DDP's shards, DataParallel's chunks."""
    return Batch.cat(spec.shards).split(m.chunk_sizes)
