"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over a process subgroup.

Each rank keeps a shard of every parameter and of its gradient; the backward
reduce-scatters the ranks' local gradients. To compare with the other
strategies, the sharded gradient is gathered back into one vector
(``DTensor.full_tensor``) on every rank.

What each rank feeds into the reduce-scatter is its gradient of its own shard.
FSDP keeps that unsharded gradient to itself (``set_requires_gradient_sync(False)``
accumulates it internally), so each rank computes it once more without FSDP, on
a copy of the same weights, and rank 0 gathers them.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

from harness.check.case import CaseModel, shard_rows
from harness.models import device_slot
from harness.strategies.common import StepMeasurement, StepSpec, StrategyTrainer, buffers_of
from harness.strategies.ddp import measurement_on_leader
from harness.strategies.local import local_gradient


def unavailable_reason(placement) -> str | None:
    """Why FSDP cannot be measured with this backend and device, or None."""
    if placement.backend == "gloo" and placement.device.type == "cuda":
        # Measured: gathering the sharded gradient (DTensor.full_tensor) over gloo with
        # CUDA tensors kills the process with a segmentation fault (torch 2.11, H100).
        return ("skipped: FSDP over gloo with CUDA tensors crashes gathering the sharded "
                "gradient; use --backend nccl or --device cpu")
    return None


def shard(module: nn.Module, group: dist.ProcessGroup, device: torch.device) -> nn.Module:
    """``fully_shard`` the whole module on a 1-D mesh over ``group``."""
    # Imported here: torch.distributed.fsdp costs ~1 s to import, in every rank.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    return fully_shard(module.to(device), mesh=mesh)


def full_grad(module: nn.Module) -> torch.Tensor:
    """The whole gradient as one vector, gathered from every rank's shard (a collective)."""
    parts = []
    for param in module.parameters():
        grad = param.grad
        full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        parts.append(full.reshape(-1))
    return torch.cat(parts).detach().cpu()


def _backward_passes(model: nn.Module, spec: StepSpec, rank: int, shard_data, passes: int
                     ) -> list[torch.Tensor]:
    grads = []
    for _ in range(passes):
        with device_slot(rank):
            output = model(shard_data.x)
        spec.task.loss(output, shard_data, spec.reduction).backward()
        grads.append(full_grad(model))
    return grads


def measure_step(spec: StepSpec, group: dist.ProcessGroup, device: torch.device
                 ) -> StepMeasurement | None:
    """Each rank trains on its own shard; rank 0 returns the gathered ``param.grad``."""
    rank = dist.get_rank(group)
    shard_data = spec.shards[rank].to(device)
    model = shard(copy.deepcopy(spec.model), group, device)
    grads = _backward_passes(model, spec, rank, shard_data, spec.backward_passes)
    buffers = buffers_of(model)
    local = local_gradient(spec.task, spec.model, [spec.shards[rank]], spec.reduction,
                           slots=[rank])
    return measurement_on_leader(spec, grads, local, buffers, group, device)


class FSDPTrainer(StrategyTrainer):
    """FSDP2's ``fully_shard`` on a subgroup: each rank feeds its own shard."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__()
        self.module = shard(module, group, device)
        self.group, self.device = group, device
        self.rank = dist.get_rank(group)
        self.average_divisor = dist.get_world_size(group)

    def batch_for_this_process(self, shards):
        return shards[self.rank].to(self.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    @contextlib.contextmanager
    def no_sync(self):
        """FSDP2's ``no_sync``: the enclosed backward keeps the unsharded gradient and
        reduce-scatters nothing; the next synchronized backward reduces the sum."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


class FSDPCheckCase(CaseModel):
    """grad-check: the user's step under FSDP2 on ranks 0..N-1. Parameters and gradients
    are DTensors sharded along dim 0 as ``torch.chunk`` cuts
    it; each rank compares its shard with the same chunk of the reference."""

    shards_parameters = True

    @classmethod
    def unavailable(cls, placement) -> str | None:
        return unavailable_reason(placement)

    def wrap(self, model: nn.Module) -> nn.Module:
        return shard(model, self.group, self.device)

    def sharded(self, name: str) -> bool:
        return name in self._sharded

    @property
    def _sharded(self) -> set[str]:
        return set(self.param_names)

    def local(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or not hasattr(tensor, "to_local"):
            return tensor
        return tensor.to_local()

    def reference_part(self, reference: torch.Tensor | None, name: str, first_row: int = 0
                       ) -> torch.Tensor | None:
        if reference is None or not self.sharded(name) or reference.dim() == 0:
            return reference
        first, stop = shard_rows(self.rows[name], self.world_size, self.rank)
        return reference[first - first_row:stop - first_row]
