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
from typing import TYPE_CHECKING, Any

import torch

from harness.fit import fit_scale
from harness.strategies import STRATEGIES
from harness.studies.update import fleet
from harness.studies.update.experiments.lr_factor import LrFactor
from harness.studies.update.optimizers import FSDP_DEFAULT_OPTIMIZERS, OPTIMIZERS, OptimizerSpec
from harness.studies.update.recipes import MICRO_BATCH, Shape, losses_for
from harness.studies.update.training import (
    FleetOptimizers,
    Member,
    Start,
    accumulate_window,
    big_batch_gradient,
    big_batch_run,
)
from harness.tolerances import APPROXIMATE_UPDATE_TOLERANCE

if TYPE_CHECKING:
    from harness.studies.update.experiment import Trial

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


def measure(trial: Trial) -> list[dict[str, Any]] | None:
    start = Start.of(trial, trial.options.steps)
    optimizers = optimizers_for(trial.strategy, trial.full)
    runs = [(Member(loss, spec), candidate) for loss in losses_for(trial.accum_steps)
            for spec in optimizers for candidate in CANDIDATES]
    trainer = fleet.fleet_trainer(trial.strategy, fleet.Fleet(start.initial, len(runs)),
                                  trial.world_size, trial.run)
    optimizer = FleetOptimizers([member for member, _ in runs], fleet.members(trainer))
    sync = sync_of(trial.strategy, trial.accum_steps)
    scales = _train(trainer, optimizer, runs, start.data, start.shape, start.initial,
                    sync == "no_sync")
    final = fleet.every_member_parameters(trainer)
    if not trial.reports:
        return None
    final_reference = {spec.name: trial.references.get(
        (*start.key, spec.name), lambda spec=spec: big_batch_run(start.initial, spec, start.data)
    )[-1] for spec in optimizers}
    rows = []
    for i in range(0, len(runs), len(CANDIDATES)):
        member = runs[i][0]
        reference = final_reference[member.optimizer.name]
        against = [start.judged(final[i + j], reference) for j in range(len(CANDIDATES))]
        fit = scales[member.loss]
        rows.append({
            "micro_batch": MICRO_BATCH, "loss": member.loss, "sync": sync,
            "optimizer": member.optimizer.name, "optimizer_settings": member.optimizer.settings,
            "learning_rate": member.optimizer.lr, "steps": trial.options.steps,
            "grad_scale": fit.scale, "grad_residual": fit.residual, **against[0],
            **lr_factor_columns([a["update_error"] for a in against], fit.scale,
                                start.tolerance),
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
    grads = fleet.member_gradients(trainer, list(probes.values()))
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
