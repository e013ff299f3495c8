"""Experiment ``grad-scaler``: GradScaler with k-step accumulation, and where clipping goes.

The measuring code is ``harness/studies/update/grad_scaler.py``; here: the plug-in, its
recipes, columns and grid, and its report parts (findings, answer, table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.report import spec
from harness.report.rows import ordered
from harness.report.section import Finding, SectionInputs
from harness.report.text import integers, number, span, strategy_name
from harness.strategies import STRATEGIES
from harness.studies.update import schema
from harness.studies.update.experiment import Experiment, Grid, measured_in, report_part
from harness.studies.update.wording import IDENTITY, OUTCOME, SCALES, SettingsAnswer, verb

if TYPE_CHECKING:
    import pandas as pd

#: The recipes: where clipping happens relative to ``unscale_``.
NO_CLIP, UNSCALE_THEN_CLIP, CLIP_BEFORE_UNSCALE = (
    "no-clip", "unscale-then-clip", "clip-before-unscale")
SETTINGS = (NO_CLIP, UNSCALE_THEN_CLIP, CLIP_BEFORE_UNSCALE)
#: One process, and DDP's reduction.
STRATEGY_NAMES = ("local", "ddp")
COLUMNS = (
    schema.strategy(*STRATEGY_NAMES), schema.RANKS, schema.ACCUM_STEPS,
    *schema.recipe(losses=("mean/k",), syncs=("no_sync", "none"), optimizers=("sgd",)),
    schema.SETTING.described(
        "the GradScaler recipe: no clipping; `scaler.unscale_` then `clip_grad_norm_`; "
        "`clip_grad_norm_` on the still-scaled gradient", unit=", ".join(
            f"`{s}`" for s in SETTINGS)),
    schema.DTYPE_USED,
    *(c.described(c.doc + " (empty for `no-clip`)") for c in schema.CLIP_COLUMNS),
    schema.SCALE_BEFORE, schema.SCALE_AFTER,
    schema.PARAM_DISTANCE.described(schema.PARAM_DISTANCE.doc + ", clipped at the same "
                                    "`max_norm` where the recipe clips"),
    schema.UPDATE_ERROR, schema.VERDICT,
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """k micro-steps, one process, and DDP at the widest world size (every one in the full
    matrix)."""
    return [{"strategy": s, "world_size": n, "accum_steps": offered.accum_steps}
            for s in offered.strategies if s in STRATEGY_NAMES
            for n in ([1] if STRATEGIES[s].reference else offered.widest)]


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
    measure=measured_in("harness.studies.update.grad_scaler"),
    cost_ms=10.0,
    findings=(scaler_answers, scaler_findings),
    tables=(scaler_table,),
)
