"""Experiment ``linear-scaling``: Goyal et al.'s rule, one step at lr*N against N steps at lr.

The measuring code is ``harness/studies/update/linear_scaling.py``; here: the plug-in, its
phases and schedules, verdict words, columns and grid, and its report parts (findings,
answer, figure).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Any

from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import count, integers, number, small
from harness.studies.update import schema
from harness.studies.update.experiment import Experiment, Grid, measured_in, report_part

if TYPE_CHECKING:
    import pandas as pd


class ScalingRule(StrEnum):
    """Whether Goyal's linear scaling rule held for one learning rate."""

    #: One step at lr * N on the N-times batch lands within the rule's tolerance of
    #: the N small steps at lr.
    HOLDS = "holds"
    BREAKS = "breaks"


#: One step from the study's initial weights, or from the weights after pre-training.
PHASES = ("initial", "trained")
#: Early training over 2W windows: lr * N from the first window, or Goyal's warm-up.
NO_WARM_UP, WARM_UP = "no-warm-up", "warm-up"
SCHEDULES = (NO_WARM_UP, WARM_UP)
STRATEGY = "local"
COLUMNS = (
    *schema.one_process("N: the small batches one big step takes at once"),
    schema.MICRO_BATCH, schema.holding(schema.LOSS, "mean"), schema.holding(schema.SYNC, "none"),
    schema.holding(schema.OPTIMIZER, "sgd"), schema.OPTIMIZER_SETTINGS,
    schema.LEARNING_RATE.described("the small-batch learning rate lr (the big step's: lr × N)"),
    schema.STEPS.described("big steps compared: 1, or 2W windows of early training"),
    schema.SETTING.described(
        "one step from the `initial` or the `trained` weights, or 2W steps of early training "
        "`no-warm-up` or with Goyal's `warm-up` over W = 5 steps",
        unit=", ".join(f"`{s}`" for s in (*PHASES, *SCHEDULES))),
    schema.DTYPE_USED, schema.LR_MULTIPLIER,
    schema.PARAM_DISTANCE.described("`‖θ - θ_ref‖ / ‖θ_ref‖`, θ_ref the N small steps"),
    schema.UPDATE_ERROR,
    schema.VERDICT.described("`update_error` within the rule's tolerance (0.1) or not",
                             unit=", ".join(f"`{v}`" for v in ScalingRule)),
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """One case per N >= 2 of the run (N = 1 compares a step with itself)."""
    if STRATEGY not in offered.strategies:
        return []
    return [{"strategy": STRATEGY, "world_size": n, "accum_steps": 1}
            for n in offered.sizes if n >= 2]


#: The rows of one step, and those of early training.
ONE_STEP = f"setting in {list(PHASES)}"
EARLY = f"setting in {list(SCHEDULES)}"


def _rule_limits(group: pd.DataFrame) -> tuple[float | None, float | None]:
    """The largest learning rate below which the rule held throughout, and the first break."""
    held, broke = None, None
    for _, row in group.sort_values("learning_rate").iterrows():
        if row["verdict"] == ScalingRule.HOLDS and broke is None:
            held = row["learning_rate"]
        elif row["verdict"] == ScalingRule.BREAKS and broke is None:
            broke = row["learning_rate"]
    return held, broke


@report_part(ONE_STEP)
def scaling_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = []
    for (n, phase), group in rows.groupby(["world_size", "setting"], sort=False):
        held, broke = _rule_limits(group)
        smallest = group.sort_values("learning_rate").iloc[0]
        text = f"N = {int(n)}, {phase}: "
        text += (f"held up to lr = {number(held)}" if held is not None
                 else "did not hold at any lr measured")
        if broke is not None:
            row = group[group["learning_rate"] == broke].iloc[0]
            text += f", broke from lr = {number(broke)} (update_error {small(row['update_error'])})"
        text += f"; update_error {small(smallest['update_error'])} at lr = " \
                f"{number(smallest['learning_rate'])}"
        clauses.append(text)
    return [Finding(
        "One SGD step at lr × N on the N-times batch against N steps at lr (the linear scaling "
        f"rule): {'; '.join(clauses)}.",
        inputs.source(f"status = ok, setting = {' or '.join(PHASES)}", len(rows)))]


@report_part(ONE_STEP)
def scaling_answers(rows: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    limits = []
    for phase, group in rows.groupby("setting", sort=False):
        held = [h for h, _ in (_rule_limits(g) for _, g in group.groupby("world_size"))]
        shown = "none" if any(h is None for h in held) else number(min(held))
        limits.append(f"{phase} weights: up to lr = {shown}")
    return [Answer(
        "lr × N for an N-times batch (linear scaling): up to which learning rate does one "
        "big step stand in for N small ones?",
        "; ".join(limits) + " at every N",
        f"{count(len(rows), 'run')}, N = {integers(rows['world_size'])}, lr = "
        f"{', '.join(number(v) for v in sorted(rows['learning_rate'].unique()))}")]


@report_part(EARLY)
def warm_up_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = []
    for n, group in rows.groupby("world_size", sort=False):
        by = {schedule: g.set_index("learning_rate") for schedule, g in group.groupby("setting")}
        plain, ramped = by.get(NO_WARM_UP), by.get(WARM_UP)
        if plain is None or ramped is None:
            continue
        held, broke = _rule_limits(plain.reset_index())
        text = (f"N = {int(n)} over {integers(group['steps'])} windows: lr × N from the first "
                f"step " + (f"held up to lr = {number(held)}" if held is not None
                            else "did not hold at any lr measured"))
        lowest = min(plain.index)
        lag = small(ramped.loc[lowest, "update_error"])
        text += (f"; the warm-up's run lagged by update_error {lag} at lr = {number(lowest)} "
                 f"(its first steps are smaller by design)")
        if broke is not None:
            text += "; where lr × N broke, update_error without / with warm-up: " + ", ".join(
                f"{small(plain.loc[lr, 'update_error'])} / {small(ramped.loc[lr, 'update_error'])}"
                f" at lr = {number(lr)}" for lr in sorted(plain.index) if lr >= broke)
        clauses.append(text)
    if not clauses:
        return []
    return [Finding(
        "Early training, one big step per window against the small-batch run's N steps (the "
        f"same batches): {'; '.join(clauses)}.",
        inputs.source(f"status = ok, setting = {' or '.join(SCHEDULES)}", len(rows)))]


@report_part(ONE_STEP)
def scaling_figure(rows: pd.DataFrame, inputs: SectionInputs) -> str | None:
    """update_error against lr per (N, phase) of the one-step rows, filled where the rule
    holds; titled by the largest lr at which it held everywhere."""
    from harness.report.figures import COLOURS, MARKERS, new_figure

    series = list(rows.groupby(["world_size", "setting"], sort=False))
    held = [h for _, g in series if (h := _rule_limits(g)[0]) is not None]
    title = (f"The linear scaling rule held up to lr = {number(min(held))} everywhere"
             if held and len(held) == len(series) else
             "The linear scaling rule failed somewhere at every lr")
    figure, grid = new_figure(3.8, title)
    axes = grid[0, 0]
    for i, ((n, phase), group) in enumerate(series):
        group = group.sort_values("learning_rate")
        holds = group["verdict"] == ScalingRule.HOLDS
        colour, marker = COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]
        axes.plot(group["learning_rate"], group["update_error"], color=colour,
                  linewidth=1.2, label=f"N = {int(n)}, {phase}")
        axes.plot(group["learning_rate"][holds], group["update_error"][holds],
                  linestyle="", marker=marker, color=colour)
        axes.plot(group["learning_rate"][~holds], group["update_error"][~holds],
                  linestyle="", marker=marker, color=colour, markerfacecolor="white")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("small-batch learning rate (big step: × N)")
    axes.set_ylabel("update_error")
    figure.legend(loc="lower center", ncols=len(series), frameon=False, columnspacing=1.2)
    caption = (f"Rows of `{inputs.csv_name}` with status = ok, setting = "
               f"{' or '.join(PHASES)} ({len(rows)} rows): ‖θ_big − θ_small‖ / ‖θ_small − θ_0‖ "
               f"after one step at lr × N against N steps at lr, per N and phase (initial "
               f"weights, or after pre-training); a filled marker where the rule holds "
               f"(`verdict`), an open one where it breaks.")
    return inputs.figures.save(figure, "update_linear_scaling", title, caption)


EXPERIMENT = Experiment(
    name="linear-scaling",
    question="up to which lr does one step at lr × N equal N steps at lr?",
    intro=("Goyal et al.'s linear scaling rule over a sweep of small-batch learning rates: one "
           "SGD step at lr × N on N batches at once against N steps at lr, from the initial "
           "weights and after pre-training; and early training over 2W windows, lr × N from "
           "the start or with Goyal's warm-up, against the small-batch run."),
    columns=COLUMNS,
    grid=grid,
    measure=measured_in("harness.studies.update.linear_scaling"),
    cost_ms=30.0,
    findings=(scaling_findings, scaling_answers, warm_up_findings),
    figures=(scaling_figure,),
)
