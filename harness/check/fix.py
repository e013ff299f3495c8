"""The concrete fix a row suggests, read from what was measured.

Nothing here knows the examples: the fix follows from the verdict, the fitted scale
(named as k, N or N*k when it is one of them), the module types of the worst tensors,
the parameters the reference left without gradient, and whether the user's loss of the
whole batch is the same combination of its pieces' losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from harness.check import batches
from harness.check.compare import Comparison
from harness.fit import combination_verdict
from harness.tolerances import close
from harness.verdicts import Combination, Equivalence

NORM_MODULES = (nn.modules.batchnorm._BatchNorm,)


@dataclass(frozen=True)
class Facts:
    """What a fix is decided from, besides the comparison itself: the case's constants and
    the step's inputs, as the front-end measured them (a new one per step, ``replace``),
    and, per point, what the judge adds (``rtol``, ``ranks_agree``, ``gradient_scale``
    from its :class:`~harness.check.judge.Memory`). Nothing changes it once made."""

    world_size: int
    accum_steps: int
    #: The reduction is DDP's bucketed all-reduce, which never reduces a bucket holding a
    #: parameter that got no gradient; and how to tell DDP to look for such parameters.
    reduces_in_buckets: bool = False
    find_unused: str = "pass find_unused_parameters=True to DDP (Setup.ddp_options)"
    #: Parameter and buffer names that belong to BatchNorm modules.
    batchnorm: frozenset[str] = frozenset()
    #: Parameters without gradient in the reference.
    unused: tuple[str, ...] = ()
    #: DDP was told to look for unused parameters.
    finds_unused: bool = False
    #: Whether the ranks hold the same tensors at the point compared (None: not meant to).
    ranks_agree: bool | None = None
    #: How the whole batch's loss combines its N x k pieces' losses (``neither``: the
    #: pieces weigh differently, a mean over a count that varies per piece). Asked only
    #: when needed: it costs a forward of every piece.
    loss_combination: Callable[[], Combination] | None = None
    rtol: float = 1e-9
    #: The scale of step 0's gradient where it is a pure multiple other than 1: the cause
    #: of every later row of the case that this scale alone does not explain (an adaptive
    #: optimizer such as Adam turns it into updates no single scale describes).
    gradient_scale: float | None = None
    #: What each of the window's N x k micro-batches counted, where a run saw it (e.g. its
    #: labelled tokens): a loss that divides each micro-batch by its own count weighs
    #: micro-batches of different counts unequally, which no single scale explains.
    piece_counts: tuple[int, ...] = ()
    #: The big batch's learning rates at this step (a step at rate 0 moves nothing).
    learning_rates: tuple[float, ...] = ()
    #: How a number that is both N and k (N == k) is named in a fix: ``k``, ``N``, or
    #: ``N or k`` where nothing tells which the scale follows (script mode reads it from
    #: the other splits of the same run: harness/grad_check/script/factors.py).
    tie: str = "k"


def batchnorm_tensors(model: nn.Module,
                      modules: Iterable[tuple[str, nn.Module]] | None = None) -> set[str]:
    """The names of the batch norms' parameters and buffers; ``modules``: the model's
    modules by name, where the caller names them otherwise than ``named_modules()``."""
    names = set()
    for prefix, module in model.named_modules() if modules is None else modules:
        if isinstance(module, NORM_MODULES):
            for name, _ in [*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False)]:
                names.add(f"{prefix}.{name}" if prefix else name)
    return names


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


def _batchnorm_fix(facts: Facts) -> str:
    if facts.accum_steps > 1:
        return ("use GroupNorm (or LayerNorm): BatchNorm normalizes each micro-batch by its "
                "own statistics, and SyncBatchNorm spans the N ranks but not the k micro-steps")
    return ("use SyncBatchNorm (or GroupNorm): BatchNorm normalizes each rank's shard by its "
            "own statistics")


def differs_fix(comparison: Comparison, facts: Facts) -> str:
    # BatchNorm first: where its tensors differ, it is a cause whatever else is.
    if any(comparison.errors.get(name, 0.0) > facts.rtol for name in facts.batchnorm):
        return _batchnorm_fix(facts)
    if facts.reduces_in_buckets and facts.unused and not facts.finds_unused:
        shown = ", ".join(facts.unused[:3]) + (", ..." if len(facts.unused) > 3 else "")
        return (f"the unused parameters ({shown}) get no gradient, so DDP never all-reduces "
                f"the bucket that holds them: {facts.find_unused}")
    if facts.ranks_agree is False:
        return ("the ranks hold different values after DDP's all-reduce: something skips or "
                "changes the reduction on some ranks (a comm hook, a parameter only some ranks "
                "use, a gradient edited after backward); compare the ranks' gradients")
    if len(set(facts.piece_counts)) > 1:
        return window_count_fix(facts.piece_counts)
    if facts.loss_combination is not None:
        combination = facts.loss_combination()
        if combination is Combination.NEITHER:
            return ("normalize by the window's token count: the loss divides each "
                    "micro-batch by its own count (e.g. a token mean), so pieces weigh "
                    "unequally; sum the per-token losses, divide by the window's count "
                    "(times N under DDP/FSDP)")
    return ("no single scale explains it: something in the worst tensors' computation "
            "depends on how the batch is split")


def window_count_fix(counts: tuple[int, ...]) -> str:
    """Micro-batches of different counts: divide by the window's count, named. A script
    that already divides by a window's count may count other labels than its loss
    averages (torchtune's recipes count them before the causal shift), which weighs each
    micro-batch by 1 + rows / tokens: the same fix, said so that such a script sees it."""
    shown = ", ".join(map(str, counts[:8])) + (", ..." if len(counts) > 8 else "")
    return (f"normalize by the window's token count: its micro-batches hold {shown} tokens "
            f"({sum(counts)} in all), and a loss that weighs each by another count weighs "
            "them unequally: its own count (a mean per micro-batch), or a count of other "
            "labels than the loss averages (labels counted before a causal shift: each "
            "micro-batch then weighs 1 + rows / tokens); sum the per-token losses and divide "
            "by the whole window's count of the labels the loss averages (times N under "
            "DDP/FSDP, which average the ranks)")


def buffers_fix(comparison: Comparison, facts: Facts) -> str:
    """Buffers that do not follow the big batch: running statistics of normalization
    layers, or a buffer the forward updates once per call (a counter)."""
    differing = [name for name, error in comparison.errors.items() if error > facts.rtol]
    if differing and all(name in facts.batchnorm for name in differing):
        return ("BatchNorm's running statistics are updated once per micro-batch and per "
                "rank, from that piece alone: expected to differ from one big-batch "
                "update; " + _batchnorm_fix(facts))
    shown = ", ".join(differing[:3]) + (", ..." if len(differing) > 3 else "")
    return (f"the buffers {shown} change differently from the big batch: the forward "
            f"updates them per call or per piece ({facts.world_size} rank(s) x "
            f"{facts.accum_steps} micro-step(s)), e.g. a counter of calls or of each rank's "
            "own samples; update them once per optimizer step, or all-reduce them")


def _follows_gradient_scale(point: str, comparison: Comparison, facts: Facts) -> bool:
    """Whether the row is one of the later rows of a case whose step-0 gradient is scaled
    and that the same scale does not explain by itself."""
    if facts.gradient_scale is None or point == "buffers":
        return False
    return not (comparison.verdict is Equivalence.SCALED
                and close(comparison.scale, facts.gradient_scale, facts.rtol))


def suggest(point: str, comparison: Comparison, facts: Facts) -> str:
    """The fix for one row; empty where nothing needs fixing."""
    if comparison.verdict is Equivalence.MATCHES:
        return ""
    if point == "buffers":
        return buffers_fix(comparison, facts)
    if _follows_gradient_scale(point, comparison, facts):
        return (f"step 0's gradient is scaled by {facts.gradient_scale:.6g}, which "
                f"this row follows from: {scale_fix('grad', facts.gradient_scale, facts)}")
    if comparison.verdict is Equivalence.SCALED and comparison.scale == 0:
        return zero_fix(point)
    if comparison.verdict is Equivalence.SCALED and not math.isnan(comparison.scale):
        return scale_fix(point, comparison.scale, facts)
    return differs_fix(comparison, facts)


def zero_fix(point: str) -> str:
    """Nothing where the big batch has something: no scale of the loss brings it back."""
    if point == "grad":
        return ("the gradient is all zero where the big batch's is not: nothing flowed back "
                "to the parameters in this case (an output detached or computed without "
                "autograd, a loss of no sample, a gradient zeroed before the step)")
    return ("the step moved no parameter where the big batch's step did (a learning rate of "
            "0 here only, a skipped step, a gradient zeroed before the step)")


def measure_loss_combination(model: nn.Module, loss, window, per_piece: int, pieces: int,
                             rtol: float) -> Combination:
    """The user's loss of the whole window against its pieces' losses, on ``model``, a
    throwaway model fresh from make_model() (a training-mode forward may update buffers):
    how a loss combines its pieces is the loss's own property, not the weights'."""
    with torch.no_grad():
        whole = float(loss(model, window))
        parts = [float(loss(model, batches.take(window, i * per_piece, (i + 1) * per_piece)))
                 for i in range(pieces)]
    return combination_verdict(whole, parts, rtol)
