"""Experiment ``grad-scaler``: GradScaler with k-step accumulation, as PyTorch's AMP examples
prescribe it, and where clipping goes.

``torch.amp.GradScaler("cpu")``: ``scaler.scale(loss / k).backward()`` every micro-step,
then once per window ``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step``,
``scaler.update``. Compared with the big-batch run clipped at the same ``max_norm`` (or not
clipped, for ``no-clip``), and with the slip of clipping the still-scaled gradient
(``clip-before-unscale``). GradScaler accepts float64 gradients on the CPU (torch 2.13):
these rows run in the run's dtype.

Here: its recipes, columns and grid, its measurement (torch imported inside, so that the
spec reads without it) and its report parts (findings, answer, table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.report import spec
from harness.report.rows import ordered
from harness.report.section import Finding, SectionInputs
from harness.report.text import integers, number, span, strategy_name
from harness.strategies import STRATEGIES
from harness.studies.update import columns
from harness.studies.update.experiment import Experiment, Grid, report_part
from harness.studies.update.wording import IDENTITY, OUTCOME, SCALES, SettingsAnswer, verb

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from harness.strategies.common import StrategyTrainer
    from harness.studies.update.training import Member, Start
    from harness.studies.update.trial import ReferenceRuns, Trial

#: The recipes: where clipping happens relative to ``unscale_``.
NO_CLIP, UNSCALE_THEN_CLIP, CLIP_BEFORE_UNSCALE = (
    "no-clip", "unscale-then-clip", "clip-before-unscale")
SETTINGS = (NO_CLIP, UNSCALE_THEN_CLIP, CLIP_BEFORE_UNSCALE)
#: One process, and DDP's reduction.
STRATEGY_NAMES = ("local", "ddp")
#: max_norm of the clipping recipes, as a multiple of the big batch's first gradient norm:
#: below 1, so that the big batch clips.
MAX_NORM_RATIO = 0.5
COLUMNS = (
    columns.strategy(*STRATEGY_NAMES), columns.RANKS, columns.ACCUM_STEPS,
    *columns.recipe(losses=("mean/k",), syncs=("no_sync", "none"), optimizers=("sgd",)),
    columns.SETTING.described(
        "the GradScaler recipe: no clipping; `scaler.unscale_` then `clip_grad_norm_`; "
        "`clip_grad_norm_` on the still-scaled gradient", unit=", ".join(
            f"`{s}`" for s in SETTINGS)),
    columns.DTYPE_USED,
    *(c.described(c.doc + " (empty for `no-clip`)") for c in columns.CLIP_COLUMNS),
    columns.SCALE_BEFORE, columns.SCALE_AFTER,
    columns.PARAM_DISTANCE.described(columns.PARAM_DISTANCE.doc + ", clipped at the same "
                                     "`max_norm` where the recipe clips"),
    columns.UPDATE_ERROR, columns.VERDICT,
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """k micro-steps, one process, and DDP at the widest world size (every one in the full
    matrix)."""
    return [{"strategy": s, "world_size": n, "accum_steps": offered.accum_steps}
            for s in offered.strategies if s in STRATEGY_NAMES
            for n in ([1] if STRATEGIES[s].reference else offered.widest)]


def measure(trial: Trial) -> list[dict[str, Any]] | None:
    """A row per recipe: the parameters after T windows under one GradScaler against the big
    batch (clipped at the same max_norm where the recipe clips)."""
    from harness.studies.update import fleet, training
    from harness.studies.update.clip import UNCLIPPED, clip_columns
    from harness.studies.update.optimizers import OPTIMIZERS, PLAIN

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
    recipe = training.plain_sgd_columns(
        "mean/k", STRATEGIES[trial.strategy].sync(trial.accum_steps), start)
    rows = []
    for i, setting in enumerate(SETTINGS):
        reference, coefficient = _reference(setting, trial.references, start, max_norm)
        clipped = UNCLIPPED if setting == NO_CLIP else clip_columns(
            max_norm, MAX_NORM_RATIO, coefficient, coefficients[i])
        rows.append({**recipe, "steps": trial.options.steps, "setting": setting, **clipped,
                     "scale_before": scales[0], "scale_after": scales[-1],
                     **start.judged(final[i], reference)})
    return rows


def train_scaled(trainer: StrategyTrainer, runs: list[Member], start: Start, max_norm: float,
                 device_type: str) -> tuple[list[list[float]], list[float]]:
    """Every window under one GradScaler, each copy clipping as its setting says; the clip
    coefficients of the first window per copy, and the scale before and after each window."""
    import torch

    from harness.studies.update import fleet
    from harness.studies.update.clip import clip_and_measure
    from harness.studies.update.optimizers import OPTIMIZERS, PLAIN
    from harness.studies.update.training import accumulate_window

    copies = fleet.members(trainer)
    # One optimizer per copy: unscale_ acts on a whole optimizer, and the copies differ
    # exactly in when they unscale.
    optimizers = [OPTIMIZERS[PLAIN].build(c.parameters()) for c in copies]
    scaler = torch.amp.GradScaler(device_type)
    coefficients: list[list[float]] = [[] for _ in SETTINGS]
    scales = [scaler.get_scale()]
    for t, window in enumerate(start.data):
        accumulate_window(trainer, runs, window, start.shape,
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


def _reference(setting: str, references: ReferenceRuns, start: Start, max_norm: float
               ) -> tuple[torch.Tensor, float]:
    """The big-batch parameters a setting is compared with (clipped at ``max_norm`` where
    the setting clips), and the coefficient clipping applied to it at the first step."""
    from harness.studies.update.clip import clipped_reference
    from harness.studies.update.optimizers import OPTIMIZERS, PLAIN
    from harness.studies.update.training import big_batch_run

    if setting != NO_CLIP:
        return clipped_reference(references, start, max_norm)
    optimizer = OPTIMIZERS[PLAIN]
    reference = references.get((*start.key, PLAIN),
                               lambda: big_batch_run(start.initial, optimizer, start.data))[-1]
    return reference, float("nan")


@report_part()
def scaler_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    findings = []
    for setting, group in rows.groupby("setting", sort=False):
        verdicts = ordered(group, "verdict")
        where = ", ".join(f"{strategy_name(s)} at N = {integers(g['world_size'])}"
                          for s, g in group.groupby("strategy", sort=False))
        coefficient = ""
        if group["clip_coef_max"].notna().any():
            coefficient = (f"; clipping applied {span(group['clip_coef_max'], number)} where "
                           f"the big batch applied {span(group['clip_coef_reference'], number)}")
        findings.append(Finding(
            f"GradScaler with k = {integers(group['accum_steps'])} micro-steps, {setting} "
            f"({where}): the update {' / '.join(verb(v) for v in verdicts)} (update_error "
            f"{span(group['update_error'])}{coefficient}).",
            inputs.source(f"status = ok, setting = {setting}", len(group))))
    return findings


scaler_answers = SettingsAnswer(
    question="GradScaler with accumulation: which recipe gives the big batch's update?",
    fix="use", none="none measured")


scaler_table = spec.Records(
    caption=("**GradScaler** with k-step accumulation (scale every micro-step, step once per "
             "window), against the big batch (clipped at the same max_norm where the recipe "
             "clips). Rows of {csv} with status = ok ({rows} rows)."),
    columns=(*IDENTITY, ("recipe", spec.cell("setting")), *SCALES, *OUTCOME),
    numeric=(False, True, True, False, True, True, True, False))


EXPERIMENT = Experiment(
    name="grad-scaler",
    question="which GradScaler recipe gives the big batch's update?",
    intro=("`torch.amp.GradScaler` with k-step accumulation as PyTorch's AMP examples "
           "prescribe it (`scaler.scale(loss / k).backward()` every micro-step; once per "
           "window `unscale_`, `clip_grad_norm_`, `step`, `update`), and the slip of clipping "
           "the still-scaled gradient, against the big batch clipped at the same `max_norm` "
           "(0.5 × its gradient norm), or not clipped for `no-clip`."),
    columns=COLUMNS,
    grid=grid,
    measure=measure,
    cost_ms=10.0,
    findings=(scaler_answers, scaler_findings),
    tables=(scaler_table,),
)
