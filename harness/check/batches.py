"""A user's batch, taken apart the way each strategy feeds it.

A batch is a tensor or a tuple/list/dict of them (nested freely, other values passed
as they are); every tensor's first dimension is the sample dimension. Rank r of N
gets the contiguous r-th N-th of the global batch, and cuts it into k micro-batches
in order: piece (r, j) is samples ``[(r*k + j)*m, (r*k + j + 1)*m)`` with
``m = B / (N*k)``. That is what a DistributedSampler-free loop with contiguous
shards does, and any other order only permutes which rank sees which samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from harness.errors import UsageError


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it, the structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {key: map_tensors(value, fn) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        mapped = [map_tensors(value, fn) for value in batch]
        # Named tuples rebuild from positional fields; plain tuples and lists from a list.
        if hasattr(batch, "_fields"):
            return type(batch)(*mapped)
        return type(batch)(mapped)
    return batch


def tensors_of(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(batch, found.append)
    return found


def sample_count(batch: Any, where: str) -> int:
    """Samples in ``batch``: the first dimension every tensor in it shares."""
    tensors = tensors_of(batch)
    if not tensors:
        raise UsageError(f"{where} holds no tensor; allowed: a tensor, or a tuple/list/dict "
                         "of tensors sharing their first (sample) dimension")
    sizes = {int(t.shape[0]) if t.dim() > 0 else -1 for t in tensors}
    if len(sizes) != 1 or -1 in sizes:
        shown = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise UsageError(f"{where}: its tensors do not share a first (sample) dimension "
                         f"(shapes {shown}); allowed: every tensor of shape (B, ...)")
    return sizes.pop()


def pieces_needed(samples: int, world_size: int, accum_steps: int, drop_last: bool,
                  where: str) -> int:
    """Samples per micro-batch when ``samples`` are cut into N x k pieces; refuses a
    remainder unless ``drop_last`` (then the last ``samples mod N*k`` are left out)."""
    pieces = world_size * accum_steps
    per_piece, left_over = divmod(samples, pieces)
    if per_piece == 0:
        raise UsageError(f"{where} has {samples} samples, fewer than N x k = {world_size} x "
                         f"{accum_steps} = {pieces} pieces; allowed: at least one sample per "
                         "piece (a larger batch, or smaller --world-sizes/--accum-steps)")
    if left_over and not drop_last:
        raise UsageError(f"{where} has {samples} samples, which do not split evenly into N x k "
                         f"= {world_size} x {accum_steps} = {pieces} pieces: {left_over} "
                         f"sample(s) would be dropped; pass --drop-last to drop them, or give "
                         f"a batch size divisible by {pieces}")
    return per_piece


def take(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start..stop-1`` of every tensor in ``batch`` (views, no copy)."""
    return map_tensors(batch, lambda t: t[start:stop])


def piece(batch: Any, per_piece: int, rank: int, accum_steps: int, micro: int) -> Any:
    """Micro-batch ``micro`` of rank ``rank``: see the module's docstring."""
    start = (rank * accum_steps + micro) * per_piece
    return take(batch, start, start + per_piece)


def prepared(batch: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """Floating tensors cast to the run's dtype, every tensor on the run's device;
    integer tensors (token ids, labels, masks) keep their type."""
    return map_tensors(batch, lambda t: t.to(device=device, dtype=dtype)
                       if t.is_floating_point() else t.to(device))


def batch_sum(batch: Any) -> float:
    """A number that changes when the batch does: ranks compare it to be sure that
    ``batch(i)`` gave each of them the same samples."""
    return float(sum(float(t.detach().double().abs().sum()) for t in tensors_of(batch)))
