"""A user's global batches, fed to a framework as its own data loader would.

The frameworks shard and batch a *data set*; a :class:`harness.check.setup.Setup`
hands over one global batch per optimizer step, of any structure (a tensor, a
tuple/list/dict of them). The data set is then the sample indices of every step's
window, one window after the other, and a collate function takes the samples at a
micro-batch's indices from every tensor of their window: any structure, no copy of the
batch per sample. Every sharding used here (Accelerate's batch shards, a
``DistributedSampler`` without shuffling, DeepSpeed's rank slices) keeps a window's
samples within its N x k micro-batches, so that each optimizer step trains on its own
global batch.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.adapters.registry import Job
from harness.check import batches

#: The label of a padded position: torch's cross-entropy and HF models ignore it.
IGNORE = -100


class Samples:
    """``collate_fn``: a list of sample indices of the data set -> those samples of their
    window, counting what step 0's window trained on."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def __call__(self, indices: list[int]) -> Any:
        window = self.job.window_of(indices[0])
        chosen = torch.as_tensor([i % self.job.samples for i in indices], dtype=torch.long)
        batch = batches.map_tensors(window, lambda tensor: tensor[chosen])
        if indices[0] < self.job.samples:
            self.job.capture.tokens += items(batch)
        return batch


def data_set(job: Job) -> list[int]:
    """Every step's window, as sample indices, in order."""
    return list(range(job.samples * job.setup.steps))


def items(micro_batch: Any) -> int:
    """What a micro-batch trains on: its real tokens (labels other than -100) for a dict
    batch with ``labels``, else its samples."""
    if isinstance(micro_batch, dict) and isinstance(micro_batch.get("labels"), torch.Tensor):
        return int(micro_batch["labels"].ne(IGNORE).sum())
    return batches.sample_count(micro_batch, "micro-batch")


def rank_micro_batches(job: Job, rank: int) -> list:
    """Rank ``rank``'s k micro-batches of every window as a DistributedSampler deals them
    (samples r, r+N, ... of each window), for a framework that takes batches from the
    user's own loop (DeepSpeed)."""
    take, size, world = Samples(job), job.micro_batch_size, job.world_size
    micro_batches = []
    for step in range(job.setup.steps):
        first = step * job.samples
        mine = list(range(first + rank, first + job.samples, world))
        micro_batches += [take(mine[start:start + size]) for start in range(0, len(mine), size)]
    return micro_batches


def label_counts(window: Any) -> tuple[int, int]:
    """The window's labels other than :data:`IGNORE`: all of them, and those after the
    causal shift (``labels[..., 1:]``, the tokens a causal LM predicts)."""
    if not isinstance(window, dict) or "labels" not in window:
        return 0, 0
    labels = window["labels"]
    return int(labels.ne(IGNORE).sum()), int(labels[..., 1:].ne(IGNORE).sum())
