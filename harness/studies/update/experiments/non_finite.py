"""Experiment ``non-finite``: one non-finite micro-batch on one rank under GradScaler.

The measuring code is ``harness/studies/update/non_finite.py``; here: the plug-in, its
columns and grid, and its report parts (findings, answer, table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.report import spec
from harness.report.rows import is_true
from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import capitalized, count, integers, small, strategy_name
from harness.studies.schema import Column
from harness.studies.update import schema
from harness.studies.update.experiment import Experiment, Grid, measured_in, report_part
from harness.studies.update.experiments.grad_scaler import grid as scaler_grid
from harness.studies.update.wording import IDENTITY, OUTCOME, SCALES, scale_text, whole
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = (
    schema.strategy("local", "ddp"), schema.RANKS, schema.ACCUM_STEPS,
    *schema.recipe(losses=("mean/k",), syncs=("no_sync", "none"), optimizers=("sgd",)),
    schema.SETTING.described("where the non-finite value was put", unit="text"),
    schema.DTYPE_USED,
    Column("window", "optimizer steps", "the window (optimizer step) the row describes, from 0"),
    Column("injected", "bool", "whether that window held the non-finite input"),
    Column("ranks_skipped", "ranks", "ranks whose `scaler.step` left the parameters unchanged "
           "in that window"),
    schema.SCALE_BEFORE,
    schema.SCALE_AFTER.described(schema.SCALE_AFTER.doc + "; equal on every rank when "
                                 "`scale_spread` is 0"),
    Column("scale_spread", "factor", "largest difference between a rank's scale after the "
           "window and rank 0's"),
    schema.PARAM_DISTANCE.described("`‖θ - θ_ref‖ / ‖θ_ref‖` after the window, θ_ref the "
                                    "big-batch run without the window holding the input"),
    schema.UPDATE_ERROR, schema.VERDICT,
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """The grad-scaler experiment's: one process, and DDP at the widest world size."""
    return scaler_grid(offered)


@report_part()
def non_finite_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    findings = []
    for (strategy, n), group in rows.groupby(["strategy", "world_size"], sort=False):
        injected = is_true(group["injected"])
        hit, others = group[injected], group[~injected]
        if hit.empty:
            continue
        row = hit.iloc[0]
        matched = (group["verdict"] == Equivalence.MATCHES).all()
        where = capitalized(f"{strategy_name(strategy)} at N = {int(n)}, {row['setting']}")
        skipped = (f"in that window {int(row['ranks_skipped'])} of {int(n)} ranks skipped the "
                   f"step and the scale went from {scale_text(row['scale_before'])} to "
                   f"{scale_text(row['scale_after'])} (largest difference between ranks "
                   f"{small(group['scale_spread'].max())})")
        rest = (f"in the other {count(len(others), 'window')} "
                f"{int(others['ranks_skipped'].sum())} ranks skipped")
        against = (f"Against the big batch that leaves that window out, every window "
                   f"{'matched' if matched else 'did not match'} (update_error ≤ "
                   f"{small(group['update_error'].max())})")
        findings.append(Finding(
            f"{where}: {skipped}; {rest}. {against}.",
            inputs.source(f"status = ok, strategy = {strategy}, world_size = {int(n)}",
                          len(group))))
    return findings


@report_part()
def non_finite_answers(rows: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    injected = is_true(rows["injected"])
    hit = rows[injected]
    if hit.empty:
        return []
    everywhere = (hit["ranks_skipped"] == hit["world_size"]).all()
    halved = ", ".join(dict.fromkeys(f"{scale_text(b)} → {scale_text(a)}" for b, a in
                                     zip(hit["scale_before"], hit["scale_after"], strict=True)))
    answer = (f"the whole step is skipped on {'every' if everywhere else 'not every'} rank; "
              f"scale {halved}")
    evidence = (f"{count(len(hit), 'injected window')} (N = {integers(hit['world_size'])}); "
                f"other windows skipped on {int(rows[~injected]['ranks_skipped'].sum())} ranks")
    return [Answer("GradScaler with accumulation: what does one non-finite micro-batch on one "
                   "rank do?", answer, evidence)]


non_finite_table = spec.Records(
    caption=("**A non-finite input** under GradScaler with k-step accumulation, window by "
             "window, against the big batch that leaves out the window holding it. Rows of "
             "{csv} with status = ok ({rows} rows)."),
    columns=(*IDENTITY[:2], ("where the input was", spec.cell("setting")),
             ("window", spec.cell("window", whole)),
             ("ranks skipped", lambda r: f"{int(r['ranks_skipped'])} of {int(r['world_size'])}"),
             *SCALES, *OUTCOME),
    numeric=(False, True, False, True, False, True, True, True, False))


EXPERIMENT = Experiment(
    name="non-finite",
    question="what does one non-finite micro-batch on one rank do?",
    intro=("The grad-scaler recipe over three windows; in the second, the first micro-batch of "
           "the last rank gets an infinite input (its loss stays finite, its gradient does "
           "not). Whether each rank's `scaler.step` skipped the step, the scale on every rank, "
           "and the parameters against the big batch without that window."),
    columns=COLUMNS,
    grid=grid,
    measure=measured_in("harness.studies.update.non_finite"),
    cost_ms=5.0,
    findings=(non_finite_answers, non_finite_findings),
    tables=(non_finite_table,),
)
