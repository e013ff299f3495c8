"""A model with a branch its forward never takes (an auxiliary head left switched off).

The unused head gets no gradient. One process does not mind; DDP (with its default
``find_unused_parameters=False``) waits for that gradient before it all-reduces the
bucket holding it, so the bucket is never reduced and each rank keeps its own local
gradient. ``make_find_unused_setup`` passes ``find_unused_parameters=True``.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.mlp import batch, mean_loss
from harness.check import Setup


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 2)
        self.aux_head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TwoHeads()


def make_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=mean_loss, name="unused-branch")


def make_find_unused_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=mean_loss,
                 ddp_options={"find_unused_parameters": True},
                 name="unused-branch-find-unused")
