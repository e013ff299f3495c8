"""Experiment ``grad-scaler``: GradScaler with k-step accumulation, as PyTorch's AMP examples
prescribe it.

``torch.amp.GradScaler("cpu")``: ``scaler.scale(loss / k).backward()`` every micro-step,
then once per window ``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step``,
``scaler.update``. Compared with the big-batch run clipped at the same ``max_norm`` (or not
clipped, for ``no-clip``), and with the slip of clipping the still-scaled gradient
(``clip-before-unscale``). GradScaler accepts float64 gradients on the CPU (torch 2.13):
these rows run in the run's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from harness.strategies import STRATEGIES
from harness.studies.update import fleet, training
from harness.studies.update.clipping import (
    UNCLIPPED,
    clip_and_measure,
    clip_columns,
    clipped_reference,
    plain_sgd_columns,
)
from harness.studies.update.experiments.grad_scaler import NO_CLIP, SETTINGS, UNSCALE_THEN_CLIP
from harness.studies.update.optimizers import OPTIMIZERS, PLAIN

if TYPE_CHECKING:
    from harness.studies.update.experiment import Trial
    from harness.studies.update.training import ReferenceRuns

#: max_norm of the clipping recipes, as a multiple of the big batch's first gradient norm:
#: below 1, so that the big batch clips.
MAX_NORM_RATIO = 0.5


def measure(trial: Trial) -> list[dict[str, Any]] | None:
    start = training.Start.of(trial, trial.options.steps)
    big_norm = float(training.big_batch_gradient(start.initial, start.data[0]).norm())
    max_norm = MAX_NORM_RATIO * big_norm
    runs = [training.Member("mean/k", OPTIMIZERS[PLAIN]) for _ in SETTINGS]
    trainer = fleet.fleet_trainer(trial.strategy, fleet.Fleet(start.initial, len(runs)),
                                  trial.world_size, trial.run)
    coefficients, scales = train_scaled(trainer, runs, start, max_norm, trial.run.device.type)
    final = fleet.every_member_parameters(trainer)
    if not trial.reports:
        return None
    recipe = plain_sgd_columns("mean/k", STRATEGIES[trial.strategy].sync(trial.accum_steps),
                               start)
    rows = []
    for i, setting in enumerate(SETTINGS):
        reference, coefficient = _reference(setting, trial.references, start, max_norm)
        clipped = UNCLIPPED if setting == NO_CLIP else clip_columns(
            max_norm, MAX_NORM_RATIO, coefficient, coefficients[i])
        rows.append({**recipe, "steps": trial.options.steps, "setting": setting, **clipped,
                     "scale_before": scales[0], "scale_after": scales[-1],
                     **start.judged(final[i], reference)})
    return rows


def train_scaled(trainer, runs: list[training.Member], start: training.Start, max_norm: float,
                 device_type: str) -> tuple[list[list[float]], list[float]]:
    """Every window under one GradScaler, each copy clipping as its setting says; the clip
    coefficients of the first window per copy, and the scale before and after each window."""
    copies = fleet.members(trainer)
    # One optimizer per copy: unscale_ acts on a whole optimizer, and the copies differ
    # exactly in when they unscale.
    optimizers = [OPTIMIZERS[PLAIN].build(c.parameters()) for c in copies]
    scaler = torch.amp.GradScaler(device_type)
    coefficients: list[list[float]] = [[] for _ in SETTINGS]
    scales = [scaler.get_scale()]
    for t, window in enumerate(start.data):
        training.accumulate_window(trainer, runs, window, start.shape,
                          no_sync=start.shape.accum_steps > 1, scale=scaler.scale)
        for i, setting in enumerate(SETTINGS):
            if setting == UNSCALE_THEN_CLIP:
                scaler.unscale_(optimizers[i])
            if setting != NO_CLIP:
                coefficient = clip_and_measure(list(copies[i].parameters()), max_norm)
                if t == 0:
                    coefficients[i].append(coefficient)
        for optimizer in optimizers:
            scaler.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        scaler.update()
        scales.append(scaler.get_scale())
    return coefficients, scales


def _reference(setting: str, references: ReferenceRuns, start: training.Start, max_norm: float
               ) -> tuple[torch.Tensor, float]:
    """The big-batch parameters a setting is compared with (clipped at ``max_norm`` where
    the setting clips), and the coefficient clipping applied to it at the first step."""
    if setting != NO_CLIP:
        return clipped_reference(references, start, max_norm)
    spec = OPTIMIZERS[PLAIN]
    reference = references.get((*start.key, PLAIN),
                               lambda: training.big_batch_run(start.initial, spec, start.data))[-1]
    return reference, float("nan")
