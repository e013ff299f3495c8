"""A fleet: independent copies of one model, wrapped and trained together as one module.

A case of this study compares dozens of training runs (every optimizer x loss
x learning-rate candidate) under one strategy with the big batch. Wrapping each
run on its own would cost one DDP construction and one all-reduce per step per
run. DDP, FSDP and DataParallel reduce every gradient entry on its own (an
average or a sum over devices, element by element), and the copies of a fleet
share no weight: the loss is the sum of each copy's loss, so each copy's
gradient is exactly what it would be wrapped alone, and one collective per step
serves every run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from harness.context import RunContext
from harness.strategies import STRATEGIES
from harness.strategies.common import StrategyTrainer, float64_vector


class MLPCopy(nn.Module):
    """One copy of the study's MLP (``Linear -> tanh -> Linear``): its parameters, in the
    order ``MLP.parameters()`` yields them, so that flattened vectors compare entry by entry."""

    def __init__(self, initial: nn.Module) -> None:
        super().__init__()
        self.hidden_weight = nn.Parameter(initial.hidden.weight.detach().clone())
        self.hidden_bias = nn.Parameter(initial.hidden.bias.detach().clone())
        self.out_weight = nn.Parameter(initial.out.weight.detach().clone())
        self.out_bias = nn.Parameter(initial.out.bias.detach().clone())


class Fleet(nn.Module):
    """``copies`` copies of ``initial`` (the study's MLP without a norm layer); the output
    stacks theirs along dim 1.

    The copies are computed together: their weights are stacked and multiplied in one
    batched product per layer, instead of one module call per copy (ten times faster at
    fifty copies on a CPU). The big-batch reference runs the MLP module itself, so any
    difference between this forward and the MLP's would show as an update error.
    """

    uses_device_slot = False

    def __init__(self, initial: nn.Module, copies: int) -> None:
        super().__init__()
        if not isinstance(getattr(initial, "norm", None), nn.Identity):
            raise TypeError("a fleet copies the MLP without a norm layer")
        self.copies = nn.ModuleList(MLPCopy(initial) for _ in range(copies))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, copy, output): DataParallel's gather concatenates along dim 0, the batch.
        copies = self.copies
        w1 = torch.stack([m.hidden_weight for m in copies])
        b1 = torch.stack([m.hidden_bias for m in copies])
        w2 = torch.stack([m.out_weight for m in copies])
        b2 = torch.stack([m.out_bias for m in copies])
        hidden = torch.tanh(torch.einsum("bi,mhi->bmh", x, w1) + b1)
        return torch.einsum("bmh,moh->bmo", hidden, w2) + b2


def fleet_trainer(strategy: str, fleet: Fleet, world_size: int, run: RunContext) -> StrategyTrainer:
    """``fleet`` under ``strategy`` over ``world_size`` devices."""
    trainer = STRATEGIES[strategy].trainer
    if trainer is None:
        raise ValueError(f"strategy {strategy!r} has no trainer")
    return trainer(fleet, world_size, run)


def members(trainer: StrategyTrainer) -> nn.ModuleList:
    return trainer.module.copies


def micro_step_context(trainer: StrategyTrainer, sync: bool) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` for a micro-step that must not reduce; nothing otherwise."""
    return contextlib.nullcontext() if sync else trainer.no_sync()


def is_sharded(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "to_local")


def full_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup | None
                 ) -> list[torch.Tensor]:
    """Whole CPU copies of ``tensors`` on every rank: FSDP's sharded DTensors (dim-0 shards)
    are gathered in one collective for all of them; plain tensors are copied as they are.

    One gather of every local shard at once instead of ``full_tensor()`` per tensor:
    the latter is one all-gather per parameter (about 6 ms each on 4 CPU ranks).
    """
    if not any(is_sharded(t) for t in tensors):
        return [t.detach().cpu().clone() for t in tensors]
    local = [t.to_local().detach().cpu() if is_sharded(t) else t.detach().cpu() for t in tensors]
    every_rank: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every_rank, local, group=group)
    return [torch.cat([shards[i] for shards in every_rank]) if is_sharded(t) else local[i]
            for i, t in enumerate(tensors)]


def every_member_parameters(trainer: StrategyTrainer) -> list[torch.Tensor]:
    """Each copy's parameters as one float64 vector (a collective under FSDP)."""
    copies = members(trainer)
    params = [p for member in copies for p in member.parameters()]
    whole = full_tensors(params, getattr(trainer, "group", None))
    per_member = len(params) // len(copies)
    return [float64_vector(whole[i * per_member:(i + 1) * per_member]) for i in range(len(copies))]


def member_gradients(trainer: StrategyTrainer, indices: list[int]) -> list[torch.Tensor]:
    """The gradients of the copies at ``indices``, each as one float64 vector (a collective
    under FSDP, where each rank holds a shard of every gradient)."""
    copies = members(trainer)
    grads = [p.grad for i in indices for p in copies[i].parameters()]
    whole = full_tensors(grads, getattr(trainer, "group", None))
    per_member = len(grads) // len(indices)
    return [float64_vector(whole[j * per_member:(j + 1) * per_member]) for j in range(len(indices))]
