"""harness/check/shards.py: tensors written by the piece, read by the slice, compared by
the piece with the same numbers as whole.

Two "ranks" each write their half of every tensor into one file; the file then holds each
tensor whole, and the engine's compare of every rank's pieces against the matching
slices (their sums added, as the ranks' all-reduce adds them) gives the fit of the whole
tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.check import shards
from harness.check.compare import Pair, compare
from harness.check.shards import Piece


def tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 3, generator=generator, dtype=torch.float64),
            "b": torch.randn(7, generator=generator).to(torch.bfloat16),
            "missing": None}


def halves(named: dict[str, torch.Tensor | None]) -> list[list[Piece]]:
    """Rank 0's and rank 1's pieces: the first and the second half of each tensor."""
    ranks: list[list[Piece]] = [[], []]
    for name, tensor in named.items():
        if tensor is None:
            continue
        flat, half = tensor.reshape(-1), tensor.numel() // 2
        ranks[0].append(Piece(name, 0, flat[:half]))
        ranks[1].append(Piece(name, half, flat[half:]))
    return ranks


def specs(named):
    return [(name, tuple(t.shape) if t is not None else (), t.dtype if t is not None
             else torch.float32, t is not None) for name, t in named.items()]


def test_pieces_written_by_each_rank_read_back_whole_in_their_own_types(tmp_path):
    named = tensors(0)
    found = shards.entries(specs(named))
    assert all(e.offset % shards.ALIGN == 0 for e in found if e.offset is not None)
    stem = tmp_path / "optimizer0.step0.grad"
    for pieces in reversed(halves(named)):  # rank 1 first: the order does not matter
        shards.write_pieces(stem, found, pieces)
    shards.write_index(stem, found)
    mapped = shards.Mapped(stem)
    assert torch.equal(mapped.whole("w"), named["w"])
    assert mapped.whole("b").dtype == torch.bfloat16 and torch.equal(mapped.whole("b"),
                                                                       named["b"])
    assert mapped.whole("missing") is None
    assert torch.equal(mapped.slice("w", 4, 3), named["w"].reshape(-1)[4:7])


def test_pieces_compared_rank_by_rank_give_the_whole_tensors_fit(tmp_path):
    reference, origin = tensors(1), tensors(2)
    stems = {}
    for label, named in (("reference", reference), ("origin", origin)):
        stems[label] = tmp_path / label
        found = shards.entries(specs(named))
        for pieces in halves(named):
            shards.write_pieces(stems[label], found, pieces)
        shards.write_index(stems[label], found)
    measured = {"w": 2 * reference["w"] + 1e-3 * reference["w"].cos(),
                "b": (2 * reference["b"].double()).to(torch.bfloat16), "missing": None}
    names = list(reference)
    pairs = [pair for pieces in halves(measured) for pair in shards.matching(
        pieces, shards.Mapped(stems["reference"]), shards.Mapped(stems["origin"]))]
    by_piece = compare(pairs, names, None, torch.device("cpu"), 1e-9)
    whole = compare([Pair(name, measured[name], reference[name], origin[name])
                     for name in names], names, None, torch.device("cpu"), 1e-9)
    assert by_piece.scale == pytest.approx(whole.scale, rel=1e-12)
    assert by_piece.residual == pytest.approx(whole.residual, rel=1e-9)
    assert by_piece.errors == pytest.approx(whole.errors, rel=1e-9)
    # As plain numbers between processes, judged where the tolerance is known.
    again = shards.comparison_of(shards.recorded(by_piece), 1e-9)
    assert (again.scale, again.verdict) == (by_piece.scale, by_piece.verdict)
    assert not math.isnan(again.residual)
