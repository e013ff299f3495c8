"""Experiment ``lr-factor``: which learning-rate factor makes a recipe's update the big batch's?

For one strategy, world size N and accumulation k, every loss recipe is crossed
with every optimizer, and each pair is trained twice over T windows: at the
optimizer's own learning rate (factor 1), and at lr * 1/s, where s is the scale
of the recipe's gradient against the big batch's (fitted at the first window).
Both runs live side by side in one fleet (see fleet.py), so the strategy reduces
once per micro-step for all of them.

Why these two candidates are the only ones worth trying: an optimizer's update
is lr times either something linear in the gradient (SGD, momentum, Nesterov:
scaling the gradient by s is undone by lr/s exactly) or something invariant to
its scale (Adam's m/sqrt(v), up to eps: lr unchanged). Weight decay adds a term
that does not scale with the loss: coupled into the gradient (``SGD(weight_decay=)``,
an L2 term in the loss) it breaks both candidates; decoupled (AdamW), it keeps
factor 1. The row says which candidate came closest and how close.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from harness.context import RunContext
from harness.fit import fit_scale, relative_error
from harness.strategies import STRATEGIES
from harness.studies.update.fleet import (
    Fleet,
    every_member_parameters,
    fleet_trainer,
    member_gradients,
    members,
)
from harness.studies.update.optimizers import FSDP_DEFAULT_OPTIMIZERS, OPTIMIZERS, OptimizerSpec
from harness.studies.update.recipes import Shape, initial_model, losses_for, windows
from harness.studies.update.training import (
    FleetOptimizers,
    Member,
    ReferenceRuns,
    accumulate_window,
    big_batch_gradient,
    big_batch_run,
    flat_parameters,
    update_error,
)
from harness.studies.update.verdicts import LrFactor
from harness.tolerances import APPROXIMATE_UPDATE_TOLERANCE, update_tolerance
from harness.verdicts import Equivalence

#: The learning-rate factors each (loss, optimizer) pair is trained with: its own lr,
#: and lr divided by the gradient scale s its recipe shows against the big batch.
SAME_LR, INVERSE_SCALE = "1", "1/s"
CANDIDATES = (SAME_LR, INVERSE_SCALE)


def optimizers_for(strategy: str, full: bool) -> list[OptimizerSpec]:
    sharded = STRATEGIES[strategy].sharded
    names = FSDP_DEFAULT_OPTIMIZERS if sharded and not full else tuple(OPTIMIZERS)
    return [OPTIMIZERS[name] for name in names]


def candidate_factor(candidate: str, scale: float) -> float:
    """The learning-rate factor of a candidate; 1/s only for a usable (positive, finite) s."""
    if candidate == INVERSE_SCALE and math.isfinite(scale) and scale > 0:
        return 1.0 / scale
    return 1.0


def sync_of(strategy: str, accum_steps: int) -> str:
    """When the strategy reduces: DDP under ``no_sync`` and FSDP2 with
    ``set_requires_gradient_sync(False)`` but for the last micro-step when accumulating;
    DataParallel in every backward; one process never."""
    return STRATEGIES[strategy].sync(accum_steps)


def run(strategy: str, world_size: int, accum_steps: int, steps: int, full: bool,
        run_context: RunContext, reports: bool, references: ReferenceRuns
        ) -> list[dict[str, Any]] | None:
    shape = Shape(world_size, accum_steps)
    dtype, seed = run_context.dtype, run_context.seed
    data = windows(seed, shape, steps, dtype)
    initial = initial_model(seed, dtype)
    optimizers = optimizers_for(strategy, full)
    runs = [(Member(loss, spec), candidate) for loss in losses_for(accum_steps)
            for spec in optimizers for candidate in CANDIDATES]
    trainer = fleet_trainer(strategy, Fleet(initial, len(runs)), world_size, run_context)
    optimizer = FleetOptimizers([member for member, _ in runs], members(trainer))
    no_sync = sync_of(strategy, accum_steps) == "no_sync"
    scales = _train(trainer, optimizer, runs, data, shape, initial, no_sync)
    final = every_member_parameters(trainer)
    if not reports:
        return None
    start = flat_parameters(initial)
    final_reference = {spec.name: references.get(
        (seed, dtype, shape, steps, spec.name), lambda spec=spec: big_batch_run(initial, spec, data)
    )[-1] for spec in optimizers}
    tolerance = update_tolerance(dtype)
    rows = []
    for i in range(0, len(runs), len(CANDIDATES)):
        member = runs[i][0]
        reference = final_reference[member.optimizer.name]
        errors = [update_error(final[i + j], reference, start) for j in range(len(CANDIDATES))]
        fit = scales[member.loss]
        rows.append({
            "loss": member.loss, "sync": sync_of(strategy, accum_steps),
            "optimizer": member.optimizer.name, "optimizer_settings": member.optimizer.settings,
            "learning_rate": member.optimizer.lr, "steps": steps,
            "grad_scale": fit.scale, "grad_residual": fit.residual,
            "param_distance": relative_error(final[i], reference),
            "update_error": errors[0],
            "verdict": Equivalence.MATCHES if errors[0] <= tolerance else Equivalence.DIFFERS,
            **lr_factor_columns(errors, fit.scale, tolerance),
        })
    return rows


def _train(trainer, optimizer: FleetOptimizers, runs, data, shape: Shape, initial, no_sync: bool
           ) -> dict[str, Any]:
    """Every window, each copy at its candidate's learning rate: set after the first window,
    once its recipe's gradient scale is known; the scales, per loss recipe."""
    scales: dict[str, Any] = {}
    for t, window in enumerate(data):
        accumulate_window(trainer, [m for m, _ in runs], window, shape, no_sync)
        if t == 0:
            scales = _gradient_scales(trainer, runs, big_batch_gradient(initial, window))
            for i, (member, candidate) in enumerate(runs):
                optimizer.set_lr_factor(i, candidate_factor(candidate, scales[member.loss].scale))
        optimizer.step()
    return scales


def _gradient_scales(trainer, runs, reference: torch.Tensor) -> dict[str, Any]:
    """Per loss recipe, its first window's gradient fitted against the big batch's.

    Read from the first copy of each recipe whose loss has no L2 term (that term is
    not scaled by the recipe): every copy of a recipe starts from the same weights."""
    probes: dict[str, int] = {}
    for i, (member, _) in enumerate(runs):
        if member.loss not in probes and not member.optimizer.l2_in_loss:
            probes[member.loss] = i
    grads = member_gradients(trainer, list(probes.values()))
    return {loss: fit_scale(g, reference) for loss, g in zip(probes, grads, strict=True)}


def lr_factor_columns(errors: list[float], scale: float, tolerance: float) -> dict[str, Any]:
    """The best candidate factor, its residual update error, and the verdict on it."""
    best = min(range(len(CANDIDATES)), key=lambda j: errors[j])
    factor = candidate_factor(CANDIDATES[best], scale)
    residual = errors[best]
    if residual <= tolerance:
        verdict = LrFactor.EXACT
    elif residual <= APPROXIMATE_UPDATE_TOLERANCE:
        verdict = LrFactor.APPROXIMATE
    else:
        verdict = LrFactor.NONE
    return {"lr_factor": factor if verdict != LrFactor.NONE else math.nan,
            "lr_factor_residual": residual, "lr_factor_verdict": verdict}
