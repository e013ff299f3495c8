"""What every strategy measures after a step, and small gradient helpers."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from harness.tasks import Batch, Task


def flat_grad(module: nn.Module) -> torch.Tensor:
    """All parameter gradients of ``module`` as one vector (zeros where a grad is None)."""
    parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype,
                                                                         device=p.device)
             for p in module.parameters() if p.requires_grad]
    return torch.cat(parts).detach().cpu()


def flat_params(module: nn.Module) -> torch.Tensor:
    """All parameters of ``module`` as one detached CPU vector, in ``parameters()`` order."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu()


def float64_vector(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Tensors as one detached float64 vector: what verdicts are judged on."""
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def clear_grad(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of every floating-point buffer (BatchNorm's running statistics)."""
    return {name: b.detach().cpu().clone() for name, b in module.named_buffers()
            if b.is_floating_point()}


def relative_spread(reference: torch.Tensor, others: list[torch.Tensor]) -> float:
    """Largest ||other - reference|| / ||reference||: 0 when every rank holds the same tensor."""
    ref = reference.to(torch.float64)
    norm = float(ref.norm()) or 1.0
    return max((float((o.to(torch.float64) - ref).norm()) / norm for o in others), default=0.0)


@dataclass
class StepMeasurement:
    """What one strategy left behind after a few backward passes, as seen on rank 0."""

    #: ``param.grad`` of rank 0 (flattened) after each backward pass.
    grads: list[torch.Tensor]
    #: For each device, the gradient it fed into the reduction during the first pass.
    contributions: list[torch.Tensor]
    #: Samples each device computed on (DataParallel may use fewer devices than asked).
    chunk_sizes: tuple[int, ...]
    #: Largest relative difference between any rank's ``param.grad`` and rank 0's.
    rank_spread: float = 0.0
    #: Floating-point buffers of the module after the first pass.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def devices_used(self) -> int:
        return len(self.chunk_sizes)


@dataclass(frozen=True)
class StepSpec:
    """One measured step: a model, the global batch split into per-device shards, a loss."""

    task: Task
    #: Freshly initialised model; every strategy and reference works on a deep copy.
    model: nn.Module
    #: One shard per device slot; the global batch is their concatenation.
    shards: list[Batch]
    #: 'mean' or 'sum' of the loss terms -- or, with ``loss_in_forward``, of the
    #: vector of per-device losses DataParallel gathers.
    reduction: str
    #: The model's forward returns its own mean loss (the DataParallel pitfall).
    loss_in_forward: bool = False
    #: Backward passes without zeroing in between (seed 001, experiment 3).
    backward_passes: int = 1


@dataclass
class CommCounter:
    """Collective calls and the bytes they carried, counted where they happen."""

    calls: int = 0
    bytes: int = 0

    def add(self, tensors: Sequence[torch.Tensor]) -> None:
        self.calls += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)

    def reset(self) -> None:
        self.calls = self.bytes = 0


class StrategyTrainer(ABC):
    """A model under a strategy, fed one micro-step at a time (the accumulation study's view).

    ``shards`` always holds one batch per device slot of the micro-step; each
    strategy decides what this process feeds its model: DDP its own rank's shard,
    DataParallel and one process the concatenation (DataParallel then scatters it).
    """

    #: The module whose parameters and ``.grad`` the optimizer sees.
    module: nn.Module
    #: Where this process feeds the module its batches.
    device: torch.device = torch.device("cpu")
    #: The strategy divides gradients by this (DDP: its world size); a loss normalised
    #: by the global element count is multiplied by it to give the global mean.
    average_divisor: int = 1

    def __init__(self) -> None:
        #: All-reduce calls/bytes (DDP), counted by a communication hook.
        self.allreduce = CommCounter()
        #: Reduce-add calls/bytes into device 0 (DataParallel's backward).
        self.reduce_add = CommCounter()

    def batch_for_this_process(self, shards: Sequence[Any]) -> Any:
        from harness.tasks import Batch

        return Batch.cat(shards).to(self.device)

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip the gradient reduction of the enclosed backward (DDP); a no-op elsewhere."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:  # noqa: B027 -- optional hook, most strategies need none
        """Called after every micro-step's backward (real DataParallel counts its reduce-add)."""

    def chunk_sizes(self, batch: Any) -> tuple[int, ...]:
        """Samples each device computes on for ``batch`` (this process's batch)."""
        return (len(batch),)

    def grads_of_every_rank(self) -> list[torch.Tensor] | None:
        """``param.grad`` of every rank, on rank 0 (None on the others)."""
        return [flat_grad(self.module)]

    def reset(self, state: dict[str, torch.Tensor]) -> None:
        """Back to ``state`` with no gradient and zeroed counters, ready for the next case."""
        self.module.load_state_dict(state)
        clear_grad(self.module)
        self.allreduce.reset()
        self.reduce_add.reset()


def dataparallel_passes(spec: StepSpec, wrapper: nn.Module, model: nn.Module, batch: Any,
                        contributions: Callable[[], list[torch.Tensor]]
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """``spec``'s backward passes through a DataParallel-like ``wrapper``, the loss taken
    on the gathered output (or the gathered per-device losses reduced), as users do.

    Returns ``param.grad`` after every pass, what ``contributions()`` recorded of the
    first pass (each device's gradient, or the one gradient when a single device ran),
    and the buffers after the first pass.
    """
    grads: list[torch.Tensor] = []
    first_contributions: list[torch.Tensor] = []
    buffers: dict[str, torch.Tensor] = {}
    for step in range(spec.backward_passes):
        if spec.loss_in_forward:
            per_device = wrapper(batch.x, batch.y)
            loss = per_device.mean() if spec.reduction == "mean" else per_device.sum()
        else:
            loss = spec.task.loss(wrapper(batch.x), batch, spec.reduction)
        loss.backward()
        grads.append(flat_grad(model))
        if step == 0:
            buffers = buffers_of(model)
            first_contributions = contributions() or [grads[0]]
    return grads, first_contributions, buffers
