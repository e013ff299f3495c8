"""Which samples a training forward fed: one fingerprint per sample, whatever the layout.

A fingerprint only explains a measured difference (harness/grad_check/script/split_judge.py): it
never turns a gradient that matches into anything else. So it is made to be the same for
the same sample at every split, and otherwise kept cheap:

- the batch axis is found, not assumed: the axis whose size is the split's micro-batch b
  (sequence-first inputs, a GRU's ``(T, b, F)``, hold their samples on axis 1);
- packed or padding-free rows (one concatenated row per micro-batch, its sequences
  delimited by ``position_ids`` restarting at 0, or by ``cu_seqlens``) are cut into their
  sequences;
- padding is not content: positions an ``attention_mask`` drops are left out, and each
  row of token ids also carries a second fingerprint and a length with the trailing run
  of its last value left out (padding to the longest row of a micro-batch, without a
  mask, as LitGPT pads), which the judge uses where that value is the step's padding
  (the lengths count a micro-batch's tokens where no ``labels`` do);
- a tensor the capture cannot read (on the meta device, say) gives no fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

#: Keyword arguments that delimit the sequences packed into one row.
PACKED_BOUNDARIES = ("cu_seqlens", "cu_seq_lens_q", "cu_seqlens_q")
#: Labels of this value are not counted (cross-entropy's default ``ignore_index``).
IGNORE_INDEX = -100


def first_tensor(value: Any, micro_batch: int | None = None) -> torch.Tensor | None:
    """The first tensor in ``value``, depth first through tuples, lists and dicts (a
    framework's wrapper may be called with the whole batch, ``[x, y]``); given the split's
    micro-batch, the first whose axis 0 or 1 has that size, where one has (a detection
    batch, a dict whose keys sort its per-box ``batch_idx`` before its ``img``)."""
    tensors = list(_tensors_in(value))
    sized = [tensor for tensor in tensors
             if micro_batch and tensor.dim() and micro_batch in tensor.shape[:2]]
    return (sized or tensors or [None])[0]


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict | tuple | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _tensors_in(item)


def readable(tensor: torch.Tensor) -> bool:
    """Whether the tensor's values can be read here (not on the meta device, not a
    tensor subclass without storage)."""
    return not tensor.is_meta and tensor.layout == torch.strided


def trains(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` is a training forward: it is in training mode, or a
    module holding parameters inside it is (a wrapper left in evaluation mode around a
    model that trains: Lightning's DDP wrapper after its sanity check)."""
    return module.training or any(inner.training for inner in module.modules()
                                  if inner._parameters)


def is_data(tensor: torch.Tensor) -> bool:
    """Whether the tensor is input data rather than an activation: nothing computed it
    with autograd. A loss module's input, or a second module's, is the first module's
    output, whose rounding depends on the batch it came with."""
    return tensor.grad_fn is None and not tensor.requires_grad


def row_fingerprint(row: torch.Tensor) -> str:
    data = row.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def batch_axis(first: torch.Tensor, micro_batch: int | None) -> int:
    """Axis 0, unless only axis 1 has the split's micro-batch size (sequence-first)."""
    if (micro_batch and first.dim() >= 2 and first.shape[0] != micro_batch
            and first.shape[1] == micro_batch):
        return 1
    return 0


def packed_boundaries(first: torch.Tensor, kwargs: dict) -> list[int] | None:
    """Where the sequences of a packed row start (ending with its length), from
    ``cu_seqlens`` or from ``position_ids`` restarting at 0; None for a row of one sample."""
    if first.dim() != 2 or first.shape[0] != 1:
        return None
    for name in PACKED_BOUNDARIES:
        bounds = kwargs.get(name)
        if isinstance(bounds, torch.Tensor) and bounds.dim() == 1 and readable(bounds):
            return [int(b) for b in bounds.cpu()]
    positions = kwargs.get("position_ids")
    if (isinstance(positions, torch.Tensor) and positions.shape == first.shape
            and readable(positions)):
        starts = torch.nonzero(positions.reshape(-1).cpu() == 0).reshape(-1).tolist()
        if len(starts) > 1 or (starts and starts[0] != 0):
            return [*starts, first.shape[1]]
    return None


def matching_mask(first: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """The call's ``attention_mask`` where it masks ``first`` position by position."""
    mask = kwargs.get("attention_mask")
    if (isinstance(mask, torch.Tensor) and first.dim() >= 2 and mask.dim() == 2
            and tuple(mask.shape) == tuple(first.shape[:2]) and readable(mask)):
        return mask
    return None


def sample_rows(first: torch.Tensor, kwargs: dict, micro_batch: int | None
                ) -> Iterator[torch.Tensor]:
    """Each sample of a forward's first tensor argument, its padding left out."""
    rows = first.detach().cpu()
    rows = rows.reshape(1) if rows.dim() == 0 else rows
    bounds = packed_boundaries(rows, kwargs)
    if bounds is not None:
        for start, end in zip(bounds, bounds[1:], strict=False):
            if end > start:
                yield rows[0, start:end]
        return
    mask = matching_mask(rows, kwargs)
    if mask is not None:  # batch-first, as the mask is
        kept = mask.detach().cpu().bool()
        for i in range(rows.shape[0]):
            yield rows[i][kept[i]]
        return
    yield from rows.movedim(batch_axis(rows, micro_batch), 0)


def trailing_run_removed(row: torch.Tensor) -> torch.Tensor:
    """``row`` without the run of its last value at its end (along its first axis)."""
    if row.dim() == 0 or row.shape[0] < 2:
        return row
    same = (row == row[-1]) if row.dim() == 1 else (row == row[-1]).reshape(row.shape[0], -1)
    same = same if same.dim() == 1 else same.all(dim=1)
    differing = torch.nonzero(~same).reshape(-1)
    return row[:int(differing[-1]) + 1] if len(differing) else row[:0]


def sample(row: torch.Tensor) -> list:
    """A sample's record: its fingerprint, the fingerprint without the trailing run of its
    last value, and that value (how the judge tells padding from content); then its length
    along its first axis, with and without that run (its tokens, padding left out)."""
    last = row.reshape(-1)[-1] if row.numel() else torch.tensor(0)
    # Padding pads token ids; a float sample's trailing values are its content.
    content = row if row.is_floating_point() else trailing_run_removed(row)
    return [row_fingerprint(row), row_fingerprint(content), row_fingerprint(last),
            int(row.shape[0]) if row.dim() else 1, int(content.shape[0]) if row.dim() else 1]


def samples_of(first: torch.Tensor, kwargs: dict, micro_batch: int | None) -> list[list]:
    return [sample(row) for row in sample_rows(first, kwargs, micro_batch)]


def labelled_count(kwargs: dict) -> int | None:
    """The tokens a call's integer ``labels`` count (those not ``ignore_index``)."""
    return counted_targets(kwargs.get("labels"), IGNORE_INDEX)


def counted_targets(targets: Any, ignored: int) -> int | None:
    """How many of integer ``targets`` are not ``ignored`` (None: not integer targets the
    capture can read; class probabilities count no labels)."""
    if (isinstance(targets, torch.Tensor) and not targets.is_floating_point()
            and readable(targets)):
        return int((targets != ignored).sum())
    return None
