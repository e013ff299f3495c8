"""Setups of tests/test_check.py, in a module of their own.

Ranks that grad-check's ``--nproc`` starts import the module a target names, each for
itself: this one imports what a user's setup would (torch and ``harness.check``), not
the test module's pandas and pytest.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.check import Setup


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def _mse(model: nn.Module, data) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(model(x), y)


def _samples(count: int):
    def batch(step: int):
        generator = torch.Generator().manual_seed(step)
        return torch.randn(count, 3, generator=generator), torch.randn(count, 1,
                                                                        generator=generator)
    return batch


def _squared_errors(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    x, y = data
    return nn.functional.mse_loss(model(x), y, reduction="sum"), y.numel()


def make_odd_setup() -> Setup:
    """15 samples: 3 left over at N x k = 4, dropped with --drop-last (so the cases use
    15, 14 or 12 of them: three chunked references, computed by the ranks together)."""
    return Setup(make_model=_linear, batch=_samples(15), loss=_mse, loss_terms=_squared_errors,
                 name="odd-batch")


def make_dropout_setup() -> Setup:
    return Setup(make_model=lambda: nn.Sequential(nn.Linear(3, 1), nn.Dropout(0.5)),
                 batch=_samples(8), loss=_mse)


def make_functional_dropout_setup() -> Setup:
    """Randomness the module scan cannot see: found by the reference's second forward."""
    def loss(model: nn.Module, data) -> torch.Tensor:
        x, y = data
        return nn.functional.mse_loss(nn.functional.dropout(model(x), 0.5), y)

    return Setup(make_model=_linear, batch=_samples(8), loss=loss)


def make_meta_setup() -> Setup:
    return Setup(make_model=lambda: nn.Linear(3, 1, device="meta"), batch=_samples(8),
                 loss=_mse)


def make_not_a_setup() -> dict:
    return {"make_model": _linear}


not_callable = 42
