"""Clipping as the experiments that clip measure it (``clipping``, ``grad-scaler``): the
factor a ``clip_grad_norm_`` call applied, the big-batch run clipped at the same
``max_norm``, and the columns that say where clipping was set and what it applied."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from harness.studies.update import fleet
from harness.studies.update.optimizers import OPTIMIZERS, PLAIN
from harness.studies.update.training import Start, big_batch_run
from harness.studies.update.trial import ReferenceRuns

#: The clipping columns of a recipe that does not clip.
UNCLIPPED = {"max_norm": math.nan, "max_norm_ratio": math.nan, "clip_coef_reference": math.nan,
             "clip_coefs": "", "clip_coef_min": math.nan, "clip_coef_max": math.nan}


def measured_coefficient(before: float, after: float) -> float:
    """The factor a clipping call applied, read off the gradient's norm before and after."""
    return after / before if before > 0 else math.nan


def local_norm(params: Sequence[nn.Parameter]) -> float:
    """The norm of what this process holds of the gradients (its shard, under FSDP)."""
    grads = [p.grad.to_local() if fleet.is_sharded(p.grad) else p.grad for p in params]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                        for g in grads])))


def torch_clip(params: Sequence[nn.Parameter], max_norm: float) -> None:
    torch.nn.utils.clip_grad_norm_(params, max_norm)


def clip_and_measure(params: Sequence[nn.Parameter], max_norm: float,
                     how: Callable[[Sequence[nn.Parameter], float], Any] = torch_clip) -> float:
    """Clip the gradients of ``params`` as ``how`` does; the coefficient it applied."""
    before = local_norm(params)
    how(params, max_norm)
    return measured_coefficient(before, local_norm(params))


def clip_columns(max_norm: float, ratio: float, reference_coefficient: float,
                 coefficients: Sequence[float]) -> dict[str, Any]:
    """The columns saying where clipping was set and what it applied at the first step."""
    return {"max_norm": max_norm, "max_norm_ratio": ratio,
            "clip_coef_reference": reference_coefficient,
            "clip_coefs": ";".join(f"{c:.12g}" for c in coefficients),
            "clip_coef_min": min(coefficients), "clip_coef_max": max(coefficients)}


def clipped_reference(references: ReferenceRuns, start: Start, max_norm: float
                      ) -> tuple[torch.Tensor, float]:
    """The big-batch run clipping its gradient at ``max_norm`` every step: its final
    parameters and the coefficient it applied at the first step."""
    first: list[float] = []

    def clip(model: nn.Module, t: int) -> None:
        coefficient = clip_and_measure(list(model.parameters()), max_norm)
        if t == 0:
            first.append(coefficient)

    def compute() -> list[torch.Tensor]:
        after = big_batch_run(start.initial, OPTIMIZERS[PLAIN], start.data, before_step=clip)
        return [*after, torch.tensor(first[0], dtype=torch.float64)]

    result = references.get((*start.key, PLAIN, "clip", max_norm), compute)
    return result[-2], float(result[-1])
