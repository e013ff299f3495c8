"""Tensors on disk that ranks write and read by the slice, so that a comparison never needs
a whole model in one process.

A *tensor file* holds named tensors, whole, each as its raw bytes in its own type at an
aligned offset of ``<stem>.bin``, described by ``<stem>.index.pt`` (plain lists and
numbers: ``torch.load(weights_only=True)`` reads it). A run that shards its tensors
writes them without gathering: each rank writes the pieces it holds (:class:`Piece`, a
run of the flattened tensor from one element on) at their places, and one rank writes the
index; a rank holding whole tensors writes them whole. A reader maps the file and takes
each piece's matching slice (:func:`matching`): a view of the file's pages, not a copy in
the process's memory.

Each rank then compares its own pieces with the matching slices through the engine's
:func:`harness.check.compare.compare` over its process group: the float64 dot products of
every piece are summed over the ranks, as the chunked reference combines its shares, and
every rank ends with the same fit. A comparison travels between processes as plain
numbers (:func:`recorded`, :func:`comparison_of`), its verdict taken where the tolerance is
known.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.check.compare import Comparison, Pair
from harness.fit import ScaleFit, equivalence_verdict

#: Each tensor's bytes start at a multiple of this (any type's size divides it).
ALIGN = 64
INDEX_SUFFIX, DATA_SUFFIX = ".index.pt", ".bin"


@dataclass(frozen=True)
class Piece:
    """``tensor``: elements ``start`` .. ``start + numel`` of the flattened tensor ``name``."""

    name: str
    start: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its shape, type and where its bytes start (None: absent)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def entries(specs: Sequence[tuple[str, Sequence[int], torch.dtype, bool]]) -> list[Entry]:
    """Where each tensor ``(name, shape, dtype, present)`` lies in the file, in order."""
    found, offset = [], 0
    for name, shape, dtype, present in specs:
        entry = Entry(name, tuple(int(n) for n in shape), dtype, offset if present else None)
        found.append(entry)
        if present:
            size = entry.numel * torch.empty((), dtype=dtype).element_size()
            offset += -(-size // ALIGN) * ALIGN
    return found


def write_index(stem: Path, found: Sequence[Entry]) -> None:
    """The file's index, written whole under a temporary name, then renamed."""
    plain = [[e.name, list(e.shape), str(e.dtype).removeprefix("torch."), e.offset]
             for e in found]
    temporary = stem.with_name(f".{stem.name}{INDEX_SUFFIX}.{os.getpid()}.tmp")
    torch.save(plain, temporary)
    os.replace(temporary, stem.with_name(stem.name + INDEX_SUFFIX))


def read_index(stem: Path) -> dict[str, Entry]:
    plain = torch.load(stem.with_name(stem.name + INDEX_SUFFIX), weights_only=True)
    return {name: Entry(name, tuple(shape), getattr(torch, dtype), offset)
            for name, shape, dtype, offset in plain}


def exists(stem: Path) -> bool:
    return stem.with_name(stem.name + INDEX_SUFFIX).exists()


def write_pieces(stem: Path, found: Sequence[Entry], pieces: Sequence[Piece]) -> None:
    """Each piece's bytes at its place (every rank its own pieces, into the same file)."""
    by_name = {entry.name: entry for entry in found}
    handle = os.open(stem.with_name(stem.name + DATA_SUFFIX), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for piece in pieces:
            entry = by_name[piece.name]
            if entry.offset is None or not piece.tensor.numel():
                continue
            flat = piece.tensor.detach().reshape(-1).to(entry.dtype).cpu().contiguous()
            size = flat.element_size()
            data = memoryview(flat.view(torch.uint8).numpy())
            written, at = 0, entry.offset + piece.start * size
            while written < len(data):
                written += os.pwrite(handle, data[written:], at + written)
    finally:
        os.close(handle)


class Mapped:
    """A tensor file opened for slices: each a view of the mapped file, read on use."""

    def __init__(self, stem: Path) -> None:
        self.index = read_index(stem)
        path = stem.with_name(stem.name + DATA_SUFFIX)
        size = path.stat().st_size if path.exists() else 0
        # Copy on write: torch wants a writable array; nothing is written back.
        self.data = np.memmap(path, dtype=np.uint8, mode="c") if size else None

    def slice(self, name: str, start: int, numel: int) -> torch.Tensor | None:
        entry = self.index[name]
        if entry.offset is None or self.data is None:
            return None
        size = torch.empty((), dtype=entry.dtype).element_size()
        first = entry.offset + start * size
        raw = torch.from_numpy(self.data[first:first + numel * size])
        return raw.view(entry.dtype)

    def whole(self, name: str) -> torch.Tensor | None:
        entry = self.index[name]
        found = self.slice(name, 0, entry.numel)
        return None if found is None else found.reshape(entry.shape)


def matching(pieces: Sequence[Piece], reference: Mapped,
             origin: Mapped | None = None) -> list[Pair]:
    """Each piece with the reference's matching slice (and the origin's: updates)."""
    def on_device(found: torch.Tensor | None, piece: Piece) -> torch.Tensor | None:
        return None if found is None else found.to(piece.tensor.device)

    return [Pair(piece.name, piece.tensor.reshape(-1),
                 on_device(reference.slice(piece.name, piece.start, piece.tensor.numel()),
                           piece),
                 on_device(origin.slice(piece.name, piece.start, piece.tensor.numel()), piece)
                 if origin is not None else None)
            for piece in pieces]


def recorded(comparison: Comparison) -> dict[str, Any]:
    """A comparison as plain numbers (its verdict left to :func:`comparison_of`)."""
    return {"fit": [comparison.fit.scale, comparison.fit.residual],
            "errors": dict(comparison.errors), "nothing": comparison.nothing}


def comparison_of(record: dict[str, Any], rtol: float) -> Comparison:
    """The comparison :func:`recorded` wrote, judged at ``rtol``."""
    scale, residual = record["fit"]
    fit = ScaleFit(scale=float(scale), residual=float(residual))
    return Comparison(fit, equivalence_verdict(fit, rtol), dict(record["errors"]),
                      bool(record["nothing"]))
