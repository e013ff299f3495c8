"""The models the studies train, and the notion of "which device am I on".

Seed 001's model multiplies its output by ``device.index + 1``: every device
computes a different function, so the gradient each device produces differs and
a sum over devices can never be mistaken for a mean. The harness generalises
that index to a *device slot*: the replica index under DataParallel, the rank
under DDP, read through :func:`current_device_slot`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import nn

#: Set by the strategies around a forward pass. Threads start with an empty
#: context, which is why real DataParallel (one thread per GPU) falls back to the
#: tensor's device index below -- exactly what seed 001 reads.
_DEVICE_SLOT: ContextVar[int | None] = ContextVar("device_slot", default=None)

NORMS = ("none", "batchnorm", "groupnorm", "syncbatchnorm")


@contextlib.contextmanager
def device_slot(index: int) -> Iterator[None]:
    """Run the enclosed forward passes as if on device ``index``."""
    token = _DEVICE_SLOT.set(index)
    try:
        yield
    finally:
        _DEVICE_SLOT.reset(token)


def current_device_slot(x: torch.Tensor) -> int:
    """The device slot of the forward pass computing on ``x``."""
    slot = _DEVICE_SLOT.get()
    if slot is not None:
        return slot
    if x.is_cuda:
        return x.device.index
    return 0


class SeedToyModel(nn.Module):
    """Seed 001's model: ``y = x.reshape(b, -1) @ (w.reshape(-1, 2) * (slot + 1))``.

    ``w`` is a parameter here (the seed kept it as a plain tensor attribute);
    either way DataParallel sums what the replicas send back into it. With
    ``per_device_factor=False`` the factor is 1 everywhere (the seed's
    experiments 2 and 3).
    """

    def __init__(self, weight: torch.Tensor, per_device_factor: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(weight.clone())
        self.uses_device_slot = per_device_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = current_device_slot(x) + 1 if self.uses_device_slot else 1
        return x.reshape(len(x), -1) @ (self.w.reshape(-1, 2) * extra)


def make_norm(norm: str, features: int) -> nn.Module:
    """A normalization layer over ``features`` channels, by name (see NORMS)."""
    if norm == "none":
        return nn.Identity()
    if norm == "batchnorm":
        return nn.BatchNorm1d(features)
    if norm == "syncbatchnorm":
        return nn.SyncBatchNorm(features)
    if norm == "groupnorm":
        # Two groups: statistics per sample, so micro-batching cannot change them.
        return nn.GroupNorm(2, features)
    raise ValueError(f"unknown norm {norm!r}; allowed: {', '.join(NORMS)}")


class MLP(nn.Module):
    """Linear -> norm -> tanh -> linear. Smooth, so gradients have no kinks to hide in."""

    uses_device_slot = False

    def __init__(self, inputs: int, hidden: int, outputs: int, norm: str = "none") -> None:
        super().__init__()
        self.hidden = nn.Linear(inputs, hidden)
        self.norm = make_norm(norm, hidden)
        self.out = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.hidden(x))))


class TokenMLP(nn.Module):
    """The MLP applied to every position of a (batch, time, features) sequence."""

    uses_device_slot = False

    def __init__(self, inputs: int, hidden: int, outputs: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(inputs, hidden)
        self.out = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


@torch.no_grad()
def initialize(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Overwrite every parameter from ``generator``, layer by layer.

    Linear: weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2). Norm layers: affine
    weights 1 + N(0, 0.1^2) and biases N(0, 0.1^2) -- near identity but not at
    it, so that their gradients are not trivially symmetric. Written out rather
    than left to torch's default init so that the same seed gives the same
    weights on every rank, run and torch version.
    """
    norms = (nn.BatchNorm1d, nn.GroupNorm, nn.SyncBatchNorm)
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            _fill(layer.weight, generator, std=layer.in_features ** -0.5)
            _fill(layer.bias, generator, std=0.1)
        elif isinstance(layer, norms):
            _fill(layer.weight, generator, std=0.1, mean=1.0)
            _fill(layer.bias, generator, std=0.1)
        elif any(True for _ in layer.parameters(recurse=False)):
            raise TypeError(f"initialize() has no rule for {type(layer).__name__}")
    return module


def _fill(param: torch.Tensor, generator: torch.Generator, std: float, mean: float = 0.0
          ) -> None:
    param.copy_(mean + std * torch.randn(param.shape, generator=generator, dtype=torch.float64))
