"""The loops of :mod:`harness.check.fused`, compiled by numba (imported only where a pair is
large enough to earn numba's start): each reads an element of every tensor once, widens
it to float64 in a register, and adds its products to float64 accumulators that may be
reassociated (several partial sums, added at the end: only the order of float64
additions changes). Defined at the top of their own module, so that numba caches what
it compiled on disk for the next process.
"""

import numba
import numpy as np

compiled = numba.njit(cache=True, nogil=True, fastmath={"reassoc"})


@compiled
def sums(m, r, o):  # pragma: no cover -- compiled
    """[m.r, r.r, m.m, d.d, d.r] with d = m - r, of m - o and r - o where ``o`` is not
    empty (updates from an origin)."""
    has_origin = o.shape[0] > 0
    mr = rr = mm = dd = dr = 0.0
    for i in range(m.shape[0]):
        origin = np.float64(o[i]) if has_origin else 0.0
        a, b = np.float64(m[i]) - origin, np.float64(r[i]) - origin
        d = a - b
        mr += a * b
        rr += b * b
        mm += a * a
        dd += d * d
        dr += d * b
    return mr, rr, mm, dd, dr


@compiled
def residual(m, r, o, scale):  # pragma: no cover -- compiled
    """||(m - o) - s (r - o)||^2 (no origin where ``o`` is empty)."""
    total = 0.0
    has_origin = o.shape[0] > 0
    for i in range(m.shape[0]):
        origin = np.float64(o[i]) if has_origin else 0.0
        left = (np.float64(m[i]) - origin) - scale * (np.float64(r[i]) - origin)
        total += left * left
    return total
