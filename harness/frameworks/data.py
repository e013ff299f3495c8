"""A user's global batch, fed to a framework as its own data loader would.

The frameworks shard and batch a *data set*; a :class:`harness.check.setup.Setup`
hands over one global batch of any structure (a tensor, a tuple/list/dict of them).
The data set is then the batch's sample indices, and a collate function takes the
samples at a micro-batch's indices from every tensor: any structure, no copy of the
batch per sample.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.check import batches

#: The label of a padded position: torch's cross-entropy and HF models ignore it.
IGNORE = -100


class Samples:
    """``collate_fn``: a list of sample indices -> those samples of the global batch."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __call__(self, indices: list[int]) -> Any:
        chosen = torch.as_tensor(indices, dtype=torch.long)
        return batches.map_tensors(self.batch, lambda tensor: tensor[chosen])


def micro_batch_size(batch: Any, world_size: int, accum_steps: int) -> int:
    """Samples per micro-batch: the global batch cut into N x k pieces (validated before)."""
    return batches.sample_count(batch, "batch(0)") // (world_size * accum_steps)


def used_samples(batch: Any, world_size: int, accum_steps: int) -> int:
    """Samples one window trains on: N x k micro-batches (a remainder is left out)."""
    return micro_batch_size(batch, world_size, accum_steps) * world_size * accum_steps


def items(micro_batch: Any) -> int:
    """What a micro-batch trains on: its real tokens (labels other than -100) for a dict
    batch with ``labels``, else its samples."""
    if isinstance(micro_batch, dict) and isinstance(micro_batch.get("labels"), torch.Tensor):
        return int(micro_batch["labels"].ne(IGNORE).sum())
    return batches.sample_count(micro_batch, "micro-batch")


def rank_micro_batches(batch: Any, rank: int, world_size: int, accum_steps: int) -> list:
    """Rank ``rank``'s k micro-batches as a DistributedSampler deals them (samples r, r+N,
    ...), for a framework that takes batches from the user's own loop (DeepSpeed)."""
    size = micro_batch_size(batch, world_size, accum_steps)
    mine = list(range(rank, used_samples(batch, world_size, accum_steps), world_size))
    take = Samples(batch)
    return [take(mine[start:start + size]) for start in range(0, len(mine), size)]
