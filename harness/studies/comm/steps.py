"""Where a training step's time goes: forward, backward, and DDP's gradient all-reduce.

DDP all-reduces gradient buckets *during* the backward pass, as buckets fill,
so the reduction cannot be timed by subtraction from a step without it. A
communication hook stamps each bucket when DDP hands it over and again when its
all-reduce completes (DDP's own default, ``allreduce_hook``, does the work); the
step's ``reduction`` is the sum of those spans. Under ``no_sync`` DDP sends
nothing, and the same step shows what the reduction adds. The two kinds of step
alternate, iteration by iteration, so that a machine getting busier slows both.

DataParallel (CUDA only) reduce-adds the replicas' gradients inside its backward
and offers no hook: its row has a forward and a backward time, no reduction.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from harness.models import device_slot
from harness.seeding import generator_for
from harness.strategies.ddp import wrap
from harness.studies.comm.schema import SHARD_SIZE
from harness.studies.comm.timing import Clock, Timing, median, summed_over_ranks
from harness.tasks import Batch, Task, make_shards, task_by_name

#: The harness's toy models (harness/tasks.py), smallest first.
STEP_MODELS = ("toy", "mlp", "mlp-batchnorm")
#: DDP all-reduces every step, or not at all (``no_sync``); DataParallel always reduces.
SYNC_MODES = ("every-step", "no_sync")
#: Per-iteration quantities, in the order they travel between ranks.
PHASES = ("forward", "backward", "reduction", "step")


@dataclass(frozen=True)
class StepResult:
    """Median seconds per phase over the timed steps, and what the step all-reduced."""

    forward: float
    backward: float
    #: Summed bucket all-reduce spans (overlapping the backward); NaN where not measurable.
    reduction: float
    #: forward + backward, the whole step (its own median, not the sum of the medians).
    step: float
    buckets: float
    bucket_bytes: float


class ReductionTimer:
    """DDP comm-hook state: the group, and the spans of the current step's bucket all-reduces."""

    def __init__(self, group: dist.ProcessGroup, clock: Clock) -> None:
        self.group, self.clock = group, clock
        self.spans: list[tuple] = []
        self.bytes = 0

    def reset(self) -> None:
        self.spans, self.bytes = [], 0

    def seconds(self) -> float:
        return sum(self.clock.seconds(start, end) for start, end in self.spans)


# No annotations: DDP checks a hook's annotations at run time, and this module's
# postponed (string) annotations would not compare equal to dist.GradBucket.
def timed_allreduce(timer, bucket):
    """DDP's default hook (divide by the group size, all-reduce SUM), with its span stamped.

    The end stamp is taken in the future's callback, which runs once the
    all-reduce has completed (on a GPU: recorded on the stream that waits for it).
    """
    start = timer.clock.stamp()
    buffer = bucket.buffer()
    timer.bytes += buffer.numel() * buffer.element_size()

    def finished(future):
        timer.spans.append((start, timer.clock.stamp()))
        return future.value()

    return allreduce_hook(timer.group, bucket).then(finished)


def _model_and_shards(model_name: str, world_size: int, dtype: torch.dtype, seed: int
                      ) -> tuple[Task, torch.nn.Module, list[Batch]]:
    task = task_by_name(model_name)
    generator = generator_for(seed, "comm", model_name, world_size)
    model = task.build_model(generator, dtype)
    shards = make_shards(task, [SHARD_SIZE] * world_size, generator, dtype)
    return task, model, shards


def _ddp_step(ddp, task: Task, shard: Batch, rank: int, timer: ReductionTimer,
              sync: bool) -> list[float]:
    """One DDP step from zeroed gradients; seconds per phase (see PHASES)."""
    clock = timer.clock
    ddp.zero_grad(set_to_none=True)
    timer.reset()
    with contextlib.nullcontext() if sync else ddp.no_sync():
        start = clock.stamp()
        with device_slot(rank):
            output = ddp(shard.x)
        loss = task.loss(output, shard, "mean")
        forwarded = clock.stamp()
        loss.backward()
        end = clock.stamp()
    forward, backward = clock.seconds(start, forwarded), clock.seconds(forwarded, end)
    return [forward, backward, timer.seconds(), forward + backward]


def _medians(per_iteration: torch.Tensor) -> list[float]:
    """Median of each phase's column."""
    return [median(per_iteration[:, i].tolist()) for i in range(per_iteration.shape[1])]


def measure_ddp_steps(model_name: str, group: dist.ProcessGroup, device: torch.device,
                      dtype: torch.dtype, seed: int, timing: Timing) -> dict[str, StepResult]:
    """DDP steps of ``model_name`` on ``group``, with and without ``no_sync``, every rank on
    its own shard; the same result on every rank (each iteration: the mean over ranks)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    task, model, shards = _model_and_shards(model_name, world_size, dtype, seed)
    ddp = wrap(model.to(device), group, device)
    timer = ReductionTimer(group, Clock(device))
    ddp.register_comm_hook(timer, timed_allreduce)
    shard = shards[rank].to(device)
    times: dict[str, list[list[float]]] = {mode: [] for mode in SYNC_MODES}
    sent: dict[str, tuple[int, int]] = {}
    for iteration in range(timing.warmup + timing.iterations):
        for mode in SYNC_MODES:
            phases = _ddp_step(ddp, task, shard, rank, timer, sync=mode == "every-step")
            sent[mode] = (len(timer.spans), timer.bytes)
            if iteration >= timing.warmup:
                times[mode].append(phases)
    mean = summed_over_ranks(torch.tensor([times[mode] for mode in SYNC_MODES],
                                          dtype=torch.float64),
                             group, device) / world_size
    return {mode: StepResult(*_medians(mean[i]), *sent[mode])
            for i, mode in enumerate(SYNC_MODES)}


def measure_dp_step(model_name: str, world_size: int, dtype: torch.dtype, seed: int,
                    timing: Timing) -> StepResult:
    """DataParallel steps over CUDA devices 0..world_size-1 on the global batch (the N
    shards a DDP step of the same world size spreads over its ranks)."""
    task, model, shards = _model_and_shards(model_name, world_size, dtype, seed)
    device = torch.device("cuda", 0)
    model = model.to(device)
    parallel = torch.nn.DataParallel(model, device_ids=list(range(world_size)))
    batch = Batch.cat(shards).to(device)
    clock = Clock(device)
    times = []
    for iteration in range(timing.warmup + timing.iterations):
        model.zero_grad(set_to_none=True)
        start = clock.stamp()
        loss = task.loss(parallel(batch.x), batch, "mean")
        forwarded = clock.stamp()
        loss.backward()
        end = clock.stamp()
        forward, backward = clock.seconds(start, forwarded), clock.seconds(forwarded, end)
        if iteration >= timing.warmup:
            times.append([forward, backward, forward + backward])
    forward, backward, step = _medians(torch.tensor(times, dtype=torch.float64))
    nan = float("nan")
    return StepResult(forward, backward, nan, step, nan, nan)
