"""Gradient diagnostics for any run: what seed 002's author had to print by hand.

Per parameter and per step: the gradient's norm, the fraction of its entries
that are dead (negligible against its layer's gradient), whether it is None
at all, and how large the update was relative to the weight.
:class:`GradientRecorder` collects them as tidy rows (one dict per step and
parameter) around whatever applies the update::

    recorder = GradientRecorder(model)
    for step, batch in enumerate(batches, start=1):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        with recorder.step(step, loss=float(loss)):
            optimizer.step()            # or a manual ``p -= lr * g``
    pandas.DataFrame(recorder.rows)

``dead_relu_fraction`` and ``graph_of`` cover the two other questions seed 002
asks: did a too-large learning rate switch the ReLUs off for good, and did a
forward pass build a graph at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from harness.tolerances import negligible_relative


@dataclass(frozen=True)
class GradientStats:
    """One parameter's gradient, as ``param.grad`` holds it right now."""

    parameter: str
    requires_grad: bool
    #: True when no backward pass ever reached the parameter (frozen, unused, or cleared).
    grad_is_none: bool
    #: L2 norm of ``param.grad``; NaN when it is None.
    grad_norm: float
    #: Dead entries of ``param.grad`` (see :func:`dead_entries`), over all entries; NaN
    #: when None.
    zero_grad_fraction: float


def layer_of(parameter: str) -> str:
    """``conv2.0.weight`` -> ``conv2.0``: the module that owns the parameter."""
    return parameter.rpartition(".")[0]


def layer_scales(module: nn.Module) -> dict[str, float]:
    """The largest ``|grad|`` entry over each layer's parameters (0: none, or all zero)."""
    scales: dict[str, float] = {}
    for name, param in module.named_parameters():
        largest = 0.0 if param.grad is None else float(param.grad.detach().abs().max())
        scales[layer_of(name)] = max(scales.get(layer_of(name), 0.0), largest)
    return scales


def dead_entries(grad: torch.Tensor, layer_scale: float) -> int:
    """Entries of ``grad`` at most :func:`~harness.tolerances.negligible_relative` times its
    layer's largest entry: exactly 0, or rounding residue of a sum that cancels. Counting
    exact zeros instead would depend on the CPU (harness/tolerances.py says why)."""
    threshold = negligible_relative(grad.dtype) * layer_scale
    return int((grad.detach().abs() <= threshold).sum())


def gradient_stats(module: nn.Module) -> list[GradientStats]:
    """The gradient of every parameter of ``module``, in ``named_parameters`` order."""
    stats, scales = [], layer_scales(module)
    for name, param in module.named_parameters():
        grad = param.grad
        if grad is None:
            stats.append(GradientStats(name, param.requires_grad, True, math.nan, math.nan))
            continue
        stats.append(GradientStats(
            name, param.requires_grad, False, float(grad.detach().to(torch.float64).norm()),
            dead_entries(grad, scales[layer_of(name)]) / grad.numel()))
    return stats


def update_ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    """||after - before|| / ||before||: how far one update moved a weight, relative to it.

    A healthy step moves weights by ~1e-3 of their size; 0 means the weight did
    not move (frozen, or a dead gradient); values near 1 mean the step rewrote it.
    Below :func:`~harness.tolerances.negligible_relative` the move is rounding.
    """
    before64, after64 = before.to(torch.float64), after.to(torch.float64)
    norm = float(before64.norm())
    change = float((after64 - before64).norm())
    if norm == 0.0:
        return 0.0 if change == 0.0 else math.inf
    return change / norm


class GradientRecorder:
    """Tidy per-step, per-parameter gradient diagnostics of one module.

    Each row: ``step``, the :class:`GradientStats` fields, ``weight_norm`` and
    ``update_ratio`` (see :func:`update_ratio`), plus whatever ``extra`` values
    the caller passes to :meth:`step` (the loss, a learning rate, ...).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.rows: list[dict[str, Any]] = []

    @contextmanager
    def step(self, step: int, **extra: Any) -> Iterator[None]:
        """Wrap the update: gradients are read on entry, the update measured on exit."""
        stats = gradient_stats(self.module)
        before = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        yield
        after = dict(self.module.named_parameters())
        for stat in stats:
            weight = before[stat.parameter]
            self.rows.append({
                "step": step, **asdict(stat),
                "weight_norm": float(weight.to(torch.float64).norm()),
                "update_ratio": update_ratio(weight, after[stat.parameter].detach()),
                **extra,
            })


@contextmanager
def dead_relu_fraction(module: nn.Module) -> Iterator[dict[str, float]]:
    """Measure, for every ``nn.ReLU`` in ``module``, the fraction of its units that
    output exactly 0 for *every* sample of the batches forwarded inside the block.
    Unlike a zero count of gradient entries this is stable across CPUs without a
    threshold: a unit is alive on a sample when its pre-activation is positive, and on the
    diagnostics study's models the smallest such margin (a unit's largest pre-activation
    over the batch, relative to the layer's largest) measures 8.3e-7, nine orders above
    float64 rounding (in float32 only seven times float32's epsilon: declared, not
    guaranteed).

    A unit that is 0 for the whole batch passes no gradient back to the weights
    feeding it: once a too-large step has pushed all units there, training stops
    for good (seed 002's "gradients shrink to exactly 0"). The dict is filled
    when the block exits, keyed by the ReLU's module name.
    """
    alive: dict[str, torch.Tensor] = {}
    handles = []

    def watcher(name: str) -> Callable:
        def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
            # A unit is one feature (channel) over the batch and any spatial positions.
            fired = (output.detach() > 0).transpose(0, 1).reshape(output.shape[1], -1).any(1)
            alive[name] = alive[name] | fired if name in alive else fired
        return hook

    for name, child in module.named_modules():
        if isinstance(child, nn.ReLU):
            handles.append(child.register_forward_hook(watcher(name)))
    fractions: dict[str, float] = {}
    try:
        yield fractions
    finally:
        for handle in handles:
            handle.remove()
        fractions.update({name: 1.0 - float(fired.double().mean())
                          for name, fired in alive.items()})


@dataclass(frozen=True)
class GraphInfo:
    """Whether a tensor is attached to an autograd graph."""

    requires_grad: bool
    #: Class name of ``tensor.grad_fn`` (e.g. ``AddmmBackward0``); "" when it has none.
    grad_fn: str


def graph_of(tensor: torch.Tensor) -> GraphInfo:
    grad_fn = tensor.grad_fn
    return GraphInfo(tensor.requires_grad, type(grad_fn).__name__ if grad_fn else "")
