"""The user's step under each strategy, and which tensors each rank compares.

A :class:`CaseModel` starts from the reference's initial state (so an unseeded
``make_model`` cannot make a false difference), feeds its micro-batches the way the
strategy would, and lists the (measured, reference) pairs this rank owns.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.check import batches
from harness.check.compare import Pair
from harness.check.load import prepared_model
from harness.check.reference import ReferenceStep, make_optimizer, state_names
from harness.check.setup import MicroStep, Setup


def default_micro_step(setup: Setup):
    """The recipe without a custom one: ``loss / k``."""
    def micro_step(model: nn.Module, micro_batch: Any, where: MicroStep) -> torch.Tensor:
        return setup.loss(model, micro_batch) / where.accum_steps

    return setup.micro_step or micro_step


class CaseModel(ABC):
    """A fresh model under one strategy at world size ``world_size``."""

    def __init__(self, setup: Setup, initial: dict[str, torch.Tensor], world_size: int,
                 dtype: torch.dtype, device: torch.device,
                 group: dist.ProcessGroup | None) -> None:
        self.setup, self.world_size, self.device, self.group = setup, world_size, device, group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.inner = prepared_model(setup, dtype, device)
        self.inner.load_state_dict(initial)
        self.param_names, self.buffer_names = state_names(self.inner)
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
    def owns(self, index: int) -> bool:
        """Whole tensors are dealt out to the ranks in turn: each compares 1/N of them."""
        return index % self.world_size == self.rank

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
                for i, name in enumerate(self.param_names)
                if self.sharded(name) or self.owns(i)]

    def update_pairs(self, ref: ReferenceStep) -> list[Pair]:
        """Parameters and floating buffers after the step, as updates from where the
        reference started it: the shared starting point would otherwise dominate."""
        state = self.inner.state_dict(keep_vars=True)
        pairs = []
        for i, name in enumerate(self.state_names):
            if not (self.sharded(name) or self.owns(i)):
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

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def ranks_played(self) -> list[int]:
        return list(range(self.world_size))

    def loss_for_backward(self, micro_batch: Any, where: MicroStep) -> torch.Tensor:
        return super().loss_for_backward(micro_batch, where) / self.world_size

    def owns(self, index: int) -> bool:
        return True


class DDPCase(CaseModel):
    def wrap(self, model: nn.Module) -> nn.Module:
        from harness.strategies.ddp import wrap

        return wrap(model, self.group, self.device, **self.setup.ddp_options)

    def sync(self, micro: int, accum_steps: int) -> contextlib.AbstractContextManager:
        return self.module.no_sync() if micro < accum_steps - 1 else contextlib.nullcontext()


class FSDPCase(CaseModel):
    """Parameters and gradients are DTensors sharded along dim 0 as ``torch.chunk`` cuts
    it; each rank compares its shard with the same chunk of the reference."""

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
