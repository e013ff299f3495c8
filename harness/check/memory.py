"""How much tensor memory a piece of the check holds at its peak: what bench.py reports and
the tests bound for the chunked reference (one chunk's activations, not the global batch's).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def peak_tensor_bytes(function: Callable[[], object]) -> int:
    """The most bytes of tensors ``function`` held at once, beyond those it started with:
    the allocator's own record of every allocation (positive) and free (negative), in the
    order they happened."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        function()
    held = peak = 0
    events = [e for e in recorded.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak
