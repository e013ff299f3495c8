"""The precision a row is judged at.

A float64 check of a loss that casts to float32 (Hugging Face's causal-LM loss calls
``logits.float()``) rounds like float32 in every case: judged at float64's tolerance,
every row would read ``differs`` at a residual of ~1e-8. So a row's tolerance follows
the lowest precision the computation really had: the model's type, the autocast type,
and the type of every loss the user's functions returned, reference and case alike.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from harness.check.setup import Setup
from harness.tolerances import FLOAT32_ROUNDING, check_tolerance


def lowest(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The floating type with the coarsest rounding (largest machine epsilon)."""
    return max((d for d in dtypes if d.is_floating_point), key=lambda d: torch.finfo(d).eps)


def case_precision(run_dtype: torch.dtype, setup: Setup,
                   loss_dtypes: Iterable[torch.dtype | None]) -> torch.dtype:
    """The lowest of the model's type, the autocast type and the losses' types."""
    found = [run_dtype, *(d for d in loss_dtypes if d is not None)]
    if setup.autocast is not None:
        found.append(setup.autocast)
    return lowest(found)


def tolerance(dtype: torch.dtype) -> float:
    """The check's tolerance of ``dtype``; a type it has none for (float8, say) is judged
    at the coarsest it has."""
    try:
        return check_tolerance(dtype)
    except ValueError:
        return check_tolerance(torch.bfloat16)


def coarser_than_float32(dtype: torch.dtype) -> bool:
    """bfloat16, float16 and the float8 types: rounding that float32 resolves."""
    return torch.finfo(dtype).eps > torch.finfo(torch.float32).eps


def above_float32_rounding(dtype: torch.dtype, residual: float, point: str) -> bool:
    """A float32 step off by more than float32's rounding can leave (``FLOAT32_ROUNDING``),
    though within its tolerance: not known to be the big batch's step."""
    bound = FLOAT32_ROUNDING.get(point) if dtype == torch.float32 else None
    return bound is not None and residual > bound
