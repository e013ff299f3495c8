"""The measurement of experiment ``lr-factor`` (lr_factor.py): the candidate factors, each
(loss, optimizer) pair trained at each, and the verdict on the best.

Here: the verdict words its rows carry (:class:`LrFactor`), the candidates (1 and 1/s) and
the factor each asks for (:func:`candidate_factor`), ``measure(trial)``, which trains the
fleet and fits each recipe's gradient scale at the first window, and the columns of the
best candidate (:func:`lr_factor_columns`). torch is imported inside the functions, so that
the experiment's spec, which names ``measure`` and reads the verdict words, loads without
it. Apart from lr_factor.py, which holds the spec and the report parts that read the rows.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from harness.strategies import STRATEGIES

if TYPE_CHECKING:
    import torch
    from torch import nn

    from harness.fit import ScaleFit
    from harness.strategies.common import StrategyTrainer
    from harness.studies.update.optimizers import OptimizerSpec
    from harness.studies.update.recipes import Shape
    from harness.studies.update.training import FleetOptimizers, Member, Window
    from harness.studies.update.trial import Trial


class LrFactor(StrEnum):
    """Whether some learning-rate factor c makes a recipe's run equal the big-batch run."""

    #: lr * c gives the big-batch parameters within the update tolerance.
    EXACT = "exact"
    #: Only within the approximate tolerance (e.g. Adam, whose scale invariance holds up to eps).
    APPROXIMATE = "approximate"
    #: No factor tried comes within the approximate tolerance (e.g. coupled weight decay).
    NONE = "none"


#: The learning-rate factors each (loss, optimizer) pair is trained with: its own lr,
#: and lr divided by the gradient scale s its recipe shows against the big batch.
SAME_LR, INVERSE_SCALE = "1", "1/s"
CANDIDATES = (SAME_LR, INVERSE_SCALE)


def measure(trial: Trial) -> list[dict[str, Any]] | None:
    """A row per (loss, optimizer) pair: its run at lr against the big batch's, its gradient
    scale s, and the best of the candidate factors."""
    from harness.studies.update import fleet
    from harness.studies.update.recipes import losses_for
    from harness.studies.update.training import FleetOptimizers, Member, Start, big_batch_run

    start = Start.of(trial, trial.options.steps)
    optimizers = optimizers_for(trial.strategy, trial.full)
    runs = [(Member(loss, spec), candidate) for loss in losses_for(trial.accum_steps)
            for spec in optimizers for candidate in CANDIDATES]
    trainer = fleet.fleet_trainer(trial.strategy, fleet.Fleet(start.initial, len(runs)),
                                  trial.world_size, trial.run)
    optimizer = FleetOptimizers([member for member, _ in runs], fleet.members(trainer))
    sync = STRATEGIES[trial.strategy].sync(trial.accum_steps)
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
        rows.append(_row(member, trial.options.steps, sync, scales[member.loss], against,
                         start.tolerance))
    return rows


def _row(member: Member, steps: int, sync: str, fit: ScaleFit, against: list[dict[str, Any]],
         tolerance: float) -> dict[str, Any]:
    """The row of one pair: its recipe, its gradient's fit, its run at lr judged, and the
    best candidate factor (``against``: each candidate's run judged, in CANDIDATES' order)."""
    from harness.studies.update.recipes import MICRO_BATCH

    return {
        "micro_batch": MICRO_BATCH, "loss": member.loss, "sync": sync,
        "optimizer": member.optimizer.name, "optimizer_settings": member.optimizer.settings,
        "learning_rate": member.optimizer.lr, "steps": steps,
        "grad_scale": fit.scale, "grad_residual": fit.residual, **against[0],
        **lr_factor_columns([a["update_error"] for a in against], fit.scale, tolerance),
    }


def optimizers_for(strategy: str, full: bool) -> list[OptimizerSpec]:
    from harness.studies.update.optimizers import FSDP_DEFAULT_OPTIMIZERS, OPTIMIZERS

    sharded = STRATEGIES[strategy].sharded
    names = FSDP_DEFAULT_OPTIMIZERS if sharded and not full else tuple(OPTIMIZERS)
    return [OPTIMIZERS[name] for name in names]


def candidate_factor(candidate: str, scale: float) -> float:
    """The learning-rate factor of a candidate; 1/s only for a usable (positive, finite) s."""
    if candidate == INVERSE_SCALE and math.isfinite(scale) and scale > 0:
        return 1.0 / scale
    return 1.0


def _train(trainer: StrategyTrainer, optimizer: FleetOptimizers, runs: list[tuple[Member, str]],
           data: list[Window], shape: Shape, initial: nn.Module, no_sync: bool
           ) -> dict[str, ScaleFit]:
    """Every window, each copy at its candidate's learning rate: set after the first window,
    once its recipe's gradient scale is known; the scales, per loss recipe."""
    from harness.studies.update.training import accumulate_window, big_batch_gradient

    scales: dict[str, ScaleFit] = {}
    for t, window in enumerate(data):
        accumulate_window(trainer, [m for m, _ in runs], window, shape, no_sync)
        if t == 0:
            scales = _gradient_scales(trainer, runs, big_batch_gradient(initial, window))
            for i, (member, candidate) in enumerate(runs):
                optimizer.set_lr_factor(i, candidate_factor(candidate, scales[member.loss].scale))
        optimizer.step()
    return scales


def _gradient_scales(trainer: StrategyTrainer, runs: list[tuple[Member, str]],
                     reference: torch.Tensor) -> dict[str, ScaleFit]:
    """Per loss recipe, its first window's gradient fitted against the big batch's.

    Read from the first copy of each recipe whose loss has no L2 term (that term is
    not scaled by the recipe): every copy of a recipe starts from the same weights."""
    from harness.fit import fit_scale
    from harness.studies.update import fleet

    probes: dict[str, int] = {}
    for i, (member, _) in enumerate(runs):
        if member.loss not in probes and not member.optimizer.l2_in_loss:
            probes[member.loss] = i
    grads = fleet.member_gradients(trainer, list(probes.values()))
    return {loss: fit_scale(g, reference) for loss, g in zip(probes, grads, strict=True)}


def lr_factor_columns(errors: list[float], scale: float, tolerance: float) -> dict[str, Any]:
    """The best candidate factor, its residual update error, and the verdict on it."""
    from harness.tolerances import APPROXIMATE_UPDATE_TOLERANCE

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
