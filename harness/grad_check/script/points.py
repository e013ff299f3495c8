"""Each point the capture reads (a step's gradient, the parameters after it, an
optimizer's initial parameters), written by the reference or compared with it, shard by
shard: no rank ever holds a whole model it did not hold already.

The reference's first run writes every point to disk once, in its own types: each rank
the pieces it holds into one tensor file per optimizer, step and point
(harness/check/shards.py), rank 0 its index. Every other run (the reference's second,
then each split) is told that run's folder (wire.py :data:`REFERENCE_VARIABLE`) and compares each
point as it reads it: each rank its own pieces against the matching slices of the
reference's file (parameters as updates from the reference's parameters before the
step), with the engine's ``compare`` over the ranks' process group, which sums every
rank's float64 dot products; every rank records the same fit, as plain numbers, and the
launcher judges it at the precision both runs used (harness/grad_check/script/split_judge.py).
What a rank holds beyond its own shard is a bounded buffer: the reference's slices are
views of the mapped file.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from harness.check import shards
from harness.check.compare import compare, compare_each
from harness.check.memory import peak_tensor_bytes
from harness.check.shards import Piece
from harness.check.step import not_finite as holds_not_finite
from harness.grad_check.script.files import tensors_file
from harness.grad_check.script.guard import waiting_in_exchange
from harness.grad_check.script.wire import MEMORY_VARIABLE, PointFit

#: (name, shape, dtype, present) of each whole tensor (harness/check/shards.py entries).
Spec = tuple[str, Sequence[int], torch.dtype, bool]


def group() -> dist.ProcessGroup | None:
    """The ranks that combine their sums (None: this process alone)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def device_of(pieces: Sequence[Piece], sharded: bool = True) -> torch.device:
    """Where the sums meet: the pieces' device, a GPU under nccl."""
    if sharded and group() is not None and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return pieces[0].tensor.device if pieces else torch.device("cpu")


def squares(pieces: Sequence[Piece], sharded: bool) -> float:
    """The summed squares of the pieces: every rank's where each holds its own shard (a
    collective), else this rank's."""
    total = torch.zeros(1, dtype=torch.float64, device=device_of(pieces, sharded))
    for piece in pieces:
        if piece.tensor.is_floating_point() and piece.tensor.numel():
            total += torch.linalg.vector_norm(piece.tensor.detach(), dtype=torch.float64) ** 2
    if sharded and group() is not None:
        with waiting_in_exchange("a gradient norm's sum over the ranks"):
            dist.all_reduce(total, group=group())
    return float(total.cpu())


def not_finite(pieces: Sequence[Piece]) -> list[str]:
    """The tensors of ``pieces`` holding a NaN or an infinity, in order: nothing equals
    them, not even the same run again, so a comparison of theirs says nothing."""
    return list(dict.fromkeys(piece.name for piece in pieces
                              if piece.tensor.is_floating_point()
                              and holds_not_finite(piece.tensor)))


def norm(pieces: Sequence[Piece], sharded: bool) -> float:
    return math.sqrt(squares(pieces, sharded))


@dataclass(frozen=True)
class Points:
    """Where this run's points go: ``folder`` (written: this run is the reference) or
    compared with the reference's first run in ``against``."""

    folder: Path
    against: Path | None
    rank: int

    def done(self, optimizer: int, step: int, point: str, specs: Sequence[Spec],
             pieces: Sequence[Piece], sharded: bool) -> PointFit | None:
        """The point written, or compared (its record; None where the reference has no
        such point: it took fewer steps). ``sharded``: each rank holds its own shard,
        and all compare together; else rank 0 compares its whole tensors alone."""
        if self.against is None:
            stem = tensors_file(self.folder, optimizer, step, point)
            found = shards.entries(specs)
            if sharded or self.rank == 0:
                shards.write_pieces(stem, found, pieces)
            if self.rank == 0:
                shards.write_index(stem, found)
            return None
        if point == "initial" or not (sharded or self.rank == 0):
            return None
        ranks = group() if sharded else None
        # Every rank compares together: one that waits here reached this point of the step.
        what = "gradient" if point == "grad" else "parameters"
        with (waiting_in_exchange(f"step {step}'s {what} comparison") if ranks is not None
              else contextlib.nullcontext()):
            return self.compare_with_reference(optimizer, step, point, specs, pieces, ranks)

    def compare_with_reference(self, optimizer: int, step: int, point: str, specs: Sequence[Spec],
                 pieces: Sequence[Piece], ranks: dist.ProcessGroup | None
                 ) -> PointFit | None:
        if os.environ.get(MEMORY_VARIABLE) != "1":
            return compared(self.against, optimizer, step, point, specs, pieces, ranks)
        found: list[PointFit | None] = []
        peak = peak_tensor_bytes(lambda: found.append(compared(
            self.against, optimizer, step, point, specs, pieces, ranks)))
        if found[0] is None:
            return None
        return replace(found[0], memory={"work": peak, "pieces": sum(
            p.tensor.numel() * p.tensor.element_size() for p in pieces)})


def compared(against: Path, optimizer: int, step: int, point: str, specs: Sequence[Spec],
             pieces: Sequence[Piece], ranks: dist.ProcessGroup | None) -> PointFit | None:
    """This rank's pieces against the reference's file (every rank calls it together):
    the fit over every rank's pieces, and the residual at scale 1 (what two runs of the
    reference differ by). The reference's tensors must be ours, by name and shape."""
    stem = tensors_file(against, optimizer, step, point)
    if not shards.exists(stem):
        return None
    reference = shards.Mapped(stem)
    names = [spec[0] for spec in specs]
    if list(reference.index) != names:
        return PointFit(unmatched="holds other tensors than at the reference")
    reshaped = [name for name, shape, _, present in specs if present
                and tuple(shape) != reference.index[name].shape]
    if reshaped:
        return PointFit(unmatched=f"holds tensors of other shapes than at the reference "
                                  f"({', '.join(reshaped[:3])})")
    origin = None
    if point == "params":
        before = (tensors_file(against, optimizer, 0, "initial") if step == 0
                  else tensors_file(against, optimizer, step - 1, "params"))
        origin = shards.Mapped(before)
    pairs = shards.matching(pieces, reference, origin)
    where = device_of(pieces, ranks is not None)
    comparison = compare(pairs, names, ranks, where, 0.0)
    each = compare_each(pairs, names, set(), ranks, where, 0.0)
    return PointFit.from_json({**shards.recorded(comparison), "each": each.residual})
