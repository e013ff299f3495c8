"""One process, no reduction: the references every strategy is measured against.

``g_full`` is the gradient of the loss over the whole global batch; ``g_r`` the
gradient device r would compute on its own shard alone. For a model that reads
its device slot (seed 001's), each shard is forwarded under its own slot and
the outputs are concatenated before the loss, so the reference computes the
same per-sample function the devices did. Other models see the whole batch in
one forward, so BatchNorm's reference statistics are those of the full batch.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence

import torch
from torch import nn

from harness.check.case import CaseModel
from harness.models import device_slot
from harness.strategies.common import StrategyTrainer, buffers_of, clear_grad, flat_grad
from harness.tasks import Batch, Task


def forward_shards(model: nn.Module, shards: Sequence[Batch],
                   slots: Sequence[int] | None = None) -> tuple[torch.Tensor, Batch]:
    """Forward ``shards`` as one batch; each shard under its own slot if the model reads slots."""
    batch = Batch.cat(shards)
    if not getattr(model, "uses_device_slot", False):
        return model(batch.x), batch
    slots = range(len(shards)) if slots is None else slots
    outputs = []
    for slot, shard in zip(slots, shards, strict=True):
        with device_slot(slot):
            outputs.append(model(shard.x))
    return torch.cat(outputs), batch


def local_gradient(task: Task, model: nn.Module, shards: Sequence[Batch], reduction: str,
                   slots: Sequence[int] | None = None) -> torch.Tensor:
    """The gradient one process computes for the loss over ``shards``, on a copy of ``model``."""
    replica = copy.deepcopy(model)
    clear_grad(replica)
    output, batch = forward_shards(replica, shards, slots)
    task.loss(output, batch, reduction).backward()
    return flat_grad(replica)


def per_device_gradients(task: Task, model: nn.Module, shards: Sequence[Batch],
                         reduction: str) -> list[torch.Tensor]:
    """``g_r`` for every device r: its own shard, alone, with the same loss."""
    return [local_gradient(task, model, [shard], reduction, slots=[r])
            for r, shard in enumerate(shards)]


def running_stats_after(model: nn.Module, shards: Sequence[Batch]) -> dict[str, torch.Tensor]:
    """The buffers a copy of ``model`` holds after one training-mode forward over ``shards``."""
    replica = copy.deepcopy(model)
    with torch.no_grad():
        forward_shards(replica, shards)
    return buffers_of(replica)


class LocalTrainer(StrategyTrainer):
    """One process, no reduction: micro-steps straight into the module."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.module = module.to(device)
        self.device = device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with device_slot(0):
            return self.module(x)


class LocalCheckCase(CaseModel):
    """One process playing the N ranks: their pieces in turn, each rank's gradients held
    apart (a custom micro_step that reads ``.grad`` sees its own rank's, as under DDP's
    no_sync), averaged over the N at the end of the step as DDP and FSDP average them.

    Each rank of a real launch has an optimizer and a scheduler of its own: a micro_step
    that changes them (a scheduler stepped per micro-step) changes each rank's once per
    micro-step, not N times. So every played rank starts its piece from the state the
    micro-step began with (the optimizer's hyperparameters, the scheduler's state)."""

    plays_every_rank = True

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def ranks_played(self) -> list[int]:
        return list(range(self.world_size))

    #: Each played rank's own gradients (one per trainable parameter) during a step.
    _held: dict[int, list[torch.Tensor | None]] | None = None

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.inner.parameters() if p.requires_grad]

    #: The optimizer's and the scheduler's state as the micro-step began (see the class).
    _began: tuple[list[dict], dict | None] | None = None

    def _step_state(self) -> tuple[list[dict], dict | None]:
        groups = [{key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
                  for group in self.optimizer.param_groups]
        scheduler = self.whole.scheduler
        return groups, copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None

    def _restore_step_state(self, state: tuple[list[dict], dict | None]) -> None:
        groups, scheduler = state
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(copy.deepcopy(saved))
        if scheduler is not None:
            self.whole.scheduler.load_state_dict(copy.deepcopy(scheduler))

    @contextlib.contextmanager
    def playing(self, rank: int):
        if rank == 0:
            self._began = self._step_state()
        else:
            self._restore_step_state(self._began)
        params = self._trainable()
        if self._held is None:
            self._held = {r: [None] * len(params) for r in range(self.world_size)}
        for param, grad in zip(params, self._held[rank], strict=True):
            param.grad = grad
        try:
            yield
        finally:
            self._held[rank] = [param.grad for param in params]

    def reduce_played(self) -> None:
        held, self._held = self._held, None
        for i, param in enumerate(self._trainable()):
            grads = [held[rank][i] for rank in held if held[rank][i] is not None]
            if grads:
                for grad in grads[1:]:
                    grads[0].add_(grad)
                grads[0].div_(self.world_size)
            param.grad = grads[0] if grads else None
