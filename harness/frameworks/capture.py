"""What a framework handed the optimizer, captured at the optimizer's own ``step``.

Every framework ends in ``torch.optim.Optimizer.step`` (Lightning and DeepSpeed hand
it a closure or flat partitions; Accelerate and transformers wrap it). Wrapping that
one method on the user's optimizer object sees, on every framework alike, the
gradient the update is about to use and the weights the update produced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from harness.strategies.common import float64_vector


@dataclass
class StepCapture:
    """One rank's view of the optimizer steps a framework took."""

    #: The gradient right before the (last) step, flattened in the model's parameter order.
    grad: torch.Tensor | None = None
    #: The weights right after it.
    params: torch.Tensor | None = None
    #: Optimizer steps taken: one window of k micro-steps must give exactly one.
    steps: int = 0
    #: Real tokens this rank trained on (its share of the global batch).
    tokens: int = 0
    notes: list[str] = field(default_factory=list)


def watch_step(optimizer: torch.optim.Optimizer, capture: StepCapture,
               grads: Callable[[], Iterable[torch.Tensor]],
               params: Callable[[], Iterable[torch.Tensor]]) -> None:
    """Wrap ``optimizer.step`` so that ``capture`` records ``grads()`` before each step and
    ``params()`` after it.

    A closure (Lightning passes the last micro-step's forward and backward as one) is
    run first, as ``step`` itself would, so that the gradient read is the one the
    update uses. Plain SGD calls its closure exactly once, so this changes nothing.
    """
    original = optimizer.step

    def step(closure=None, **kwargs):
        if closure is not None:
            with torch.enable_grad():
                closure()
        capture.grad = float64_vector(grads())
        result = original(**kwargs)
        capture.params = float64_vector(params())
        capture.steps += 1
        return result

    optimizer.step = step


def parameter_grads(module: torch.nn.Module) -> Callable[[], list[torch.Tensor]]:
    """``param.grad`` of every trainable parameter (zeros where a framework left none)."""
    return lambda: [p.grad if p.grad is not None else torch.zeros_like(p)
                    for p in module.parameters() if p.requires_grad]


def parameter_values(module: torch.nn.Module) -> Callable[[], list[torch.Tensor]]:
    return lambda: [p for p in module.parameters() if p.requires_grad]


def gather_captures(capture: StepCapture) -> list[StepCapture] | None:
    """Every rank's capture on rank 0 (None elsewhere): the ranks must agree."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, capture)
    return everyone if dist.get_rank() == 0 else None
