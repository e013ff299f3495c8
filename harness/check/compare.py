"""Measured vs reference, tensor by tensor, with only scalars crossing ranks.

Each rank hands in the pairs it owns (DDP: every N-th tensor; FSDP: its shard of every
parameter and the matching slice of the reference) and the names of every tensor, in
the same order on every rank. Per tensor it sums dot products in float64; one
all-reduce of those scalars gives the least-squares scale ``measured ~ s * reference``
over the whole model, a second (the residual needs ``s``) the part no scale explains.
Differences are computed directly, never as a difference of two norms, so that a
1e-16 error is not buried under the rounding of 1.0 - 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.fit import ScaleFit, equivalence_verdict
from harness.tolerances import ZERO_NORM
from harness.verdicts import Equivalence

#: Elements per chunk when a tensor is cast to float64: the cast then costs a few
#: megabytes, whatever the size of the model's largest tensor.
CHUNK = 1 << 20
#: Tensors named in a row's ``worst_tensors``.
WORST = 3


@dataclass(frozen=True)
class Pair:
    """One tensor (or this rank's shard of it) and its reference; None reads as zeros.
    With an ``origin``, both are compared as differences from it (updates), taken chunk
    by chunk so that no difference of a whole model is ever held at once."""

    name: str
    measured: torch.Tensor | None
    reference: torch.Tensor | None
    origin: torch.Tensor | None = None


@dataclass(frozen=True)
class Comparison:
    fit: ScaleFit
    verdict: Equivalence
    #: Every tensor's relative error after the fitted scale, by name.
    errors: dict[str, float]

    @property
    def worst(self) -> tuple[tuple[str, float], ...]:
        """The :data:`WORST` largest errors, worst first (ties in model order)."""
        ranked = sorted(self.errors.items(), key=lambda item: -item[1])
        return tuple(ranked[:WORST])

    @property
    def scale(self) -> float:
        return self.fit.scale

    @property
    def residual(self) -> float:
        return self.fit.residual


def _chunks(pair: Pair) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Matching float64 chunks of the pair's two tensors (zeros standing in for None),
    minus the origin's chunk where there is one."""
    like = pair.measured if pair.measured is not None else pair.reference
    flat_m = (pair.measured if pair.measured is not None
              else torch.zeros_like(like)).detach().reshape(-1)
    flat_r = (pair.reference if pair.reference is not None
              else torch.zeros_like(like)).detach().reshape(-1)
    flat_o = pair.origin.detach().reshape(-1) if pair.origin is not None else None
    if flat_m.numel() != flat_r.numel():
        raise ValueError(f"{pair.name}: cannot compare {flat_m.numel()} elements with "
                         f"{flat_r.numel()}")
    for start in range(0, flat_m.numel(), CHUNK):
        m = flat_m[start:start + CHUNK].to(torch.float64)
        r = flat_r[start:start + CHUNK].to(torch.float64)
        if flat_o is not None:
            o = flat_o[start:start + CHUNK].to(torch.float64)
            m, r = m - o, r - o
        yield m, r


def _dots(pair: Pair) -> list[float]:
    """[m.r, r.r, m.m] of one pair."""
    sums = [0.0, 0.0, 0.0]
    for m, r in _chunks(pair):
        sums[0] += float(m @ r)
        sums[1] += float(r @ r)
        sums[2] += float(m @ m)
    return sums


def _residual_sq(pair: Pair, scale: float) -> float:
    """||m - s r||^2 of one pair."""
    total = 0.0
    for m, r in _chunks(pair):
        total += float((m - scale * r).square().sum())
    return total


def _summed(rows: torch.Tensor, group: dist.ProcessGroup | None,
            device: torch.device) -> torch.Tensor:
    """``rows`` summed over the ranks of ``group`` (as is without one)."""
    if group is None:
        return rows
    on_device = rows.to(device)
    dist.all_reduce(on_device, group=group)
    return on_device.cpu()


def compare(pairs: Sequence[Pair], names: Sequence[str], group: dist.ProcessGroup | None,
            device: torch.device, rtol: float) -> Comparison:
    """Fit and judge; every rank of ``group`` calls it with its own pairs (a collective)."""
    index = {name: i for i, name in enumerate(names)}
    dots = torch.zeros(len(names), 3, dtype=torch.float64)
    for pair in pairs:
        if pair.measured is not None or pair.reference is not None:
            dots[index[pair.name]] += torch.tensor(_dots(pair), dtype=torch.float64)
    dots = _summed(dots, group, device)
    mr, rr, mm = (float(dots[:, i].sum()) for i in range(3))
    scale = mr / rr if rr > ZERO_NORM**2 else math.nan
    residuals = torch.zeros(len(names), dtype=torch.float64)
    if not math.isnan(scale):
        for pair in pairs:
            if pair.measured is not None or pair.reference is not None:
                residuals[index[pair.name]] += _residual_sq(pair, scale)
    residuals = _summed(residuals, group, device)
    norm = math.sqrt(mm)
    residual = (math.sqrt(float(residuals.sum())) / norm if norm > ZERO_NORM
                else (0.0 if not math.isnan(scale) else math.nan))
    fit = ScaleFit(scale=scale, residual=residual)
    errors = _tensor_errors(names, residuals, dots[:, 1], dots[:, 2], scale)
    return Comparison(fit, equivalence_verdict(fit, rtol), errors)


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
