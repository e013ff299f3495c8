"""The comparison's dot products in one pass that reads each element once, for large pairs.

compare.py's pass converts each chunk into float64 rows and multiplies them: four
kernels per chunk, each a trip through memory or cache, about four times the time of
reading the tensors once. Here one compiled loop (numba) reads an element of each
tensor, widens it to float64 in a register and adds its products to float64
accumulators: the same sums, at the speed memory delivers the tensors. The accumulators
may be reassociated (``fastmath={'reassoc'}``: several partial sums, added at the end),
which changes only the order of float64 additions, as the chunked pass does; nothing
else of IEEE arithmetic is relaxed (NaN and infinities still propagate).

Only CPU tensors of float32 or float64 with at least :data:`MIN_ELEMENTS` elements take
this path, only where numba is installed, and only once the process has compared
:data:`EARNED_AFTER` elements the chunked way: numba's start (its import and the first
call, which loads the loops compiled before from disk) costs 0.6 to 0.75 s of CPU per
process, measured, where the loop saves 0.16 s per 50M elements of gradients and
updates (0.10 s against 0.26 s, one thread). A check of one step of one case never earns
it back; a matrix of cases over a large model does, after a few. Everything else takes
compare.py's pass.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: Pairs smaller than this take compare.py's chunked pass: its cost is below numba's start.
MIN_ELEMENTS = 1 << 22
#: Elements a process compares the chunked way before the fused loop starts: 4 x 64M
#: elements' savings (4 x 0.2 s) pay for numba's start (0.6-0.75 s).
EARNED_AFTER = 1 << 28
#: Elements this process has compared the chunked way so far (large pairs only).
compared_chunked = 0
#: The types whose elements the loop reads as they are (numpy has no bfloat16).
READABLE = (torch.float32, torch.float64)


@functools.cache
def kernels() -> dict[str, Any] | None:
    """The compiled loops (harness/check/fused_loops.py, compiled once and cached on disk),
    or None where numba is not installed."""
    try:
        from harness.check import fused_loops
    except ImportError:
        return None
    return {"sums": fused_loops.sums, "residual": fused_loops.residual}


def applies(*tensors: torch.Tensor | None) -> bool:
    """Whether the pair (and its origin) takes the fused loop: a large pair the loop can
    read, once the process has earned numba's start."""
    global compared_chunked
    present = [tensor for tensor in tensors if tensor is not None]
    readable = (len(present) >= 2 and present[0].numel() >= MIN_ELEMENTS
                and all(t.device.type == "cpu" and t.dtype in READABLE
                        and t.layout == torch.strided and t.numel() == present[0].numel()
                        for t in present))
    if not readable:
        return False
    if compared_chunked < EARNED_AFTER:
        compared_chunked += present[0].numel()
        return False
    return kernels() is not None


def _array(tensor: torch.Tensor):
    return tensor.detach().reshape(-1).numpy()


def sums(measured: torch.Tensor, reference: torch.Tensor,
         origin: torch.Tensor | None) -> torch.Tensor:
    """[m.r, r.r, m.m, d.d, d.r] of the pair (both minus ``origin`` where given), d = m - r,
    in float64."""
    found = kernels()["sums"](_array(measured), _array(reference), _origins(origin))
    return torch.tensor(found, dtype=torch.float64)


def residual_sq(measured: torch.Tensor, reference: torch.Tensor, origin: torch.Tensor | None,
                scale: float) -> float:
    """``||(m - o) - s (r - o)||^2`` of the pair, in float64."""
    return float(kernels()["residual"](_array(measured), _array(reference), _origins(origin),
                                       float(scale)))


def _origins(origin: torch.Tensor | None):
    """The origin's elements, or none (the loops read an empty origin as zeros)."""
    import numpy as np

    return _array(origin) if origin is not None else np.empty(0, dtype=np.float64)
