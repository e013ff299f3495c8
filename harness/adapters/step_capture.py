"""What a framework handed the optimizer, captured at the optimizer's own ``step``.

Every framework ends in ``torch.optim.Optimizer.step`` (Lightning and DeepSpeed hand
it a closure or flat partitions; Accelerate and transformers wrap it). Wrapping that
one method on the user's optimizer object sees, on every framework alike, the
gradient the update is about to use, the learning rate it uses, and the weights the
update produced. The losses backpropagated are watched too: their type is part of the
precision a row is judged at.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from harness.strategies.common import float64_vector


@dataclass
class CapturedStep:
    """One optimizer step: flat float64 vectors in the model's trainable-parameter order."""

    #: The gradient right before the step.
    grad: torch.Tensor
    #: The learning rate of each parameter group as the step used it.
    lrs: tuple[float, ...]
    #: The weights right after it (None until the step has run).
    params: torch.Tensor | None = None


@dataclass
class StepCapture:
    """One rank's view of the optimizer steps a framework took."""

    steps: list[CapturedStep] = field(default_factory=list)
    #: Real tokens (or samples) this rank trained on in step 0's window.
    tokens: int = 0
    #: Floating types of the losses backpropagated (a float32 loss rounds like float32
    #: whatever the model's type).
    loss_dtypes: set[torch.dtype] = field(default_factory=set)

    @property
    def step_count(self) -> int:
        return len(self.steps)


def watch_step(optimizer: torch.optim.Optimizer, capture: StepCapture,
               grads: Callable[[], Iterable[torch.Tensor]],
               params: Callable[[], Iterable[torch.Tensor]]) -> None:
    """Wrap ``optimizer.step`` so that ``capture`` records ``grads()`` and the learning
    rates before each step and ``params()`` after it.

    A closure (Lightning passes the last micro-step's forward and backward as one) is
    run first, as ``step`` itself would, so that the gradient read is the one the
    update uses. Plain SGD calls its closure exactly once, so this changes nothing.
    """
    original = optimizer.step

    def step(_self, closure=None, **kwargs):
        if closure is not None:
            with torch.enable_grad():
                closure()
        taken = CapturedStep(float64_vector(grads()),
                             tuple(float(group["lr"]) for group in optimizer.param_groups))
        result = original(**kwargs)
        taken.params = float64_vector(params())
        capture.steps.append(taken)
        return result

    # A bound method, as the original: an LR scheduler built on the optimizer afterwards
    # wraps ``optimizer.step.__func__``.
    optimizer.step = types.MethodType(step, optimizer)


def parameter_grads(module: torch.nn.Module) -> Callable[[], list[torch.Tensor]]:
    """``param.grad`` of every trainable parameter (zeros where a framework left none)."""
    return lambda: [p.grad if p.grad is not None else torch.zeros_like(p)
                    for p in module.parameters() if p.requires_grad]


def parameter_values(module: torch.nn.Module) -> Callable[[], list[torch.Tensor]]:
    return lambda: [p for p in module.parameters() if p.requires_grad]


@contextlib.contextmanager
def watching_losses(capture: StepCapture) -> Iterator[None]:
    """While active, every ``Tensor.backward`` records its tensor's type in ``capture``
    (the frameworks call it on the loss: Accelerate's, Lightning's and DeepSpeed's
    backward too)."""
    original = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        if self.is_floating_point():
            capture.loss_dtypes.add(self.dtype)
        return original(self, *args, **kwargs)

    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = original

