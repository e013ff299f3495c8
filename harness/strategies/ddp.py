"""DistributedDataParallel over a process subgroup of ranks 0..k-1.

One torchrun launch of N ranks measures every world size k <= N: the runner
creates the subgroups once, and a case of world size k wraps its model in DDP
on the subgroup of the first k ranks. Ranks outside it skip the case.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from harness.check.case import CaseModel
from harness.check.compare import same_on_every_rank, sampled_fingerprint
from harness.models import device_slot
from harness.strategies.common import (
    CommCounter,
    StepMeasurement,
    StepSpec,
    StrategyTrainer,
    buffers_of,
    clear_grad,
    flat_grad,
    relative_spread,
)


def wrap(module: nn.Module, group: dist.ProcessGroup, device: torch.device,
         **options) -> DistributedDataParallel:
    """DDP with its defaults (bucketing, buffer broadcast) unless ``options`` say
    otherwise (e.g. ``find_unused_parameters``), on ``group``."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, process_group=group, device_ids=device_ids,
                                   **options)


def count_allreduces(ddp: DistributedDataParallel, group: dist.ProcessGroup,
                     counter: CommCounter) -> None:
    """Register a hook that counts every bucket DDP all-reduces, then does exactly what
    DDP's default does (``allreduce_hook``: divide by the group size, all-reduce SUM).

    Why a hook and not arithmetic: the counts are then what DDP actually sent,
    including the all-reduces that ``no_sync`` skips.
    """

    # No annotations: DDP checks them at run time, and this module's postponed
    # (string) annotations would not compare equal to dist.GradBucket.
    def hook(state, bucket):
        state.add([bucket.buffer()])
        return allreduce_hook(group, bucket)

    ddp.register_comm_hook(counter, hook)


def gather_to_leader(tensor: torch.Tensor, group: dist.ProcessGroup,
                     device: torch.device) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` (same shape everywhere), on the group's first rank; None
    elsewhere."""
    local = tensor.to(device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    # The rank within the group: a case may run on ranks that do not start at 0.
    if dist.get_rank(group) != 0:
        return None
    return [t.cpu() for t in gathered]


def measure_step(spec: StepSpec, group: dist.ProcessGroup, device: torch.device
                 ) -> StepMeasurement | None:
    """Each rank trains on its own shard; rank 0 returns what DDP left in ``param.grad``.

    After the measured passes, one more pass under ``no_sync`` yields each rank's
    local gradient: exactly what that rank feeds into DDP's all-reduce.
    """
    rank = dist.get_rank(group)
    model = copy.deepcopy(spec.model).to(device)
    ddp = wrap(model, group, device)
    shard = spec.shards[rank].to(device)
    grads, buffers = [], {}
    for step in range(spec.backward_passes):
        with device_slot(rank):
            output = ddp(shard.x)
        spec.task.loss(output, shard, spec.reduction).backward()
        grads.append(flat_grad(model))
        if step == 0:
            buffers = buffers_of(model)
    clear_grad(model)
    with ddp.no_sync(), device_slot(rank):
        spec.task.loss(ddp(shard.x), shard, spec.reduction).backward()
    return measurement_on_leader(spec, grads, flat_grad(model), buffers, group, device)


def measurement_on_leader(spec: StepSpec, grads: list[torch.Tensor], local: torch.Tensor,
                          buffers: dict[str, torch.Tensor], group: dist.ProcessGroup,
                          device: torch.device) -> StepMeasurement | None:
    """Gather every rank's ``param.grad`` (per pass) and local gradient on rank 0 and
    measure how far the ranks disagree; None on the other ranks. A collective."""
    every_rank_grads = gather_to_leader(torch.stack(grads), group, device)
    contributions = gather_to_leader(local, group, device)
    if every_rank_grads is None or contributions is None:
        return None
    spread = max(relative_spread(g, [other[i] for other in every_rank_grads])
                 for i, g in enumerate(grads))
    return StepMeasurement(grads=grads, contributions=contributions,
                           chunk_sizes=tuple(len(s) for s in spec.shards),
                           rank_spread=spread, buffers=buffers)


class DDPTrainer(StrategyTrainer):
    """DDP on a subgroup, with every all-reduce counted; reusable across cases via ``reset``.

    Wrapping once per (world size, model) and resetting weights between cases
    keeps DDP's constructor (a broadcast and a shape check across ranks) out of
    every case; what is measured is DDP's steady state, as in real training.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__()
        self.module = module.to(device)
        self.group, self.device = group, device
        self.rank = dist.get_rank(group)
        self.average_divisor = dist.get_world_size(group)
        self.ddp = wrap(self.module, group, device)
        count_allreduces(self.ddp, group, self.allreduce)

    def batch_for_this_process(self, shards):
        return shards[self.rank].to(self.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with device_slot(self.rank):
            return self.ddp(x)

    def no_sync(self):
        return self.ddp.no_sync()

    def grads_of_every_rank(self) -> list[torch.Tensor] | None:
        return gather_to_leader(flat_grad(self.module), self.group, self.device)


class DDPCheckCase(CaseModel):
    """grad-check: the user's step under DDP on ranks 0..N-1, ``no_sync`` for the first
    k-1 micro-steps."""

    reduces_in_buckets = True

    def wrap(self, model: nn.Module) -> nn.Module:
        return wrap(model, self.group, self.device, **self.setup.ddp_options)

    def sync(self, micro: int, accum_steps: int) -> contextlib.AbstractContextManager:
        return self.module.no_sync() if micro < accum_steps - 1 else contextlib.nullcontext()

    def ranks_agree(self, point: str) -> bool | None:
        """DDP's promise: after the reduction every replica holds the same gradient. Where
        a rank compares tensors the others hold differently, its own values are compared."""
        params = [param for _, param in self.inner.named_parameters()]
        tensors = [param.grad for param in params] if point == "grad" else params
        return same_on_every_rank([sampled_fingerprint(tensors)], self.group, self.device)
