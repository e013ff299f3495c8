"""Experiment ``momentum-correction``: momentum SGD when the learning rate changes.

Goyal et al. 2017 (section 2.1) write momentum SGD with the learning rate inside
the velocity, ``v <- m v + lr g``, ``θ <- θ - v``. When lr changes (scaled for a new
GPU count, or by a schedule), v still holds steps of the old size, and their
"momentum correction" multiplies v by ``lr_new / lr_old`` at the change.
``torch.optim.SGD`` keeps lr outside, ``v <- m v + g``, ``θ <- θ - lr v``: the same
update as the corrected form, with no correction to apply.

One case at the widest N: T steps at lr, then T at lr x N (the linear scaling
rule's new rate), on fresh N-device batches, with torch.optim.SGD (the
reference) and with the lr-inside form written out, corrected and not. Each row
is one lr-inside variant against the reference.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from harness.seeding import generator_for
from harness.studies.update.experiments.momentum_correction import CORRECTED, SETTINGS
from harness.studies.update.linear_scaling import descend
from harness.studies.update.optimizers import MOMENTUM, SGD_LR
from harness.studies.update.recipes import MICRO_BATCH, TASK, initial_model
from harness.studies.update.training import flat_parameters, judged
from harness.tasks import Batch
from harness.tolerances import dtype_name, update_tolerance

if TYPE_CHECKING:
    from harness.studies.update.experiment import Trial


def batches(seed: int, world_size: int, count: int, dtype: torch.dtype) -> list[Batch]:
    """``count`` big batches, each of N devices' b samples."""
    generator = generator_for(seed, "update-momentum-correction", world_size)
    return [Batch.cat([TASK.make_shard(MICRO_BATCH, j, generator, dtype)
                       for j in range(world_size)]) for _ in range(count)]


def _gradients(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, ...]:
    loss = TASK.loss(model(batch.x), batch, "mean")
    return torch.autograd.grad(loss, list(model.parameters()))


def torch_sgd(start: nn.Module, data: list[Batch], lrs: list[float]) -> nn.Module:
    """torch.optim.SGD with momentum, its lr set before each step."""
    model = copy.deepcopy(start)
    optimizer = torch.optim.SGD(model.parameters(), lr=lrs[0], momentum=MOMENTUM)
    for batch, lr in zip(data, lrs, strict=True):
        optimizer.param_groups[0]["lr"] = lr
        descend(model, optimizer, batch)
    return model


def lr_inside_sgd(start: nn.Module, data: list[Batch], lrs: list[float],
                  corrected: bool) -> nn.Module:
    """``v <- m v + lr g``, ``θ <- θ - v``; ``corrected``: v scaled by lr_new / lr_old first."""
    model = copy.deepcopy(start)
    velocity = [torch.zeros_like(p) for p in model.parameters()]
    previous = lrs[0]
    for batch, lr in zip(data, lrs, strict=True):
        gradients = _gradients(model, batch)
        correction = lr / previous if corrected else 1.0
        with torch.no_grad():
            for p, v, g in zip(model.parameters(), velocity, gradients, strict=True):
                v.mul_(MOMENTUM * correction).add_(g, alpha=lr)
                p.sub_(v)
        previous = lr
    return model


def measure(trial: Trial) -> list[dict[str, Any]]:
    world_size, steps = trial.world_size, trial.options.steps
    dtype, seed = trial.run.dtype, trial.run.seed
    start = initial_model(seed, dtype)
    lrs = [SGD_LR] * steps + [SGD_LR * world_size] * steps
    data = batches(seed, world_size, len(lrs), dtype)
    reference = flat_parameters(torch_sgd(start, data, lrs))
    origin = flat_parameters(start)
    rows = []
    for setting in SETTINGS:
        params = flat_parameters(lr_inside_sgd(start, data, lrs, corrected=setting == CORRECTED))
        rows.append({
            "micro_batch": MICRO_BATCH, "loss": "mean", "sync": "none",
            "optimizer": "sgd-momentum",
            "optimizer_settings": (f"v <- {MOMENTUM:g} v + lr g, θ <- θ - v; lr = {SGD_LR:g} "
                                   f"for {steps} steps, then {SGD_LR * world_size:g}"),
            "learning_rate": SGD_LR, "steps": len(lrs), "setting": setting,
            "dtype_used": dtype_name(dtype), "lr_multiplier": world_size, "device": "cpu",
            **judged(params, reference, origin, update_tolerance(dtype)),
        })
    return rows
