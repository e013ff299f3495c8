"""Experiment ``linear-scaling``: Goyal et al.'s rule, one step at lr*N vs N steps at lr.

The rule (Goyal et al. 2017, section 2.1): when the minibatch is multiplied by
N, multiply the learning rate by N. Its argument: N sequential SGD steps at lr
on N small batches move the weights by ``-lr * sum_j g(θ_j)``; one step at
``N * lr`` on the N batches at once moves them by ``-lr * sum_j g(θ_0)``. The two
agree when ``g(θ_j) ≈ g(θ_0)``: when the weights barely change over the N steps.
Large learning rates and the rapidly changing early phase break it; Goyal et al.
add a warm-up for the latter.

For each N of the run (>= 2), each learning rate of ``--update-lrs`` and two
phases -- ``initial`` (the study's initial weights) and ``trained`` (after
``PRETRAIN_STEPS`` steps of SGD on fresh N-device batches) -- one row: the
distance between the two results, relative to the parameters and to how far the
N small steps moved them. Small batch j comes from device j's distribution, so
that the big batch is the N-device batch of the other experiments.

Two more rows per N and learning rate follow early training over
``2 * WARMUP_WINDOWS`` windows from the initial weights: the N-device run takes
one big step per window, at lr * N from the start (``no-warm-up``) or with
Goyal et al.'s gradual warm-up (``warm-up``: lr * (1 + (N - 1) * t / W) at
window t, lr * N from window W on), against the small-batch run's N steps per
window at lr, on the same batches.

Here: its phases and schedules, verdict words, columns and grid, its measurement (torch
imported inside, so that the spec reads without it) and its report parts (findings,
answer, figure).
"""

from __future__ import annotations

import copy
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import count, integers, number, small
from harness.studies.update import columns
from harness.studies.update.experiment import Experiment, Grid, report_part

if TYPE_CHECKING:
    import pandas as pd
    import torch
    from torch import nn

    from harness.studies.update.trial import Trial
    from harness.tasks import Batch


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
#: Enough SGD steps for the loss to flatten out on this regression (the "later in
#: training" phase), at a learning rate well inside the stable range.
PRETRAIN_STEPS = 100
PRETRAIN_LR = 0.1
#: Goyal et al.'s warm-up length W, in windows (big steps); the runs are compared after 2W,
#: when the warmed-up run has spent as many windows at lr * N as it took to get there.
WARMUP_WINDOWS = 5
COLUMNS = (
    *columns.one_process("N: the small batches one big step takes at once"),
    columns.MICRO_BATCH, columns.holding(columns.LOSS, "mean"),
    columns.holding(columns.SYNC, "none"),
    columns.holding(columns.OPTIMIZER, "sgd"), columns.OPTIMIZER_SETTINGS,
    columns.LEARNING_RATE.described("the small-batch learning rate lr (the big step's: lr × N)"),
    columns.STEPS.described("big steps compared: 1, or 2W windows of early training"),
    columns.SETTING.described(
        "one step from the `initial` or the `trained` weights, or 2W steps of early training "
        "`no-warm-up` or with Goyal's `warm-up` over W = 5 steps",
        unit=", ".join(f"`{s}`" for s in (*PHASES, *SCHEDULES))),
    columns.DTYPE_USED, columns.LR_MULTIPLIER,
    columns.PARAM_DISTANCE.described("`‖θ - θ_ref‖ / ‖θ_ref‖`, θ_ref the N small steps"),
    columns.UPDATE_ERROR,
    columns.VERDICT.described("`update_error` within the rule's tolerance (0.1) or not",
                              unit=", ".join(f"`{v}`" for v in ScalingRule)),
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """One case per N >= 2 of the run (N = 1 compares a step with itself)."""
    if STRATEGY not in offered.strategies:
        return []
    return [{"strategy": STRATEGY, "world_size": n, "accum_steps": 1}
            for n in offered.sizes if n >= 2]


def measure(trial: Trial) -> list[dict[str, Any]]:
    """Rows of both phases, and of both warm-up schedules where early training is measured:
    the costly part, at the widest N alone unless the matrix is full."""
    from harness.studies.update.recipes import initial_model
    from harness.studies.update.training import flat_parameters
    from harness.tasks import Batch

    world_size, lrs = trial.world_size, trial.options.lrs
    dtype, seed = trial.run.dtype, trial.run.seed
    early = trial.full or world_size == max(trial.run.world_sizes)
    initial = initial_model(seed, dtype)
    # The phases in their order: the initial weights, and those after pre-training.
    starts = dict(zip(PHASES, (initial, pretrained(initial, world_size, seed, dtype)),
                      strict=True))
    batches = small_batches(seed, world_size, "update-linear-scaling", dtype)
    rows = []
    for phase in PHASES:
        start = starts[phase]
        for lr in lrs:
            sequential = copy.deepcopy(start)
            for batch in batches:
                sgd_step(sequential, batch, lr)
            one_big = copy.deepcopy(start)
            sgd_step(one_big, Batch.cat(batches), lr * world_size)
            small, big = flat_parameters(sequential), flat_parameters(one_big)
            rows.append(_row(lr, world_size, 1, phase, big, small, flat_parameters(start),
                             dtype, f"lr={lr * world_size:g}"))
    windows = early_windows(seed, world_size, dtype) if early else []
    for schedule in SCHEDULES if early else ():
        for lr in lrs:
            big, small = early_training(initial, windows, lr, world_size, schedule)
            ramp = f"lr ramped {lr:g} -> {lr * world_size:g} over {WARMUP_WINDOWS} steps"
            rows.append(_row(lr, world_size, len(windows), schedule, big, small,
                             flat_parameters(initial), dtype,
                             ramp if schedule == WARM_UP else f"lr={lr * world_size:g}"))
    return rows


def sgd_step(model: nn.Module, batch: Batch, lr: float) -> None:
    """One step of a fresh torch.optim.SGD (no state to carry) on the mean loss of ``batch``."""
    import torch

    from harness.studies.update.training import descend

    descend(model, torch.optim.SGD(model.parameters(), lr=lr), batch)


def small_batches(seed: int, world_size: int, key: str, dtype: torch.dtype) -> list[Batch]:
    """N batches of b samples, batch j from device j's distribution."""
    from harness.seeding import generator_for
    from harness.studies.update.recipes import MICRO_BATCH, TASK

    generator = generator_for(seed, key, world_size)
    return [TASK.make_shard(MICRO_BATCH, j, generator, dtype) for j in range(world_size)]


def pretrained(initial: nn.Module, world_size: int, seed: int, dtype: torch.dtype) -> nn.Module:
    """The initial weights after PRETRAIN_STEPS steps on fresh N-device batches."""
    from harness.seeding import generator_for
    from harness.studies.update.recipes import MICRO_BATCH, TASK
    from harness.tasks import Batch

    model = copy.deepcopy(initial)
    generator = generator_for(seed, "update-pretrain", world_size)
    for _ in range(PRETRAIN_STEPS):
        batch = Batch.cat([TASK.make_shard(MICRO_BATCH, j, generator, dtype)
                           for j in range(world_size)])
        sgd_step(model, batch, PRETRAIN_LR)
    return model


def big_step_factor(schedule: str, window: int, world_size: int) -> float:
    """The big step's learning rate over the small steps' at ``window`` (0-based)."""
    if schedule != WARM_UP:
        return world_size
    return 1 + (world_size - 1) * min(1.0, window / WARMUP_WINDOWS)


def early_windows(seed: int, world_size: int, dtype: torch.dtype) -> list[list[Batch]]:
    """2W windows of N small batches each: the early-training comparison's data."""
    return [small_batches(seed, world_size, f"update-warm-up/{t}", dtype)
            for t in range(2 * WARMUP_WINDOWS)]


def early_training(start: nn.Module, windows: list[list[Batch]], lr: float, world_size: int,
                   schedule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(big-batch run, small-batch run) parameters after every window, from ``start``."""
    import torch

    from harness.studies.update.training import descend, flat_parameters
    from harness.tasks import Batch

    small, big = copy.deepcopy(start), copy.deepcopy(start)
    small_sgd = torch.optim.SGD(small.parameters(), lr=lr)
    big_sgd = torch.optim.SGD(big.parameters(), lr=lr)
    for t, window in enumerate(windows):
        for batch in window:
            descend(small, small_sgd, batch)
        big_sgd.param_groups[0]["lr"] = lr * big_step_factor(schedule, t, world_size)
        descend(big, big_sgd, Batch.cat(window))
    return flat_parameters(big), flat_parameters(small)


def _row(lr: float, world_size: int, steps: int, setting: str, big: torch.Tensor,
         small: torch.Tensor, start: torch.Tensor, dtype: torch.dtype,
         big_lr: str) -> dict[str, Any]:
    from harness.fit import relative_error
    from harness.studies.update.recipes import MICRO_BATCH
    from harness.studies.update.training import update_error
    from harness.tolerances import LINEAR_SCALING_TOLERANCE, dtype_name

    error = update_error(big, small, start)
    return {
        "micro_batch": MICRO_BATCH, "loss": "mean", "sync": "none", "optimizer": "sgd",
        "optimizer_settings": f"SGD lr={lr:g} (big step: {big_lr})",
        "learning_rate": lr, "steps": steps, "setting": setting, "dtype_used": dtype_name(dtype),
        "lr_multiplier": world_size, "device": "cpu",
        "param_distance": relative_error(big, small), "update_error": error,
        "verdict": (ScalingRule.HOLDS if error <= LINEAR_SCALING_TOLERANCE
                    else ScalingRule.BREAKS),
    }


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
    measure=measure,
    cost_ms=30.0,
    findings=(scaling_findings, scaling_answers, warm_up_findings),
    figures=(scaling_figure,),
)
