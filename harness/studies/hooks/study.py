"""The hooks study: what the reduction variants people switch on do to the gradient.

Each case trains the 4-8-2 MLP for a few SGD steps (PowerSGD for more) under one variant
(:mod:`harness.studies.hooks.variants`: DDP comm hooks and options, ZeRO, FSDP2
divide factors and reduce dtypes) on the ranks 0..N-1, each rank on its own
shard of every step's batch, and writes one row per step. At every step,
rank 0 compares what the variant left in ``param.grad`` (g) with the exact
average ḡ = mean_r g_r of the ranks' gradients, each computed in float64 at the
replica's weights of that step: ḡ is the big-batch gradient (equal shards, mean
loss) and what DDP's default all-reduce computes.

- ``full_batch_scale`` s and ``fit_residual`` fit g ~ s * ḡ: a hook that forgets to
  divide gives s = N, one that divides twice s = 1/N;
- ``relative_error`` ‖g - ḡ‖ / ‖ḡ‖ is the compression error of a hook that keeps the
  scale, judged against ``error_bound``, the most that rounding in the wire format
  (the narrowest dtype handed to the step's collectives) can cause;
- the collectives are counted as they are called (``collective_calls``,
  ``collective_bytes``, ``wire_dtype``), and the buckets as the variant's hook is
  handed them (``buckets``);
- over the steps, ``cumulative_error`` compares the sum of the applied gradients
  with the sum of the exact averages (what PowerSGD's error feedback keeps small),
  and ``param_distance`` the weights with an exact run: one process, float64,
  torch.optim.SGD with the same settings, on the big batch of every step.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from harness.context import RunContext
from harness.errors import first_sentence
from harness.fit import fit_scale, relative_error
from harness.seeding import generator_for
from harness.strategies import step_cost, unavailable_reason
from harness.strategies.common import relative_spread
from harness.strategies.ddp import gather_to_leader
from harness.strategies.local import forward_shards
from harness.studies.base import Case, Study
from harness.studies.hooks.measure import (
    CollectiveLog,
    CollectiveTap,
    hook_verdict,
    magnitude_ratio,
    rounding_bound,
)
from harness.studies.hooks.schema import COLUMNS
from harness.studies.hooks.variants import (
    LEARNING_RATE,
    MOMENTUM,
    STEPS,
    VARIANTS,
    Replica,
    Variant,
    build_replica,
    variant_by_name,
)
from harness.tasks import Batch, Task, make_shards, task_by_name
from harness.tolerances import dtype_name

STRATEGIES = ("ddp", "fsdp")
#: Samples per rank per step.
SHARD_SIZE = 4
#: The 4-8-2 MLP whose inputs come from a different distribution on each rank, so that
#: the ranks' gradients differ and a sum cannot pass for an average.
TASK = "mlp"

NUMBERS = ("buckets", "collective_calls", "collective_bytes", "full_batch_scale",
           "fit_residual", "relative_error", "magnitude_ratio", "error_bound",
           "cumulative_error", "param_distance", "grad_rank_spread", "param_rank_spread",
           "rank0_state_elements")


def world_sizes(run: RunContext) -> tuple[int, ...]:
    """N >= 2 (one rank has nothing to reduce): the smallest and the largest by
    default, every one with ``--matrix full``."""
    multi = sorted(n for n in run.world_sizes if n >= 2)
    if run.config.matrix == "full" or len(multi) <= 2:
        return tuple(multi)
    return (multi[0], multi[-1])


def as_float64(batch: Batch) -> Batch:
    return Batch(batch.x.to(torch.float64), batch.y.to(torch.float64), batch.mask)


@dataclass
class StepTrace:
    """What one step left on this rank."""

    collectives: CollectiveLog
    buckets: int | None
    state_elements: int
    #: :meth:`Replica.snapshot` after the optimizer step: ``param.grad`` as the step
    #: applied it, and the weights it produced.
    snapshot: torch.Tensor


def train_step(replica: Replica, task: Task, shard: Batch, tap: CollectiveTap) -> StepTrace:
    """One SGD step (a collective on every rank of the replica's group), the backward's
    gradient collectives counted."""
    replica.start_step()
    with tap.watching() as collectives:
        task.loss(replica.forward(shard.x), shard, "mean").backward()
    replica.optimizer.step()
    return StepTrace(collectives, replica.buckets(), replica.state_elements(),
                      replica.snapshot())


def _collective_columns(record: StepTrace) -> dict[str, Any]:
    """What the step sent: collectives, calls, bytes, dtypes, and DDP's buckets."""
    log = record.collectives
    return {"wire_dtype": ";".join(sorted(dtype_name(d) for d in log.dtypes)),
            "collective": ";".join(sorted(log.names)),
            "buckets": math.nan if record.buckets is None else record.buckets,
            "collective_calls": log.calls, "collective_bytes": log.bytes}


class Judge:
    """Rank 0's side of a case: the exact average at the replica's weights each step, the
    exact run, and the sums behind ``cumulative_error``."""

    def __init__(self, task: Task, initial: nn.Module, world_size: int, rtol: float) -> None:
        self.task, self.world_size, self.rtol = task, world_size, rtol
        self.reference = copy.deepcopy(initial).to(torch.float64)
        self.exact = copy.deepcopy(initial).to(torch.float64)
        self.exact_optimizer = torch.optim.SGD(self.exact.parameters(), lr=LEARNING_RATE,
                                               momentum=MOMENTUM)
        #: The replica's weights before the coming step (rank 0's).
        self.weights = parameters_to_vector(self.reference.parameters()).detach()
        self.applied_sum = torch.zeros_like(self.weights)
        self.exact_sum = torch.zeros_like(self.weights)

    def measure(self, record: StepTrace, grads: list[torch.Tensor],
                weights: list[torch.Tensor], shards: list[Batch],
                replicated: bool) -> dict[str, Any]:
        """The row of one step: ``grads`` and ``weights`` after it, rank 0's first (the
        only one when the replica is sharded)."""
        shards = [as_float64(s) for s in shards]
        per_rank = self._shard_gradients(shards)
        average = torch.stack(per_rank).mean(0)
        grad = grads[0]
        fit = fit_scale(grad, average)
        error = relative_error(grad, average)
        wire = record.collectives.narrowest_dtype()
        bound = rounding_bound(per_rank, wire) if wire is not None else math.nan
        self.applied_sum += grad
        self.exact_sum += average
        exact_weights = self._exact_step(shards)
        self.weights = weights[0]
        return {
            **_collective_columns(record),
            "full_batch_scale": fit.scale, "fit_residual": fit.residual,
            "relative_error": error, "magnitude_ratio": magnitude_ratio(per_rank),
            "error_bound": bound,
            "verdict": hook_verdict(fit, error, bound, self.world_size, self.rtol),
            "cumulative_error": relative_error(self.applied_sum, self.exact_sum),
            "param_distance": relative_error(weights[0], exact_weights),
            "grad_rank_spread": relative_spread(grad, grads) if replicated else math.nan,
            "param_rank_spread": relative_spread(weights[0], weights) if replicated else math.nan,
            "rank0_state_elements": record.state_elements,
            "status": "ok",
        }

    def _shard_gradients(self, shards: list[Batch]) -> list[torch.Tensor]:
        """g_r: each rank's gradient of its own shard, at the replica's weights, in float64."""
        vector_to_parameters(self.weights, self.reference.parameters())
        params = list(self.reference.parameters())
        grads = []
        for slot, shard in enumerate(shards):
            output, batch = forward_shards(self.reference, [shard], slots=[slot])
            loss = self.task.loss(output, batch, "mean")
            grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
        return grads

    def _exact_step(self, shards: list[Batch]) -> torch.Tensor:
        """One step of the exact run: one process, every shard in one batch, mean loss."""
        self.exact_optimizer.zero_grad(set_to_none=True)
        output, batch = forward_shards(self.exact, shards)
        self.task.loss(output, batch, "mean").backward()
        self.exact_optimizer.step()
        return parameters_to_vector(self.exact.parameters()).detach()


class HooksStudy(Study):
    name = "hooks"
    any_slot = True
    summary = ("DDP comm hooks (fp16/bf16 compression, PowerSGD, hand-written sum and "
               "double-divide hooks), DDP options, ZeRO and FSDP2 divide factors and reduce "
               "dtypes against the exact average, with collectives counted")
    example = ("torchrun --standalone --nproc_per_node=4 scripts/study.py --studies hooks "
               "--matrix full")
    columns = COLUMNS

    def cases(self, run: RunContext) -> list[Case]:
        strategies = run.strategies(STRATEGIES)
        return [Case.of(self.name, participants=n, collective=True,
                        cost=variant.steps * step_cost(variant.strategy, n),
                        strategy=variant.strategy, variant=variant.name, world_size=n)
                for variant in VARIANTS if variant.strategy in strategies
                for n in world_sizes(run)]

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        variant = variant_by_name(case["strategy"], case["variant"])
        n = case["world_size"]
        reports = run.reports(case)
        identity = _identity(variant, n, run)
        if reason := unavailable_reason(variant.strategy, n, run):
            return [_blank(identity, step=math.nan, status=reason)] if reports else None
        task, group = task_by_name(TASK), run.group(n)
        initial = task.build_model(generator_for(run.seed, "hooks-model"), run.dtype)
        try:
            replica = build_replica(variant, copy.deepcopy(initial), group, run.device, run.seed)
        except Exception as error:  # raised alike on every rank: a setting refused here
            return [_blank(identity, step=math.nan, status=_skipped(error))] if reports else None
        data = [make_shards(task, [SHARD_SIZE] * n,
                            generator_for(run.seed, "hooks-data", n, step), run.dtype)
                for step in range(1, variant.steps + 1)]
        records, failure = _train(replica, task, data, dist.get_rank(group), run.device)
        # One gather per case: rank 0 needs every rank's gradients and weights only now.
        snapshots = (gather_to_leader(torch.stack([r.snapshot for r in records]), group,
                                      run.device) if records else [])
        if not reports:
            return None
        judge = Judge(task, initial, n, run.rtol)
        # Not strict: the records stop at a step that failed.
        rows = [{**identity, "step": step,
                 **judge.measure(record, *replica.assemble([s[step - 1] for s in snapshots]),
                                 shards, replica.replicated)}
                for step, (record, shards) in enumerate(zip(records, data, strict=False),
                                                         start=1)]
        if failure:
            rows.append(_blank(identity, step=len(records) + 1, status=failure))
        return rows

    def summary_table(self, frame) -> str:
        last = frame[(frame["status"] == "ok") & (frame["step"] == STEPS)]
        if last.empty:
            return "no case of the hooks study was measured"
        table = last.pivot_table(index=["strategy", "variant"], columns="world_size",
                                 values="verdict", aggfunc="first", sort=False)
        return f"verdict at step {STEPS} against the exact average, by world size:\n" + \
            table.to_string()


#: One tap for every case: the functions it patches are process-wide anyway.
TAP = CollectiveTap()


def _train(replica: Replica, task: Task, data: list[list[Batch]], rank: int,
           device: torch.device) -> tuple[list[StepTrace], str]:
    """Every step of ``data`` on this rank's shard; the records, and why training stopped
    early ("" when it did not)."""
    records = []
    for shards in data:
        try:
            records.append(train_step(replica, task, shards[rank].to(device), TAP))
        except Exception as error:  # raised alike on every rank: no collective hangs
            return records, _skipped(error)
    return records, ""


def _identity(variant: Variant, world_size: int, run: RunContext) -> dict[str, Any]:
    return {"strategy": variant.strategy, "variant": variant.name, "setting": variant.setting,
            "world_size": world_size, "model_dtype": dtype_name(run.dtype)}


def _blank(identity: dict[str, Any], step: float, status: str) -> dict[str, Any]:
    return {**identity, "step": step, "wire_dtype": "", "collective": "",
            **dict.fromkeys(NUMBERS, math.nan), "verdict": "", "status": status}


def _skipped(error: BaseException) -> str:
    return f"skipped: {first_sentence(error)}"

