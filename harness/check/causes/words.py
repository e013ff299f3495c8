"""The words several causes share: a number named as k, N or N*k where it is one, a list
cut short, the loss or learning rate to change by a scale."""

from __future__ import annotations

from collections.abc import Sequence

from harness.check.fix import Facts
from harness.tolerances import close

#: Names shown where a list is named in a line.
SHOWN = 3
#: A point as a sentence names it.
WHAT = {"grad": "gradient", "params": "update", "buffers": "buffers"}


def shown(names: Sequence[str], most: int = SHOWN) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def named_value(value: float, world_size: int, accum_steps: int, rtol: float,
                tie: str = "k") -> str:
    """``value`` as it reads in a fix: ``4 = N*k`` where it is N, k or N*k within ``rtol``
    (the exact number shown), else its six significant digits; ``tie``: the name of a value
    that is both N and k."""
    for expression, number in (("k", accum_steps), ("N", world_size),
                               ("N*k", world_size * accum_steps)):
        if number > 1 and close(value, number, rtol):
            both = expression != "N*k" and world_size == accum_steps
            return f"{number} = {tie if both else expression}"
    return f"{value:.6g}"


def loss_scale_fix(scale: float, world_size: int, accum_steps: int, rtol: float,
                   tie: str = "k") -> str:
    """A gradient s times the big batch's: the loss to divide or multiply by 1/s."""
    if scale > 1:
        return f"divide the loss by {named_value(scale, world_size, accum_steps, rtol, tie)}"
    return f"multiply the loss by {named_value(1 / scale, world_size, accum_steps, rtol, tie)}"


def scale_fix(point: str, scale: float, facts: Facts) -> str:
    """A pure multiple s of the reference: undo it where it comes from."""
    n, k, rtol = facts.world_size, facts.accum_steps, facts.rtol
    if point == "grad":
        return loss_scale_fix(scale, n, k, rtol, facts.tie)
    inverse = 1 / scale
    return (f"multiply lr by 1/s = {named_value(inverse, n, k, rtol, facts.tie)}"
            " (or fix the gradient's scale)")


def batchnorm_fix(facts: Facts) -> str:
    if facts.accum_steps > 1:
        return ("use GroupNorm (or LayerNorm): BatchNorm normalizes each micro-batch by its "
                "own statistics, and SyncBatchNorm spans the N ranks but not the k micro-steps")
    return ("use SyncBatchNorm (or GroupNorm): BatchNorm normalizes each rank's shard by its "
            "own statistics")


def window_count_fix(counts: Sequence[int]) -> str:
    """Micro-batches of different counts: divide by the window's count, named. A script
    that already divides by a window's count may count other labels than its loss
    averages (torchtune's recipes count them before the causal shift), which weighs each
    micro-batch by 1 + rows / tokens: the same fix, said so that such a script sees it."""
    counted = ", ".join(map(str, counts[:8])) + (", ..." if len(counts) > 8 else "")
    return (f"normalize by the window's token count: its micro-batches hold {counted} tokens "
            f"({sum(counts)} in all), and a loss that weighs each by another count weighs "
            "them unequally: its own count (a mean per micro-batch), or a count of other "
            "labels than the loss averages (labels counted before a causal shift: each "
            "micro-batch then weighs 1 + rows / tokens); sum the per-token losses and divide "
            "by the whole window's count of the labels the loss averages (times N under "
            "DDP/FSDP, which average the ranks)")
