"""Measured vs reference, tensor by tensor, with only scalars crossing ranks.

Each rank hands in the pairs it owns (DDP: whole tensors dealt out by size; FSDP: its
shard of every parameter and the matching slice of the reference) and the names of
every tensor, in the same order on every rank. Per tensor it sums dot products in
float64, among them ``||m - r||^2`` and ``(m - r).r`` of the difference ``m - r``
itself, in one pass that reads each element once: chunk by chunk, m and r (for updates,
each minus the origin) are converted into rows of a float64 buffer allocated once per
comparison, ``d = m - r`` is computed into a third row, and one product of the rows
with their transpose gives all the chunk's dot products. One all-reduce of those scalars
gives the least-squares scale ``measured ~ s * reference`` over the whole model and the
part no scale explains,
``||m - s r||^2 = ||m - r||^2 + 2(1 - s)(m - r).r + (1 - s)^2 ||r||^2``.
Differences are computed directly, never as a difference of two norms, so that a
1e-16 error is not buried under the rounding of 1.0 - 1.0: where the terms for a scale
other than 1 would bury it (a scale far from 1 that explains nearly everything), a
second pass over the tensors computes ``m - s r`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from harness.fit import ScaleFit, equivalence_verdict
from harness.tolerances import ZERO_NORM
from harness.verdicts import Equivalence

#: Elements per chunk when a tensor is converted to float64: the chunk's rows (m, r, d and
#: an origin, 256 KiB each) stay in the CPU's cache (2 MiB of L2 per core where this was
#: measured) while the difference and the product read them. On pairs of 50M float32
#: elements, one thread: 1 << 14 took 1.3 to 1.4 times as long, 1 << 16 1.1 to 1.2 times.
CHUNK = 1 << 15
#: Elements per chunk on an accelerator, where each chunk costs a few kernel launches of
#: microseconds each whatever its width: 32K-element chunks would leave a 100M-element
#: comparison bound by ~15,000 launches, far below the memory's speed; 4M-element chunks
#: take ~25 passes of 128 MiB of float64 rows (four rows of 32 MiB), small beside a
#: model that size on the device. Not measured on a GPU here (none was at hand): the
#: rows and the launches per chunk are what it follows from.
ACCELERATOR_CHUNK = 1 << 22
#: Tensors named in a row's ``worst_tensors``.
WORST = 3
#: Elements per tensor in a fingerprint: tensors that differ between ranks (an unseeded
#: make_model, a bucket DDP did not all-reduce) differ almost everywhere, so a strided
#: sample finds them without a float64 pass over a large model.
FINGERPRINT_SAMPLES = 1 << 16
#: A tensor's residual from the first pass's sums stands when its terms for a scale other
#: than 1 are at most this many times the residual itself: it then carries about this
#: many roundings of the residual (1e3 x 1e-16 in float64, far below any tolerance), not
#: roundings of terms that could be far larger than it. Otherwise a second pass.
CORRECTION_LIMIT = 1e3
#: ... or at most this fraction of the tensor's ||r||^2: the rounding of terms that small
#: (~1e-40 of ||r||^2) cannot move an error anybody reads.
CORRECTION_FLOOR = 1e-24
#: Where [m.r, r.r, m.m, d.d, d.r] sit in the product of the rows [m, r, d] with their
#: transpose.
GRAM_ROWS, GRAM_COLUMNS = [0, 1, 0, 2, 2], [1, 1, 0, 2, 1]


@dataclass(frozen=True)
class Pair:
    """One tensor (or this rank's shard of it) and its reference; None reads as zeros.
    With an ``origin``, both are compared as differences from it (updates), taken chunk
    by chunk so that no difference of a whole model is ever held at once."""

    name: str
    measured: torch.Tensor | None
    reference: torch.Tensor | None
    origin: torch.Tensor | None = None


def worst_tensors(errors: Iterable[tuple[str, float]], rtol: float) -> str:
    """``name=error;...``: the :data:`WORST` largest relative errors, worst first.

    An error within ``rtol`` is written 0, and ties keep the model's order: below the
    tolerance an error is rounding, which differs from one machine to the next, and the
    cell must not (grad-compare reads it as text).
    """
    judged = [(name, error if not error <= rtol else 0.0) for name, error in errors]
    ranked = sorted(judged, key=lambda item: -item[1])
    return ";".join(f"{name}={error:.3g}" for name, error in ranked[:WORST])


@dataclass(frozen=True)
class Comparison:
    fit: ScaleFit
    verdict: Equivalence
    #: Every tensor's relative error after the fitted scale, by name.
    errors: dict[str, float]
    #: Both sides were all zero: the verdict compared nothing (a loss without gradient,
    #: a step that moved no parameter).
    nothing: bool = False

    @property
    def scale(self) -> float:
        return self.fit.scale

    @property
    def residual(self) -> float:
        return self.fit.residual


def sampled_fingerprint(tensors: Iterable[torch.Tensor | None]) -> float:
    """Sum of squares of a strided sample of every tensor (None counts as nothing), in
    float64: ranks holding the same tensors get the same number."""
    total = 0.0
    for tensor in tensors:
        if tensor is not None and tensor.is_floating_point():
            flat = tensor.detach().reshape(-1)
            sample = flat[::max(1, flat.numel() // FINGERPRINT_SAMPLES)]
            total += float(torch.linalg.vector_norm(sample, dtype=torch.float64)) ** 2
    return total


def same_on_every_rank(values: Sequence[float], group: dist.ProcessGroup | None,
                       device: torch.device) -> bool:
    """Whether every rank of ``group`` (a collective) handed in the same values."""
    high = torch.tensor(list(values), dtype=torch.float64, device=device)
    low = -high.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MAX, group=group)
    return torch.equal(high, -low)


class _Chunk(NamedTuple):
    """Views of the first columns of the rows, made once per width: each view costs
    Python a microsecond or two, as much as converting a few thousand elements."""

    m: torch.Tensor
    r: torch.Tensor
    d: torch.Tensor
    origin: torch.Tensor
    updates: torch.Tensor  # [m, r]: what an origin is taken from
    compared: torch.Tensor  # [m, r, d]
    compared_t: torch.Tensor


class _Rows:
    """The float64 rows a pair's chunks are converted into: allocated once per comparison
    and refilled with ``copy_`` (a conversion that allocates nothing), as wide as the
    largest tensor's chunk. A fresh allocation per chunk costs more than filling it (its
    pages are new each time), and rows in one buffer take all their dot products in one
    BLAS call."""

    def __init__(self, pairs: Sequence[Pair]) -> None:
        self.width = max(1, min(chunk_width(pairs), max((_size(pair) for pair in pairs),
                                                        default=0)))
        self._buffer: torch.Tensor | None = None
        self._whole: _Chunk | None = None

    def chunk(self, device: torch.device, width: int) -> _Chunk:
        """Rows m, r, d and the origin's, ``width`` elements each, on ``device``."""
        if self._buffer is None or self._buffer.device != device:
            self._buffer = torch.empty(4, self.width, dtype=torch.float64, device=device)
            self._whole = self._views(self._buffer)
        if width == self.width:
            return self._whole
        return self._views(self._buffer[:, :width])

    @staticmethod
    def _views(rows: torch.Tensor) -> _Chunk:
        compared = rows[:3]
        return _Chunk(*rows.unbind(0), rows[:2], compared, compared.T)


def chunk_width(pairs: Sequence[Pair]) -> int:
    """Elements per chunk: the CPU's cache-sized :data:`CHUNK`, or, where a pair's tensors
    are on an accelerator, :data:`ACCELERATOR_CHUNK`."""
    on_accelerator = any(tensor is not None and tensor.device.type != "cpu"
                         for pair in pairs for tensor in (pair.measured, pair.reference))
    return ACCELERATOR_CHUNK if on_accelerator else CHUNK


def _size(pair: Pair) -> int:
    like = pair.measured if pair.measured is not None else pair.reference
    return like.numel() if like is not None else 0


def _flat(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.detach().reshape(-1) if tensor is not None else None


def _filled(pair: Pair, rows: _Rows, difference: bool = True) -> Iterator[_Chunk]:
    """The pair chunk by chunk, as rows m, r, d of float64 with d = m - r computed itself
    where ``difference`` asks for it (zeros standing in for None; with an origin, m and r
    are differences from it). The next chunk overwrites them."""
    flat_m, flat_r, flat_o = _flat(pair.measured), _flat(pair.reference), _flat(pair.origin)
    size = _size(pair)
    if flat_m is not None and flat_r is not None and flat_m.numel() != flat_r.numel():
        raise ValueError(f"{pair.name}: cannot compare {flat_m.numel()} elements with "
                         f"{flat_r.numel()}")
    device = (flat_m if flat_m is not None else flat_r).device
    for start in range(0, size, rows.width):
        stop = min(start + rows.width, size)
        chunk = rows.chunk(device, stop - start)
        _convert(chunk.m, flat_m, start, stop)
        _convert(chunk.r, flat_r, start, stop)
        if flat_o is not None:
            chunk.origin.copy_(flat_o[start:stop])
            chunk.updates.sub_(chunk.origin)
        if difference:
            torch.sub(chunk.m, chunk.r, out=chunk.d)
        yield chunk


def _convert(row: torch.Tensor, flat: torch.Tensor | None, start: int, stop: int) -> None:
    """``row`` filled with float64 copies of ``flat[start:stop]`` (zeros for None)."""
    if flat is None:
        row.zero_()
    else:
        row.copy_(flat[start:stop])


def _sums(pair: Pair, rows: _Rows | None = None) -> torch.Tensor:
    """[m.r, r.r, m.m, d.d, d.r] of one pair, with d = m - r, in float64: one pass that
    reads each element once, and one product of the chunk's rows [m, r, d] with their
    transpose for all the dot products."""
    rows = rows if rows is not None else _Rows([pair])
    gram = None
    for chunk in _filled(pair, rows):
        if gram is None:
            gram = chunk.compared @ chunk.compared_t
        else:
            gram.addmm_(chunk.compared, chunk.compared_t)
    if gram is None:
        return torch.zeros(5, dtype=torch.float64)
    return gram[GRAM_ROWS, GRAM_COLUMNS].cpu()


def _residual_sq(pair: Pair, scale: float, rows: _Rows | None = None) -> float:
    """||m - s r||^2 of one pair, the second pass."""
    rows = rows if rows is not None else _Rows([pair])
    total = None
    for chunk in _filled(pair, rows, difference=False):
        left = torch.add(chunk.m, chunk.r, alpha=-scale, out=chunk.d)
        total = left @ left if total is None else total.add_(left @ left)
    return float(total) if total is not None else 0.0


def _residuals(pairs: Sequence[Pair], index: dict[str, int], sums: torch.Tensor, scale: float,
               group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """Each tensor's ||m - s r||^2, from the sums where they are precise enough for it."""
    _, rr, _, dd, dr = sums.unbind(dim=1)
    off = 1.0 - scale
    correction = (2 * off * dr).abs() + off * off * rr
    residuals = (dd + 2 * off * dr + off * off * rr).clamp(min=0.0)
    if bool((correction <= CORRECTION_LIMIT * residuals + CORRECTION_FLOOR * rr).all()):
        return residuals
    residuals = torch.zeros(len(index), dtype=torch.float64)
    rows = _Rows(pairs)
    for pair in pairs:
        if pair.measured is not None or pair.reference is not None:
            residuals[index[pair.name]] += _residual_sq(pair, scale, rows)
    return _summed(residuals, group, device)


def _summed(rows: torch.Tensor, group: dist.ProcessGroup | None,
            device: torch.device) -> torch.Tensor:
    """``rows`` summed over the ranks of ``group`` (as is without one)."""
    if group is None:
        return rows
    on_device = rows.to(device)
    dist.all_reduce(on_device, group=group)
    return on_device.cpu()


def _model_sums(pairs: Sequence[Pair], index: dict[str, int], group: dist.ProcessGroup | None,
                device: torch.device) -> torch.Tensor:
    """Each tensor's :func:`_sums`, a row per name, summed over the ranks of ``group``."""
    sums = torch.zeros(len(index), 5, dtype=torch.float64)
    rows = _Rows(pairs)
    for pair in pairs:
        if pair.measured is not None or pair.reference is not None:
            sums[index[pair.name]] += _sums(pair, rows)
    return _summed(sums, group, device)


def compare(pairs: Sequence[Pair], names: Sequence[str], group: dist.ProcessGroup | None,
            device: torch.device, rtol: float) -> Comparison:
    """Fit and judge; every rank of ``group`` calls it with its own pairs (a collective)."""
    index = {name: i for i, name in enumerate(names)}
    sums = _model_sums(pairs, index, group, device)
    mr, rr, mm = (float(sums[:, i].sum()) for i in range(3))
    scale = mr / rr if rr > ZERO_NORM**2 else math.nan
    if rr <= ZERO_NORM**2 and mm <= ZERO_NORM**2:
        scale = 1.0  # both zero (a warm-up from lr 0, a step both skipped): the same
    residuals = (_residuals(pairs, index, sums, scale, group, device)
                 if not math.isnan(scale) else torch.zeros(len(names), dtype=torch.float64))
    norm = math.sqrt(mm)
    residual = (math.sqrt(float(residuals.sum())) / norm if norm > ZERO_NORM
                else (0.0 if not math.isnan(scale) else math.nan))
    fit = ScaleFit(scale=scale, residual=residual)
    errors = _tensor_errors(names, residuals, sums[:, 1], sums[:, 2], scale)
    nothing = rr <= ZERO_NORM**2 and mm <= ZERO_NORM**2
    return Comparison(fit, equivalence_verdict(fit, rtol), errors, nothing)


def compare_each(pairs: Sequence[Pair], names: Sequence[str], exact: set[str],
                 group: dist.ProcessGroup | None, device: torch.device,
                 rtol: float) -> Comparison:
    """Each tensor against its own reference at scale 1, no scale fitted: buffers are not
    gradients (a sample counter and a running mean share no scale with each other or with
    the weights), so each must match by itself. Tensors in ``exact`` (integer counters)
    must be equal; the others within ``rtol``. A collective, as :func:`compare`."""
    sums = _model_sums(pairs, {name: i for i, name in enumerate(names)}, group, device)
    _, rr, mm, dd, _ = sums.unbind(dim=1)
    errors = {}
    for i, name in enumerate(names):
        left, expected = math.sqrt(float(dd[i])), math.sqrt(float(rr[i]))
        errors[name] = (left / expected if expected > ZERO_NORM
                        else (math.inf if left > 0 else 0.0))
    agree = all(error <= (0.0 if name in exact else rtol) for name, error in errors.items())
    norm = math.sqrt(float(mm.sum()))
    left = math.sqrt(float(dd.sum()))
    residual = left / norm if norm > ZERO_NORM else (math.inf if left > 0 else 0.0)
    verdict = Equivalence.MATCHES if agree else Equivalence.DIFFERS
    return Comparison(ScaleFit(scale=1.0, residual=residual), verdict, errors)


def _tensor_errors(names: Sequence[str], residuals: torch.Tensor, ref_sq: torch.Tensor,
                   measured_sq: torch.Tensor, scale: float) -> dict[str, float]:
    """Each tensor's ||m - s r|| / ||s r||: what the model-wide scale leaves unexplained
    in it. A uniformly scaled case leaves ~0 everywhere; BatchNorm leaves its own."""
    errors = {}
    for i, name in enumerate(names):
        if math.isnan(scale):
            error = math.inf if float(measured_sq[i]) > 0 else 0.0
        else:
            expected = abs(scale) * math.sqrt(float(ref_sq[i]))
            left = math.sqrt(float(residuals[i]))
            error = left / expected if expected > ZERO_NORM else (math.inf if left > 0 else 0.0)
        errors[name] = error
    return errors
