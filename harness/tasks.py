"""Tasks: a model, the batches it trains on, and the loss over them.

A task knows how to make one *shard* (the samples one device sees) for a given
device slot, and how to turn a model output into per-element loss terms. The
loss of a batch is the mean (or sum) of those terms; that single definition is
what every strategy and every reference computes, so any difference between
them comes from the strategy, never from two spellings of the loss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from harness.models import MLP, SeedToyModel, TokenMLP, initialize

LOSS_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class Batch:
    """Inputs, targets and (for sequences) the mask of real positions."""

    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def elements(self) -> int:
        """Number of loss terms: tokens for sequences, samples otherwise."""
        return int(self.mask.sum()) if self.mask is not None else len(self)

    def to(self, device: torch.device) -> Batch:
        mask = None if self.mask is None else self.mask.to(device)
        return Batch(self.x.to(device), self.y.to(device), mask)

    def chunk(self, chunks: int) -> list[Batch]:
        """Split along dim 0 as DataParallel's scatter does: ``torch.chunk`` sizes,
        i.e. ceil(B / chunks) per chunk and possibly *fewer* than ``chunks`` chunks."""
        xs, ys = self.x.chunk(chunks), self.y.chunk(chunks)
        masks = self.mask.chunk(chunks) if self.mask is not None else [None] * len(xs)
        return [Batch(x, y, m) for x, y, m in zip(xs, ys, masks, strict=True)]

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive pieces of the given sizes along dim 0."""
        xs, ys = self.x.split(list(sizes)), self.y.split(list(sizes))
        masks = self.mask.split(list(sizes)) if self.mask is not None else [None] * len(xs)
        return [Batch(x, y, m) for x, y, m in zip(xs, ys, masks, strict=True)]

    @staticmethod
    def cat(batches: Sequence[Batch]) -> Batch:
        mask = None
        if batches[0].mask is not None:
            mask = torch.cat([b.mask for b in batches])
        return Batch(torch.cat([b.x for b in batches]), torch.cat([b.y for b in batches]), mask)


def reduce_terms(terms: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return terms.mean()
    if reduction == "sum":
        return terms.sum()
    raise ValueError(f"unknown loss reduction {reduction!r}; allowed: {', '.join(LOSS_REDUCTIONS)}")


class Task(ABC):
    """A model family, its data, and its per-element loss."""

    name: str
    #: One line for tables and the README.
    description: str

    @abstractmethod
    def build_model(self, generator: torch.Generator, dtype: torch.dtype) -> nn.Module: ...

    @abstractmethod
    def make_shard(self, size: int, slot: int, generator: torch.Generator,
                   dtype: torch.dtype) -> Batch: ...

    @abstractmethod
    def loss_terms(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        """One loss term per element (sample or token), as a 1-D tensor."""

    def loss(self, output: torch.Tensor, batch: Batch, reduction: str) -> torch.Tensor:
        return reduce_terms(self.loss_terms(output, batch), reduction)


class ToyTask(Task):
    """Seed 001's model and loss ``(z.sum(1) - 1)``, on random inputs of shape (b, 1, 2, 2)."""

    name = "toy"
    description = "seed 001's linear model, output scaled by device slot + 1"

    def build_model(self, generator: torch.Generator, dtype: torch.dtype) -> nn.Module:
        weight = torch.randn(2, 2, 2, generator=generator, dtype=torch.float64)
        return SeedToyModel(weight).to(dtype)

    def make_shard(self, size: int, slot: int, generator: torch.Generator,
                   dtype: torch.dtype) -> Batch:
        x = torch.randn(size, 1, 2, 2, generator=generator, dtype=torch.float64)
        return Batch(x.to(dtype), torch.zeros(size, dtype=dtype))

    def loss_terms(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        return output.sum(1) - 1


class RegressionTask(Task):
    """A small MLP regressing a fixed nonlinear target; each device slot draws its
    inputs from its own distribution (mean = slot, spread = 1 + slot / 2), so the
    per-device gradients differ even for a model that ignores the slot."""

    name = "mlp"
    description = "4-8-2 MLP, inputs drawn per device from N(slot, 1 + slot/2)"
    inputs, hidden, outputs = 4, 8, 2

    def __init__(self, norm: str = "none") -> None:
        self.norm = norm
        if norm != "none":
            self.name = f"mlp-{norm}"
            self.description = f"4-8-2 MLP with {norm} after the first layer"

    def build_model(self, generator: torch.Generator, dtype: torch.dtype) -> nn.Module:
        model = MLP(self.inputs, self.hidden, self.outputs, self.norm)
        return initialize(model.to(torch.float64), generator).to(dtype)

    def make_shard(self, size: int, slot: int, generator: torch.Generator,
                   dtype: torch.dtype) -> Batch:
        x = slot + (1.0 + 0.5 * slot) * torch.randn(size, self.inputs, generator=generator,
                                                   dtype=torch.float64)
        y = torch.stack([torch.sin(x[:, 0] - x[:, 1]), torch.tanh(x[:, 2] * x[:, 3])], dim=1)
        return Batch(x.to(dtype), y.to(dtype))

    def loss_terms(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        return 0.5 * ((output - batch.y) ** 2).sum(1)


class TokenTask(Task):
    """Variable-length sequences: every sample has 1..max_len real tokens, the loss
    has one term per real token (token-normalized, as language models train)."""

    name = "tokens"
    description = "per-token MLP on sequences of 1..6 tokens, loss per real token"
    inputs, hidden, outputs, max_len = 4, 8, 2, 6

    def build_model(self, generator: torch.Generator, dtype: torch.dtype) -> nn.Module:
        model = TokenMLP(self.inputs, self.hidden, self.outputs)
        return initialize(model.to(torch.float64), generator).to(dtype)

    def make_shard(self, size: int, slot: int, generator: torch.Generator,
                   dtype: torch.dtype) -> Batch:
        x = slot + torch.randn(size, self.max_len, self.inputs, generator=generator,
                               dtype=torch.float64)
        y = torch.stack([torch.sin(x[..., 0] - x[..., 1]), torch.tanh(x[..., 2] * x[..., 3])],
                        dim=-1)
        lengths = torch.randint(1, self.max_len + 1, (size,), generator=generator)
        mask = torch.arange(self.max_len).unsqueeze(0) < lengths.unsqueeze(1)
        return Batch(x.to(dtype), y.to(dtype), mask)

    def loss_terms(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        per_token = 0.5 * ((output - batch.y) ** 2).sum(-1)
        return per_token[batch.mask]


class LossInForward(nn.Module):
    """A model whose forward returns its own (mean) loss: DataParallel then gathers one
    scalar loss per device into a vector, and the user must reduce that vector."""

    uses_device_slot = False

    def __init__(self, model: nn.Module, task: Task) -> None:
        super().__init__()
        self.model = model
        self.task = task

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.task.loss(self.model(x), Batch(x, y), "mean")


def task_by_name(name: str) -> Task:
    tasks = {"toy": ToyTask(), "mlp": RegressionTask(), "tokens": TokenTask(),
             "mlp-batchnorm": RegressionTask("batchnorm"),
             "mlp-groupnorm": RegressionTask("groupnorm"),
             "mlp-syncbatchnorm": RegressionTask("syncbatchnorm")}
    try:
        return tasks[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; allowed: {', '.join(tasks)}") from None


def make_shards(task: Task, sizes: Sequence[int], generator: torch.Generator,
                dtype: torch.dtype, first_slot: int = 0) -> list[Batch]:
    """One shard per device slot, slot ``first_slot + i`` getting ``sizes[i]`` samples."""
    return [task.make_shard(size, first_slot + i, generator, dtype)
            for i, size in enumerate(sizes)]
