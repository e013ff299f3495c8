"""The measurement model: fit a measured gradient as a scalar multiple of a reference.

For one case, ``g`` is what lands in ``param.grad``. Two references explain it:
``sum_r g_r`` (each device's gradient of its own shard alone, summed) and
``g_full`` (one process, the whole global batch). A least-squares fit
``g ~ w * ref`` gives the weight ``w`` and a relative residual that says whether
*any* scale explains ``g`` at all (BatchNorm and uneven shards are where none does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.tolerances import ZERO_NORM, close
from harness.verdicts import Combination, Equivalence, Reduction


@dataclass(frozen=True)
class ScaleFit:
    """``measured ~ scale * reference`` by least squares."""

    scale: float
    #: ||measured - scale * reference|| / ||measured||: 0 when a pure scale explains it.
    residual: float


def fit_scale(measured: torch.Tensor, reference: torch.Tensor) -> ScaleFit:
    """Least-squares scale of ``reference`` that best explains ``measured``.

    Computed in float64 whatever the inputs' dtype, so that the fit adds no
    rounding of its own to what is being judged.
    """
    g = measured.detach().reshape(-1).to(torch.float64)
    ref = reference.detach().reshape(-1).to(torch.float64)
    if g.shape != ref.shape:
        raise ValueError(f"cannot fit shapes {tuple(g.shape)} and {tuple(ref.shape)}")
    ref_sq = float(ref @ ref)
    if ref_sq <= ZERO_NORM**2:
        return ScaleFit(scale=math.nan, residual=math.nan)
    scale = float(g @ ref) / ref_sq
    g_norm = float(g.norm())
    residual = float((g - scale * ref).norm()) / g_norm if g_norm > ZERO_NORM else 0.0
    return ScaleFit(scale=scale, residual=residual)


def relative_error(measured: torch.Tensor, reference: torch.Tensor) -> float:
    """||measured - reference|| / ||reference||: how far off, scale included."""
    g = measured.detach().reshape(-1).to(torch.float64)
    ref = reference.detach().reshape(-1).to(torch.float64)
    ref_norm = float(ref.norm())
    if ref_norm <= ZERO_NORM:
        return math.nan
    return float((g - ref).norm()) / ref_norm


def reduction_verdict(weight: ScaleFit, world_size: int, rtol: float) -> Reduction:
    """Name the reduction a weight fit shows: ``mean``, ``sum``, or ``other``.

    With one device, summing and averaging are the same operation; the verdict
    says so (``sum=mean``) instead of picking one arbitrarily.
    """
    if math.isnan(weight.scale) or not weight.residual <= rtol:
        return Reduction.OTHER
    is_mean = close(weight.scale, 1.0 / world_size, rtol)
    is_sum = close(weight.scale, 1.0, rtol)
    if is_mean and is_sum:
        return Reduction.SUM_EQUALS_MEAN
    if is_mean:
        return Reduction.MEAN
    if is_sum:
        return Reduction.SUM
    return Reduction.OTHER


def equivalence_verdict(fit: ScaleFit, rtol: float) -> Equivalence:
    """Compare a gradient with its big-batch reference: ``matches``, ``scaled`` or ``differs``."""
    if math.isnan(fit.scale) or not fit.residual <= rtol:
        return Equivalence.DIFFERS
    return Equivalence.MATCHES if close(fit.scale, 1.0, rtol) else Equivalence.SCALED


def combination_verdict(value: float, parts: list[float], rtol: float) -> Combination:
    """What ``value`` is of the contributions ``parts``: their sum, their mean, or neither."""
    if not parts:
        return Combination.UNRECORDED
    if close(value, sum(parts), rtol):
        return Combination.SUM
    if close(value, sum(parts) / len(parts), rtol):
        return Combination.MEAN
    return Combination.NEITHER
