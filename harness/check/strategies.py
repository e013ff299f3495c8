"""The user's step under each strategy, and which tensors each rank compares.

A :class:`CaseModel` starts from a copy of the model the reference started from (so an
unseeded ``make_model`` cannot make a false difference), feeds its micro-batches the way
the strategy would, and lists the (measured, reference) pairs this rank compares.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.check import batches
from harness.check.compare import Pair, same_on_every_rank, sampled_fingerprint
from harness.check.reference import ReferenceStep, make_optimizer, state_names
from harness.check.setup import MicroStep, Setup


def default_micro_step(setup: Setup):
    """The recipe without a custom one: ``loss / k``."""
    def micro_step(model: nn.Module, micro_batch: Any, where: MicroStep) -> torch.Tensor:
        return setup.loss(model, micro_batch) / where.accum_steps

    return setup.micro_step or micro_step


def deal(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that compares each tensor: the largest first, each to the least loaded rank,
    so that every rank compares about 1/N of the elements (dealt in turn, one rank could
    get every weight matrix and another every bias)."""
    loads, owners = [0] * world_size, [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index], loads[rank] = rank, loads[rank] + sizes[index]
    return owners


class CaseModel(ABC):
    """A model under one strategy at world size ``world_size``, from the initial state."""

    #: One process plays every rank, so it compares every tensor.
    plays_every_rank = False
    #: Every rank holds a shard of every parameter, so it compares its shard of each.
    shards_parameters = False

    def __init__(self, setup: Setup, model: nn.Module, world_size: int, device: torch.device,
                 group: dist.ProcessGroup | None) -> None:
        self.setup, self.world_size, self.device, self.group = setup, world_size, device, group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.inner = model
        self.param_names, self.buffer_names = state_names(self.inner)
        self.compared = self.compared_names(model, world_size, self.rank)
        self.module = self.wrap(self.inner)
        self.optimizer = make_optimizer(
            setup, [p for p in self.module.parameters() if p.requires_grad])
        self.micro_step = default_micro_step(setup)

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the user's loss calls."""

    def sync(self, micro: int, accum_steps: int) -> contextlib.AbstractContextManager:
        """Around micro-step ``micro``'s backward: skip the reduction where the strategy can."""
        return contextlib.nullcontext()

    def ranks_played(self) -> list[int]:
        """The ranks whose pieces this process computes."""
        return [self.rank]

    def backward_window(self, window: Any, samples: int, accum_steps: int) -> None:
        """Every micro-step of one optimizer step, the loss of each backpropagated."""
        per_piece = samples // (self.world_size * accum_steps)
        for micro in range(accum_steps):
            where = MicroStep(micro, accum_steps, self.world_size, samples, window)
            for rank in self.ranks_played():
                micro_batch = batches.piece(window, per_piece, rank, accum_steps, micro)
                with self.sync(micro, accum_steps):
                    self.loss_for_backward(micro_batch, where).backward()

    def loss_for_backward(self, micro_batch: Any, where: MicroStep) -> torch.Tensor:
        return self.micro_step(self.module, micro_batch, where)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ---------------------------------------------------------------- comparing
    def ranks_agree(self, point: str) -> bool | None:
        """Whether every rank holds the same gradients (``grad``) or parameters
        (``params``); None where ranks are not meant to (one process, or shards)."""
        return None

    @classmethod
    def compared_names(cls, model: nn.Module, world_size: int, rank: int) -> set[str]:
        """The tensors (parameters and floating buffers) rank ``rank`` compares: whole
        tensors are dealt out to the ranks by size (:func:`deal`)."""
        params, buffers = state_names(model)
        names = [*params, *buffers]
        if cls.plays_every_rank:
            return set(names)
        state = model.state_dict(keep_vars=True)
        owners = deal([state[name].numel() for name in names], world_size)
        return {name for name, owner in zip(names, owners, strict=True)
                if owner == rank or (cls.shards_parameters and name in params)}

    def local(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's part of a (possibly sharded) tensor."""
        return tensor

    def reference_part(self, reference: torch.Tensor | None, name: str
                       ) -> torch.Tensor | None:
        """The part of a reference tensor that matches :meth:`local`."""
        return reference

    def sharded(self, name: str) -> bool:
        return False

    def grad_pairs(self, ref: ReferenceStep) -> list[Pair]:
        params = dict(self.inner.named_parameters())
        return [Pair(name, self.local(params[name].grad),
                     self.reference_part(ref.grads[name], name))
                for name in self.param_names if name in self.compared]

    def update_pairs(self, ref: ReferenceStep) -> list[Pair]:
        """Parameters and floating buffers after the step, as updates from where the
        reference started it: the shared starting point would otherwise dominate."""
        state = self.inner.state_dict(keep_vars=True)
        pairs = []
        for name in self.state_names:
            if name not in self.compared:
                continue
            pairs.append(Pair(name, self.local(state[name].detach()),
                              self.reference_part(ref.after[name], name),
                              origin=self.reference_part(ref.before[name], name)))
        return pairs

    @property
    def state_names(self) -> list[str]:
        return [*self.param_names, *self.buffer_names]


class LocalCase(CaseModel):
    """One process playing the N ranks: their pieces in turn, each loss divided by N
    because DDP and FSDP average the N ranks' gradients."""

    plays_every_rank = True

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def ranks_played(self) -> list[int]:
        return list(range(self.world_size))

    def loss_for_backward(self, micro_batch: Any, where: MicroStep) -> torch.Tensor:
        return super().loss_for_backward(micro_batch, where) / self.world_size


class DDPCase(CaseModel):
    def wrap(self, model: nn.Module) -> nn.Module:
        from harness.strategies.ddp import wrap

        return wrap(model, self.group, self.device, **self.setup.ddp_options)

    def sync(self, micro: int, accum_steps: int) -> contextlib.AbstractContextManager:
        return self.module.no_sync() if micro < accum_steps - 1 else contextlib.nullcontext()

    def ranks_agree(self, point: str) -> bool | None:
        """DDP's promise: after the reduction every replica holds the same gradient. Where
        a rank compares tensors the others hold differently, its own values are compared."""
        params = [param for _, param in self.inner.named_parameters()]
        tensors = [param.grad for param in params] if point == "grad" else params
        return same_on_every_rank([sampled_fingerprint(tensors)], self.group, self.device)


class FSDPCase(CaseModel):
    """Parameters and gradients are DTensors sharded along dim 0 as ``torch.chunk`` cuts
    it; each rank compares its shard with the same chunk of the reference."""

    shards_parameters = True

    def wrap(self, model: nn.Module) -> nn.Module:
        from harness.strategies.fsdp import shard

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

    def reference_part(self, reference: torch.Tensor | None, name: str
                       ) -> torch.Tensor | None:
        if reference is None or not self.sharded(name) or reference.dim() == 0:
            return reference
        chunks = torch.chunk(reference, self.world_size, dim=0)
        if self.rank < len(chunks):
            return chunks[self.rank]
        return reference.new_empty((0, *reference.shape[1:]))


CASE_MODELS: dict[str, type[CaseModel]] = {"local": LocalCase, "ddp": DDPCase,
                                           "fsdp": FSDPCase}
