"""How the comm study reads the time: per-iteration stamps, one number per iteration, medians.

Every rank stamps each iteration itself. On a CPU a stamp is ``time.perf_counter()``;
on a GPU it is a CUDA event recorded on the current stream, so that a stamp taken
after a collective marks when the GPU finished it, not when the host launched it
(the way nccl-tests times), and no host synchronisation sits inside the loop.

Across ranks an iteration's time is the *mean* of the ranks' times: in a
back-to-back loop a rank that arrives early waits inside the call, so each rank's
times jitter around the common period while their sum over the loop is the same
on every rank; the mean over ranks is that period, iteration by iteration. The
reported time is the median over iterations, which ignores the odd iteration
the operating system interrupted (2 cores shared by 4 ranks do that often).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Timing:
    """How many iterations a measurement runs: ``warmup`` untimed, then ``iterations`` timed."""

    warmup: int
    iterations: int

    def __post_init__(self) -> None:
        # The first warm-up call is the checked one (see collectives.measure_collective).
        if self.warmup < 1 or self.iterations < 1:
            raise ValueError(f"warm-up {self.warmup} and iterations {self.iterations}: "
                             "both must be >= 1")


class Clock:
    """Time stamps as this rank's device sees them (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stamp(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        """Seconds between two stamps; on a GPU, waits until ``end`` has happened."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def durations(call: Callable[[], object], iterations: int, clock: Clock) -> list[float]:
    """Seconds each of ``iterations`` back-to-back calls took on this rank.

    Stamps are converted only after the loop: on a GPU, converting waits for the
    device, which would otherwise stall the loop between calls.
    """
    stamps = []
    for _ in range(iterations):
        start = clock.stamp()
        call()
        stamps.append((start, clock.stamp()))
    return [clock.seconds(start, end) for start, end in stamps]


def summed_over_ranks(values: torch.Tensor, group: dist.ProcessGroup,
                      device: torch.device) -> torch.Tensor:
    """``values`` summed over the ranks of ``group`` (float64, on the CPU). One collective;
    the tensor travels on ``device`` because nccl carries CUDA tensors only."""
    total = values.to(device=device, dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return total.cpu()


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))
