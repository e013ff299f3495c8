"""The user's step under a strategy, and which tensors each rank compares.

Each strategy's module (harness/strategies/) subclasses :class:`CaseModel` for its way of
feeding the micro-batches and reducing; its spec points to that class
(``Strategy.check_case``). A :class:`CaseModel` starts from a copy of the model the
reference started from (so an unseeded ``make_model`` cannot make a false difference),
feeds its micro-batches the way the strategy would, and lists the (measured, reference)
pairs this rank compares.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.check import batches
from harness.check.compare import Pair
from harness.check.reference import (
    ReferenceStep,
    Rows,
    make_optimizer,
    named_state,
    state_names,
)
from harness.check.setup import MicroStep, Setup
from harness.check.step import WholeStep, not_finite
from harness.placement import Placement


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


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows of ``rank``'s shard of a tensor with ``rows`` rows, as ``torch.chunk`` cuts
    dim 0 (FSDP2's sharding): empty for the ranks past the last chunk."""
    size = -(-rows // world_size)
    first = min(rows, rank * size)
    return first, min(rows, first + size)


def merged(kept: Rows, more: Rows) -> Rows:
    """Rows that cover both (the whole tensor if either is)."""
    if kept is None or more is None:
        return None
    return min(kept[0], more[0]), max(kept[1], more[1])


def not_finite_message(first: float, step: int, world_size: int, accum_steps: int) -> str:
    """Where a step first went non-finite, from :attr:`CaseModel.first_not_finite`."""
    pieces = world_size * accum_steps
    if first > pieces:
        return f"a gradient is not finite in step {step} after its {pieces} piece(s)"
    rank, micro = divmod(int(first) - 1, accum_steps)
    return (f"the loss is not finite in step {step}, piece {int(first)}/{pieces} (rank "
            f"{rank}, micro-step {micro})")


class CaseModel(ABC):
    """A model under one strategy at world size ``world_size``, from the initial state."""

    #: One process plays every rank, so it compares every tensor.
    plays_every_rank = False
    #: Every rank holds a shard of every parameter, so it compares its shard of each.
    shards_parameters = False
    #: The reduction is DDP's bucketed all-reduce (see harness/check/fix.py).
    reduces_in_buckets = False

    @classmethod
    def unavailable(cls, placement: Placement) -> str | None:
        """Why the strategy cannot run on this placement (the rows' status), or None."""
        return None

    def __init__(self, setup: Setup, model: nn.Module, world_size: int, device: torch.device,
                 group: dist.ProcessGroup | None) -> None:
        self.setup, self.world_size, self.device, self.group = setup, world_size, device, group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.inner = model
        self.param_names, self.buffer_names = state_names(self.inner)
        self.compared = self.compared_parts(model, world_size, self.rank)
        #: Each parameter's rows (dim 0) before any wrapper shards it.
        self.rows = {name: p.shape[0] for name, p in model.named_parameters() if p.dim() > 0}
        self.module = self.wrap(self.inner)
        self.optimizer = make_optimizer(
            setup, [p for p in self.module.parameters() if p.requires_grad])
        self.micro_step = default_micro_step(setup)
        #: The first piece (1..N*k) of the step whose loss was not finite, N*k + 1 where
        #: only a gradient was, inf where all was finite: see :func:`not_finite_message`.
        self.first_not_finite = math.inf
        #: Whether the GradScaler skips this step on this rank (see WholeStep.skips).
        self.scaler_skips = False
        self.whole = WholeStep(setup, self.module, self.optimizer, device)

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
        pieces = self.world_size * accum_steps
        self.first_not_finite = math.inf
        for micro in range(accum_steps):
            where = MicroStep(micro, accum_steps, self.world_size, samples, window)
            for rank in self.ranks_played():
                micro_batch = batches.piece(window, per_piece, rank, accum_steps, micro)
                with self.sync(micro, accum_steps), self.playing(rank):
                    loss = self.loss_for_backward(micro_batch, where)
                    self.whole.backward(loss)
                if not_finite(loss):
                    self.first_not_finite = min(self.first_not_finite,
                                                rank * accum_steps + micro + 1)
        self.reduce_played()
        # Gradients once per step: they accumulate, so a NaN stays once it is in. Under a
        # GradScaler a scaled gradient may overflow: the scaler skips that step itself.
        if math.isinf(self.first_not_finite) and self.whole.scaler is None and any(
                not_finite(self.local(p.grad)) for p in self.inner.parameters()):
            self.first_not_finite = pieces + 1
        self.whole.before_step(where)
        self.scaler_skips = self.whole.skips(self.local(p.grad) for p in self.inner.parameters())

    def playing(self, rank: int) -> contextlib.AbstractContextManager:
        """Around the piece of rank ``rank`` (one process playing several ranks: each
        must see only its own gradients)."""
        return contextlib.nullcontext()

    def reduce_played(self) -> None:  # noqa: B027 -- a hook only local fills in
        """After the step's last backward: what the reduction across played ranks does."""

    def loss_for_backward(self, micro_batch: Any, where: MicroStep) -> torch.Tensor:
        with self.whole.forward():
            return self.micro_step(self.module, micro_batch, where)

    def step(self) -> None:
        self.whole.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ---------------------------------------------------------------- comparing
    def ranks_agree(self, point: str) -> bool | None:
        """Whether every rank holds the same gradients (``grad``) or parameters
        (``params``); None where ranks are not meant to (one process, or shards)."""
        return None

    @classmethod
    def compared_parts(cls, model: nn.Module, world_size: int, rank: int) -> dict[str, Rows]:
        """The tensors (parameters and buffers) rank ``rank`` compares, with the
        rows it compares of each (None: all). Whole tensors are dealt out to the ranks by
        size (:func:`deal`); a sharding strategy compares its shard of every parameter."""
        params, buffers = state_names(model)
        names = [*params, *buffers]
        if cls.plays_every_rank:
            return dict.fromkeys(names)
        state = named_state(model)
        owners = deal([state[name].numel() for name in names], world_size)
        parts: dict[str, Rows] = {name: None for name, owner in zip(names, owners, strict=True)
                                  if owner == rank}
        if cls.shards_parameters:
            for name in params:
                shape = state[name].shape
                parts[name] = shard_rows(shape[0], world_size, rank) if shape else None
        return parts

    def local(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's part of a (possibly sharded) tensor."""
        return tensor

    def reference_part(self, reference: torch.Tensor | None, name: str, first_row: int = 0
                       ) -> torch.Tensor | None:
        """The part of a reference tensor (kept from row ``first_row`` on) that matches
        :meth:`local`."""
        return reference

    def sharded(self, name: str) -> bool:
        return False

    def grad_pairs(self, ref: ReferenceStep) -> list[Pair]:
        params = dict(self.inner.named_parameters())
        return [Pair(name, self.local(params[name].grad),
                     self.reference_part(ref.grads[name], name, ref.first_rows.get(name, 0)))
                for name in self.param_names if name in self.compared]

    def update_pairs(self, ref: ReferenceStep, names: Sequence[str]) -> list[Pair]:
        """The tensors ``names`` (parameters or buffers) after the step, as updates from
        where the reference started it: the shared starting point would otherwise dominate."""
        state = named_state(self.inner)
        pairs = []
        for name in names:
            if name not in self.compared:
                continue
            first_row = ref.first_rows.get(name, 0)
            pairs.append(Pair(name, self.local(state[name].detach()),
                              self.reference_part(ref.after[name], name, first_row),
                              origin=self.reference_part(ref.before[name], name, first_row)))
        return pairs
