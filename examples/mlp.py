"""A plain MLP on random regression data: the recipe everyone expects to work.

- ``make_setup``: mean squared error (a mean over the micro-batch) and the default
  micro-step ``loss / k``: equal to the big batch under every strategy, N and k.
- ``make_sum_setup``: the same with a *summed* loss: each rank's k micro-batches give
  ``sum / k`` and DDP averages the N ranks, so the gradient is ``1 / (N*k)`` of the big
  batch's sum -- scaled, and the check says by how much and what to multiply.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.check import Setup

SAMPLES, FEATURES, HIDDEN = 16, 6, 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, x[:, :2].sin() + 0.1 * torch.randn(SAMPLES, 2, generator=generator)


def mean_loss(model: nn.Module, data) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(model(x), y)


def sum_loss(model: nn.Module, data) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(model(x), y, reduction="sum")


def make_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=mean_loss, name="mlp-mean")


def make_sum_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=sum_loss, name="mlp-sum")


def make_adam_setup() -> Setup:
    """Two Adam steps: the comparison follows the optimizer's state across steps."""
    return Setup(make_model=make_model, batch=batch, loss=mean_loss, steps=2,
                 make_optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
                 name="mlp-adam")
