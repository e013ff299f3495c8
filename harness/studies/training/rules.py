"""The update rules the training study compares: the seed's two loops, their fixed
versions, and the running-sum twin that spells out what never zeroing applies."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.studies.training.schema import RUNNING_SUM


@torch.no_grad()
def descend(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: float) -> None:
    """The seed's manual SGD step, ``p -= lr * g``."""
    for p, g in zip(params, grads, strict=True):
        p -= lr * g


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return float(torch.cat([t.detach().reshape(-1) for t in tensors]).to(torch.float64).norm())


@dataclass(frozen=True)
class AppliedStep:
    """Norms of the gradient a step applied, and of the gradient of that step's loss alone."""

    applied_grad_norm: float
    fresh_grad_norm: float


class UpdateRule(ABC):
    name: ClassVar[str]

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        self.params, self.lr = params, lr

    @abstractmethod
    def step(self, loss: torch.Tensor) -> AppliedStep:
        """Differentiate ``loss`` and update the parameters."""


class AutogradGrad(UpdateRule):
    name = "autograd.grad"

    def step(self, loss: torch.Tensor) -> AppliedStep:
        grads = torch.autograd.grad(loss, self.params)
        descend(self.params, grads, self.lr)
        norm = _norm(grads)
        return AppliedStep(norm, norm)


class AutogradGradRunningSum(UpdateRule):
    """What ``backward()`` without zeroing applies, spelled out: the sum of all gradients."""

    name = RUNNING_SUM

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        super().__init__(params, lr)
        self.total: list[torch.Tensor] | None = None

    def step(self, loss: torch.Tensor) -> AppliedStep:
        grads = torch.autograd.grad(loss, self.params)
        if self.total is None:
            self.total = [g.clone() for g in grads]
        else:
            for total, g in zip(self.total, grads, strict=True):
                total.add_(g)
        descend(self.params, self.total, self.lr)
        return AppliedStep(_norm(self.total), _norm(grads))


class BackwardNoZero(UpdateRule):
    name = "backward-no-zero"

    def step(self, loss: torch.Tensor) -> AppliedStep:
        before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                  for p in self.params]
        loss.backward()
        grads = [p.grad for p in self.params]
        descend(self.params, grads, self.lr)
        return AppliedStep(_norm(grads),
                           _norm([g - b for g, b in zip(grads, before, strict=True)]))


class BackwardZeroGrad(UpdateRule):
    name = "backward-zero-grad"

    def step(self, loss: torch.Tensor) -> AppliedStep:
        for p in self.params:
            p.grad = None  # what Module.zero_grad() does by default since torch 2.0
        loss.backward()
        grads = [p.grad for p in self.params]
        descend(self.params, grads, self.lr)
        norm = _norm(grads)
        return AppliedStep(norm, norm)


class OptimSGD(UpdateRule):
    name = "optim.SGD"

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        super().__init__(params, lr)
        self.optimizer = torch.optim.SGD(params, lr=lr)

    def step(self, loss: torch.Tensor) -> AppliedStep:
        self.optimizer.zero_grad()
        loss.backward()
        norm = _norm([p.grad for p in self.params])
        self.optimizer.step()
        return AppliedStep(norm, norm)


RULES: dict[str, type[UpdateRule]] = {rule.name: rule for rule in (
    AutogradGrad, BackwardNoZero, BackwardZeroGrad, OptimSGD, AutogradGradRunningSum)}
