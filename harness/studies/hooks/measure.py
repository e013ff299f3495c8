"""What the hooks study counts and judges: collectives on the wire, buckets, rounding bounds.

- :class:`CollectiveTap` counts the gradient collectives a backward pass issues,
  at ``torch.distributed``'s Python API, whoever calls them: a DDP comm hook and
  the callbacks it chains (PowerSGD issues two of its three all-reduces from
  future callbacks, after the hook has returned), or FSDP2's reduce-scatter.
- :func:`recording` wraps a variant's own DDP comm hook and logs each bucket it is handed.
- :func:`rounding_bound` is the largest error rounding in a narrow wire format
  can cause in an averaged gradient, derived from first principles.
- :func:`hook_verdict` names what a reduction did to the gradient.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from harness.fit import ScaleFit
from harness.tolerances import close
from harness.verdicts import HookVerdict

#: The collectives a gradient reduction goes through, with the argument that holds
#: what is sent: DDP's hooks all-reduce, FSDP2 reduce-scatters.
GRADIENT_COLLECTIVES: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "tensor"),
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter_tensor": (1, "input"),
}


@dataclass
class CollectiveLog:
    """Collective calls of one step: how many, the bytes handed to them, their dtypes."""

    calls: int = 0
    bytes: int = 0
    names: set[str] = field(default_factory=set)
    dtypes: set[torch.dtype] = field(default_factory=set)

    def narrowest_dtype(self) -> torch.dtype | None:
        """The wire format with the fewest mantissa bits: the one rounding is judged by."""
        return max(self.dtypes, key=lambda d: torch.finfo(d).eps, default=None)


class CollectiveTap:
    """Counts calls of :data:`GRADIENT_COLLECTIVES` while :meth:`watching` is active.

    The functions are replaced on the ``torch.distributed`` module for the duration of
    the block: every caller looks them up there at call time (``dist.all_reduce``), in
    whichever thread it runs. A lock guards the counts, because gloo completes futures
    (and runs their callbacks) on its own worker threads.
    """

    def __init__(self) -> None:
        self.log = CollectiveLog()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def watching(self) -> Iterator[CollectiveLog]:
        self.log = CollectiveLog()
        originals = {name: getattr(dist, name) for name in GRADIENT_COLLECTIVES}
        for name, function in originals.items():
            setattr(dist, name, self._counting(name, function))
        try:
            yield self.log
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)

    def _counting(self, name: str, function: Callable) -> Callable:
        position, keyword = GRADIENT_COLLECTIVES[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            sent = kwargs[keyword] if keyword in kwargs else args[position]
            with self._lock:
                self.log.calls += 1
                self.log.bytes += sent.numel() * sent.element_size()
                self.log.names.add(name)
                self.log.dtypes.add(sent.dtype)
            return function(*args, **kwargs)

        return counted


@dataclass
class RecordingState:
    """The state DDP hands the recording hook: the variant's own state and the bucket log."""

    inner: Any
    #: Indices of the buckets the hook was handed since the last ``clear``.
    buckets: set[int] = field(default_factory=set)


def recording(hook: Callable) -> Callable:
    """``hook`` (a DDP comm hook), logging the index of every bucket it is handed.

    The wrapper carries ``hook``'s name: DDP refuses some hooks by name (bf16 without
    NCCL), and a wrapper must not slip past a check the bare hook would meet.
    """

    # No annotations: DDP compares them at run time, and this module's postponed
    # (string) annotations would not compare equal to dist.GradBucket.
    def recorded(state, bucket):
        state.buckets.add(bucket.index())
        return hook(state.inner, bucket)

    recorded.__name__ = hook.__name__
    return recorded


# ------------------------------------------------------------------ rounding
def unit_roundoff(dtype: torch.dtype) -> float:
    """u: the largest relative error of rounding one number to ``dtype`` (half its epsilon)."""
    return torch.finfo(dtype).eps / 2


def subnormal_spacing(dtype: torch.dtype) -> float:
    """The gap between subnormal numbers of ``dtype``: rounding below the normal range
    loses up to half of it, whatever the value (fp16: 2^-24; bf16: 2^-133)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def rounding_bound(per_rank: list[torch.Tensor], wire: torch.dtype) -> float:
    """The largest ``‖ĝ - ḡ‖ / ‖ḡ‖`` rounding to ``wire`` can cause in the average ``ḡ``
    of the N ranks' gradients ``per_rank``.

    Each element of the result goes through at most N + 2 roundings in ``wire``:
    its conversion on each rank, a division by the world size before the sum (DDP's
    compress hooks; FSDP2's pre-divide), N - 1 additions in the collective, and
    FSDP2's post-divide. Each multiplies by (1 + d), |d| <= u, so (Higham,
    *Accuracy and Stability of Numerical Algorithms*, lemma 3.1) the element is off
    by at most gamma_{N+2} = (N+2)u / (1 - (N+2)u) times ``mean_r |g_r|``, the
    magnitudes being added; values rounded in the subnormal range add at most half
    a subnormal gap each, 3N of them at most. Dividing the vector of these
    per-element bounds by ``‖ḡ‖`` gives the bound: it grows when the ranks'
    gradients cancel (``mean_r |g_r|`` much larger than ``|ḡ|``).
    """
    stacked = torch.stack([g.to(torch.float64) for g in per_rank])
    world_size = len(per_rank)
    roundings = world_size + 2
    u = unit_roundoff(wire)
    gamma = roundings * u / (1 - roundings * u)
    per_element = gamma * stacked.abs().mean(0) + 3 * world_size * subnormal_spacing(wire) / 2
    average_norm = float(stacked.mean(0).norm())
    return float(per_element.norm()) / average_norm if average_norm > 0 else math.nan


def magnitude_ratio(per_rank: list[torch.Tensor]) -> float:
    """``‖mean_r |g_r|‖ / ‖mean_r g_r‖``: 1 when the ranks' gradients agree in sign
    everywhere, large when they cancel (and rounding errors grow relative to the sum)."""
    stacked = torch.stack([g.to(torch.float64) for g in per_rank])
    average_norm = float(stacked.mean(0).norm())
    return float(stacked.abs().mean(0).norm()) / average_norm if average_norm > 0 else math.nan


# ------------------------------------------------------------------- verdict
def hook_verdict(fit: ScaleFit, error: float, bound: float, world_size: int,
                 rtol: float) -> HookVerdict:
    """Judge a gradient from its fit against ḡ (``fit``), its relative error ``error``
    and the rounding bound of its wire format (``bound``), at world size N >= 2."""
    if error <= rtol:
        return HookVerdict.EXACT
    if error <= bound:
        return HookVerdict.COMPRESSED
    tolerance = max(rtol, bound) if not math.isnan(bound) else rtol
    if math.isnan(fit.scale) or not fit.residual <= tolerance:
        return HookVerdict.DIFFERS
    if close(fit.scale, float(world_size), tolerance):
        return HookVerdict.SUMMED
    if close(fit.scale, 1.0 / world_size, tolerance):
        return HookVerdict.OVER_AVERAGED
    return HookVerdict.SCALED
