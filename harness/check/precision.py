"""The precision a row is judged at, and what a difference means where nothing is split.

A float64 check of a loss that casts to float32 (Hugging Face's causal-LM loss calls
``logits.float()``) rounds like float32 in every case: judged at float64's tolerance,
every row would read ``differs`` at a residual of ~1e-8. So a row's tolerance follows
the lowest precision the computation really had: the model's type, the autocast type,
and the type of every loss the user's functions returned, reference and case alike.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from harness.check.compare import Comparison
from harness.check.setup import Setup
from harness.tolerances import FLOAT32_ROUNDING, check_tolerance, dtype_name
from harness.verdicts import Equivalence


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


def unsplit_fix(point: str, comparison: Comparison, setup: Setup) -> str:
    """At N = 1, k = 1 the case feeds the whole batch to one micro-step, as the reference
    does: a difference cannot come from any split."""
    if comparison.verdict is Equivalence.MATCHES:
        return ""
    cause = ("the custom micro_step computes something other than Setup.loss (or the "
             "reference is not deterministic)" if setup.micro_step is not None else
             "the reference is not deterministic: the same loss on the same batch gave "
             "another result")
    what = {"grad": "gradient", "params": "update"}.get(point, point)
    return (f"nothing is split at N = 1, k = 1, yet the {what} differs from the big "
            f"batch's (scale {comparison.scale:.6g}, residual {comparison.residual:.3g}): "
            f"{cause}")


def coarser_than_float32(dtype: torch.dtype) -> bool:
    """bfloat16, float16 and the float8 types: rounding that float32 resolves."""
    return torch.finfo(dtype).eps > torch.finfo(torch.float32).eps


def above_float32_rounding(dtype: torch.dtype, residual: float, point: str) -> bool:
    """A float32 step off by more than float32's rounding can leave (``FLOAT32_ROUNDING``),
    though within its tolerance: not known to be the big batch's step."""
    bound = FLOAT32_ROUNDING.get(point) if dtype == torch.float32 else None
    return bound is not None and residual > bound


def unresolved_below(dtype: torch.dtype, rtol: float, residual: float = 0.0,
                     point: str = "grad") -> str:
    """What a ``matches`` leaves open where no twin without autocast was run (``grad-check
    run``: the script is the user's): at a precision coarser than float32, any split off
    by less than the tolerance; in float32, one whose residual is above float32's rounding
    (``FLOAT32_ROUNDING``), which only a run in float64 resolves."""
    if coarser_than_float32(dtype):
        return (f"in {dtype_name(dtype)} a split off by less than {rtol:.2g} matches too: run "
                "once in float32 to resolve it")
    bound = FLOAT32_ROUNDING.get(point) if dtype == torch.float32 else None
    if bound is None or not residual > bound:
        return ""
    return (f"residual {residual:.2g} is within float32's tolerance {rtol:.2g} but above its "
            f"rounding (~{bound:.0e}): not rounding; run once in float64 to resolve it")
