"""The facts a row's cause is read from besides its comparison (harness/check/causes/): the
case's constants and the step's inputs, as the front-end measured them.

Nothing here knows the examples: the BatchNorm tensors are found by module type, the
parameters without gradient by the reference, and how the user's loss of the whole batch
combines its pieces' losses by measuring it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from harness.check import batches
from harness.fit import combination_verdict
from harness.verdicts import Combination

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
