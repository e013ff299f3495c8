"""A small CNN with BatchNorm on scikit-learn's 8x8 digits (the data the training study
uses). BatchNorm normalizes each micro-batch by its own mean and variance, so no
split of the batch gives the big batch's gradient: the check finds the BatchNorm
tensors worst and suggests SyncBatchNorm / GroupNorm. ``make_groupnorm_setup`` is the
same model with GroupNorm, which normalizes each sample alone: equal everywhere.

Both give ``loss_terms`` (the summed cross-entropy and the number of digits). With
GroupNorm the big-batch reference is then spread over the ranks in chunks; BatchNorm
in training mode normalizes each chunk by its own statistics, so no chunks add up to the
big batch: its rows say ``reference=whole: BatchNorm ...`` and the reference is computed
on the whole global batch, as without ``loss_terms``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from harness.check import Setup
from harness.studies.training.data import digits_arrays

#: Digits per global batch: divisible by N x k for N <= 2 and k in 1, 2, 4.
BATCH = 16
CHANNELS = 4


@lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The training study's digits (pixels scaled to 0..1), in float32."""
    images, labels = digits_arrays()
    return images.float(), labels


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = digits()
    start = step * BATCH
    return images[start:start + BATCH], labels[start:start + BATCH]


def make_cnn(norm: type[nn.Module] | None = None) -> nn.Module:
    torch.manual_seed(0)
    normalization = (nn.BatchNorm2d(CHANNELS) if norm is None
                     else nn.GroupNorm(2, CHANNELS))
    return nn.Sequential(nn.Conv2d(1, CHANNELS, 3, padding=1), normalization, nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(CHANNELS * 16, 10))


def loss(model: nn.Module, data) -> torch.Tensor:
    images, labels = data
    return nn.functional.cross_entropy(model(images), labels)


def loss_terms(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    images, labels = data
    return nn.functional.cross_entropy(model(images), labels, reduction="sum"), len(labels)


def make_setup() -> Setup:
    return Setup(make_model=make_cnn, batch=batch, loss=loss, loss_terms=loss_terms,
                 name="digits-cnn-batchnorm")


def make_groupnorm_setup() -> Setup:
    return Setup(make_model=lambda: make_cnn(nn.GroupNorm), batch=batch, loss=loss,
                 loss_terms=loss_terms, name="digits-cnn-groupnorm")
