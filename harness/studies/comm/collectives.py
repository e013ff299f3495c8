"""The four collectives the comm study times: their buffers, bus factors and checks.

Metrics as NVIDIA/nccl-tests defines them (its doc/PERFORMANCE.md):

- S, the message size: the bytes of the buffer nccl-tests names the size of:
  all_reduce's and broadcast's one buffer, reduce_scatter's *input* and
  all_gather's *output* (each n chunks of one per rank);
- algbw = S / t, in GB/s (1e9 bytes per second);
- busbw = algbw x factor(n): the bandwidth every link of an optimal ring must
  carry, which makes collectives comparable with each other and with the
  hardware's peak. Each rank sends and receives (n-1)/n of S once for
  reduce_scatter and all_gather, twice for all_reduce (a reduce-scatter then an
  all-gather), and the whole of S once for broadcast.

The check: every rank fills its input with small integers that depend on its rank
and on the element's position (:func:`pattern`), so the exact result is known
and float sums of them are exact; ``wrong`` counts the received elements that are
not exactly the expected value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.studies.comm.timing import Clock, Timing, durations, median, summed_over_ranks

#: nccl-tests' busbw / algbw for n ranks, per collective: the one definition in the harness.
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
COLLECTIVES = tuple(BUS_FACTORS)
#: Collectives whose S is n equal chunks, one per rank.
CHUNKED = ("reduce_scatter", "all_gather")

#: Pattern values repeat with this period: a prime, so that a chunk received at the
#: wrong offset (a multiple of a power of two elements) shows. The largest value
#: any rank sends is n * PERIOD and the largest sum n(n+1)/2 * PERIOD: exact in
#: float32 (integers up to 2^24) for n up to 365 ranks, in float64 far beyond.
PATTERN_PERIOD = 251

GB = 1e9


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw of ``collective`` on ``n`` ranks (nccl-tests' definition)."""
    return BUS_FACTORS[collective](n)


def bandwidths(collective: str, message_bytes: int, seconds: float, n: int
               ) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for S = ``message_bytes`` moved in ``seconds``."""
    algbw = message_bytes / seconds / GB
    return algbw, algbw * bus_factor(collective, n)


def message_elements(collective: str, size_bytes: int, n: int, element_size: int) -> int:
    """Elements of S's buffer for a requested size: at least one, and for a chunked
    collective a multiple of n (rounded down, at least one element per rank), as
    nccl-tests rounds its counts."""
    elements = max(1, size_bytes // element_size)
    if collective in CHUNKED:
        return max(1, elements // n) * n
    return elements


def _positions(factor: int, start: int, count: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """factor * (1 + i % PERIOD) for positions i = start..start+count-1."""
    index = torch.arange(start, start + count, dtype=torch.int64)
    return (factor * (1 + index % PATTERN_PERIOD)).to(dtype=dtype, device=device)


def pattern(rank: int, start: int, count: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """What rank ``rank`` sends at positions start..start+count-1: (rank + 1) * (1 + i % PERIOD)."""
    return _positions(rank + 1, start, count, dtype, device)


def summed_pattern(n: int, start: int, count: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """The sum of :func:`pattern` over ranks 0..n-1: n(n+1)/2 * (1 + i % PERIOD)."""
    return _positions(n * (n + 1) // 2, start, count, dtype, device)


def count_wrong(received: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements of ``received`` that are not exactly ``expected`` (NaN counts as wrong).

    Exact equality on purpose: the pattern's sums are exact, so any difference,
    however small, is an error of the collective, not rounding.
    """
    if received.shape != expected.shape:
        return max(received.numel(), expected.numel())
    return int((received != expected).sum())


@dataclass
class Buffers:
    """What one rank sends, where its result lands, and what that result must be."""

    send: torch.Tensor
    receive: torch.Tensor
    expected: torch.Tensor

    def clear(self) -> None:
        """Zeros everywhere before the timed loop: all_reduce in place would otherwise
        multiply its values by n(n+1)/2 per call and overflow; the time does not
        depend on the values."""
        self.send.zero_()
        self.receive.zero_()


def prepare(collective: str, rank: int, n: int, elements: int, dtype: torch.dtype,
            device: torch.device) -> Buffers:
    """Rank ``rank``'s buffers for S = ``elements`` elements on ``n`` ranks."""
    chunk = elements // n
    if collective == "all_reduce":
        buffer = pattern(rank, 0, elements, dtype, device)
        return Buffers(buffer, buffer, summed_pattern(n, 0, elements, dtype, device))
    if collective == "reduce_scatter":
        return Buffers(pattern(rank, 0, elements, dtype, device),
                       torch.zeros(chunk, dtype=dtype, device=device),
                       summed_pattern(n, rank * chunk, chunk, dtype, device))
    if collective == "all_gather":
        expected = torch.cat([pattern(r, r * chunk, chunk, dtype, device) for r in range(n)])
        return Buffers(pattern(rank, rank * chunk, chunk, dtype, device),
                       torch.zeros(elements, dtype=dtype, device=device), expected)
    if collective == "broadcast":
        buffer = pattern(rank, 0, elements, dtype, device)
        return Buffers(buffer, buffer, pattern(0, 0, elements, dtype, device))
    raise ValueError(f"unknown collective {collective!r}; allowed: {', '.join(COLLECTIVES)}")


# Single-tensor versions of reduce_scatter and all_gather: what FSDP calls. torch 2.13
# renamed them *_single; the old names remain (deprecated) in the versions before.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def call(collective: str, buffers: Buffers, group: dist.ProcessGroup) -> None:
    """One call of ``collective`` on ``group``, SUM where it reduces, rank 0 as the root."""
    if collective == "all_reduce":
        dist.all_reduce(buffers.send, group=group)
    elif collective == "reduce_scatter":
        _REDUCE_SCATTER(buffers.receive, buffers.send, group=group)
    elif collective == "all_gather":
        _ALL_GATHER(buffers.receive, buffers.send, group=group)
    elif collective == "broadcast":
        # The study's groups are ranks 0..N-1: global rank 0 is the group's first rank.
        dist.broadcast(buffers.send, src=0, group=group)
    else:
        raise ValueError(f"unknown collective {collective!r}; allowed: {', '.join(COLLECTIVES)}")


@dataclass(frozen=True)
class CollectiveResult:
    """One collective at one size on one group, as every rank of it knows it."""

    elements: int
    message_bytes: int
    #: Median over the timed iterations of the ranks' mean time per call.
    seconds: float
    #: Wrong elements of the checked call, summed over the ranks.
    wrong: int


def measure_collective(collective: str, size_bytes: int, group: dist.ProcessGroup,
                       device: torch.device, dtype: torch.dtype, timing: Timing
                       ) -> CollectiveResult:
    """Check one call of ``collective``, warm up, then time ``timing.iterations`` calls.

    The first warm-up call is the checked one; the buffers are then zeroed and
    reused by every later call, so the loop allocates nothing.
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    element_size = torch.empty((), dtype=dtype).element_size()
    elements = message_elements(collective, size_bytes, n, element_size)
    buffers = prepare(collective, rank, n, elements, dtype, device)
    call(collective, buffers, group)
    wrong = count_wrong(buffers.receive, buffers.expected)
    buffers.clear()
    for _ in range(timing.warmup - 1):
        call(collective, buffers, group)
    times = durations(lambda: call(collective, buffers, group), timing.iterations,
                      Clock(device))
    # One collective carries both: the ranks' times (for the mean) and their wrong counts.
    totals = summed_over_ranks(torch.tensor([*times, wrong], dtype=torch.float64), group,
                               device)
    return CollectiveResult(elements=elements, message_bytes=elements * element_size,
                            seconds=median((totals[:-1] / n).tolist()),
                            wrong=int(totals[-1]))
