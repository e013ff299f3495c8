"""Every tolerance the harness judges with, in one place, with the reason for its size.

A verdict compares a measured number with what first principles predict. The
numbers come from tiny models (tens of parameters, a handful of samples), so the
rounding error of one gradient is a few ulps times the number of terms summed:
well under 1e-13 relative in float64 and 1e-6 in float32. The smallest real
difference a verdict must resolve is between a weight of 1/N and 1/(N+1) (or
between summed and averaged at N=2: a factor of 2), i.e. relative differences of
1/(N(N+1)) >= 1e-3 for any world size a machine can hold. A tolerance between
the two, with several orders of magnitude of margin on both sides, gives
verdicts that neither flicker with rounding nor miss a real effect.
"""

from __future__ import annotations

import torch

#: Relative tolerance on a fitted scale or weight, and on a fit's relative residual.
#: float64: rounding ~1e-15, effects >= 1e-3; 1e-9 sits six orders from each.
#: float32: rounding ~1e-7 (accumulated over a few hundred terms, ~1e-5); 1e-4
#: still resolves 1e-3 effects, with one order of margin either side.
RELATIVE_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
}

#: Below this norm a gradient counts as zero: a fit against it is meaningless.
#: Far below any gradient of the harness's models (norms of order 1e-2..1e2).
ZERO_NORM = 1e-30


def _for_dtype(table: dict[torch.dtype, float], dtype: torch.dtype, what: str) -> float:
    try:
        return table[dtype]
    except KeyError:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in table)
        raise ValueError(f"no {what} for dtype {dtype}; allowed: {allowed}") from None


def relative_tolerance(dtype: torch.dtype) -> float:
    """The tolerance for verdicts on numbers computed in ``dtype``."""
    return _for_dtype(RELATIVE_TOLERANCE, dtype, "tolerance")


def close(measured: float, expected: float, rtol: float) -> bool:
    """True when ``measured`` equals ``expected`` up to the relative tolerance ``rtol``."""
    return abs(measured - expected) <= rtol * max(abs(expected), 1.0)


#: Relative parameter distance ||a - b|| / ||b|| below which two training runs count as
#: the same trajectory (the training study's twins: update rules that are mathematically
#: identical but may round differently, e.g. ``p -= lr * g`` vs torch.optim.SGD's fused
#: ``add_(g, alpha=-lr)``). The effect the study must resolve, a forgotten ``zero_grad``,
#: moves the parameters by more than their own norm within one epoch (distance > 1).
#: float64: measured twins stay within 4e-16 over 150 steps (rounding growing like
#: sqrt(steps)); the one unstable pair, DDP's never-zeroed run against its one-process
#: twin, reaches 1e-14 after 5 epochs (it amplifies rounding ~10x per epoch). 1e-9 sits
#: five orders above the largest and nine below the effect.
#: float32: rounding ~1e-7 per step, ~1e-6 over a run; 1e-4 leaves two orders above and
#: four below the effect. Caveat, measured: a float32 rounding difference can put one
#: ReLU input on the other side of 0 (step 88 of 150 in the default run), after which the
#: runs really part (1e-3); the study then reports them as not identical, as they are.
TRAJECTORY_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
}


def trajectory_tolerance(dtype: torch.dtype) -> float:
    """The tolerance for "the same trajectory" on parameters trained in ``dtype``."""
    return _for_dtype(TRAJECTORY_TOLERANCE, dtype, "trajectory tolerance")
