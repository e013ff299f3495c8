"""Recipes: how a training loop turns N devices x k micro-steps of b samples into one update.

Notation (Goyal et al. 2017 write k workers of n samples; here N devices, k
micro-steps per optimizer step, b samples per device per micro-step):

- ``mean``: ``loss = terms.mean()`` over what this process's forward saw
  (DDP/FSDP: its own b samples; DataParallel: the N*b gathered samples);
- ``mean/k``: the same divided by k (the textbook accumulation recipe);
- ``sum``: ``terms.sum()``;
- ``sum/b``: the sum divided by the per-device micro-batch b -- Goyal's
  "normalize the per-worker loss by n";
- ``sum/(N*k*b)``: the sum divided by every sample of the window on every
  device -- Goyal's "normalize by the total minibatch kn", right when the
  reduction *sums*.

The reference is always one process, the window's N*k*b samples in one batch,
``loss = terms.mean()``, one backward, the same optimizer and learning rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.seeding import generator_for
from harness.tasks import Batch, RegressionTask

#: Samples per device per micro-step (b).
MICRO_BATCH = 4
#: The model and data of every experiment but bf16's: the 4-8-2 MLP whose inputs
#: come from a different distribution on each device, so devices' gradients differ.
TASK = RegressionTask()

LOSSES = ("mean", "mean/k", "sum", "sum/b", "sum/(N*k*b)")
#: One optimizer step per batch (k = 1): what changes with N devices.
DEVICE_LOSSES = ("mean", "sum", "sum/b", "sum/(N*k*b)")
#: k micro-steps per optimizer step: what changes with accumulation.
ACCUMULATION_LOSSES = ("mean/k", "mean", "sum/(N*k*b)")


@dataclass(frozen=True)
class Shape:
    """How many samples a window has and how they are laid out."""

    world_size: int
    accum_steps: int
    micro_batch: int = MICRO_BATCH

    @property
    def window_samples(self) -> int:
        return self.world_size * self.accum_steps * self.micro_batch


def recipe_loss(loss: str, terms: torch.Tensor, shape: Shape) -> torch.Tensor:
    """The loss a recipe backpropagates for one micro-step, from this process's loss terms
    (one per sample along dim 0; further dims: independent runs, one loss each)."""
    losses: dict[str, Callable[[], torch.Tensor]] = {
        "mean": lambda: terms.mean(0),
        "mean/k": lambda: terms.mean(0) / shape.accum_steps,
        "sum": lambda: terms.sum(0),
        "sum/b": lambda: terms.sum(0) / shape.micro_batch,
        "sum/(N*k*b)": lambda: terms.sum(0) / shape.window_samples,
    }
    try:
        return losses[loss]()
    except KeyError:
        raise ValueError(f"unknown loss {loss!r}; allowed: {', '.join(LOSSES)}") from None


def l2_penalty(parameters, coefficient: float, accum_steps: int) -> torch.Tensor:
    """``coefficient / 2 * ||p||^2``, split over the k micro-steps so that a window adds
    it once (each device adds it, and the average over devices keeps it once)."""
    return sum(p.pow(2).sum() for p in parameters) * (coefficient / 2 / accum_steps)


def losses_for(accum_steps: int) -> tuple[str, ...]:
    return DEVICE_LOSSES if accum_steps == 1 else ACCUMULATION_LOSSES


def windows(seed: int, shape: Shape, count: int, dtype: torch.dtype, key: str = "update-data"
            ) -> list[list[list[Batch]]]:
    """[window][micro-step][device] shards of b samples; device d draws from its own
    distribution. The same for every strategy and recipe of a shape: all are compared
    on identical samples."""
    generator = generator_for(seed, key, shape.world_size, shape.accum_steps, shape.micro_batch)
    return [[[TASK.make_shard(shape.micro_batch, device, generator, dtype)
              for device in range(shape.world_size)]
             for _ in range(shape.accum_steps)]
            for _ in range(count)]


def big_batch(window: list[list[Batch]]) -> Batch:
    """Every sample of a window (all micro-steps, all devices) as one batch."""
    return Batch.cat([shard for shards in window for shard in shards])


def initial_model(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """The same initial weights in every case of the study."""
    return TASK.build_model(generator_for(seed, "update-model"), dtype)
