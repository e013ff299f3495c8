"""A classifier with cross-entropy and AdamW: check that its step on 1 or 2 ranks, with 1 or 2
micro-steps each, is the big-batch step.

    grad-check --nproc 2 examples.readme_check:make_setup
"""

import torch
from torch import nn

from harness.check import Setup


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank; built on the CPU
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch `step`: the whole big batch of that optimizer step, the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(32, 10, generator=generator)
    return x, torch.randint(0, 3, (32,), generator=generator)


def loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return nn.functional.cross_entropy(model(x), y)


def make_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=loss,
                 make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                 name="classifier-adamw")
