"""Experiment ``non-finite``: a non-finite input on one rank under GradScaler with accumulation.

The grad-scaler recipe under DDP (or one process), three windows; in the second, the first
micro-batch of the last rank gets an infinite input. The loss stays finite (tanh
saturates) but the first layer's gradient is NaN (tanh's zero slope times the infinite
input); under ``no_sync`` it stays on that rank until the window's last micro-step
all-reduces it into every rank. Each rank reports whether ``scaler.step`` left its
parameters unchanged, and its scale.

Here: its columns and grid, its measurement (torch imported inside, so that the spec reads
without it) and its report parts (findings, answer, table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.report import spec
from harness.report.rows import is_true
from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import capitalized, count, integers, small, strategy_name
from harness.strategies import STRATEGIES
from harness.studies.schema import Column
from harness.studies.update import columns
from harness.studies.update.experiment import Experiment, Grid, report_part
from harness.studies.update.experiments.grad_scaler import grid as scaler_grid
from harness.studies.update.wording import IDENTITY, OUTCOME, SCALES, scale_text, whole
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from harness.strategies.common import StrategyTrainer
    from harness.studies.update.training import Start, Window
    from harness.studies.update.trial import Trial

#: Windows of the experiment, the one that holds the infinite input, and the micro-step it
#: is in (the first: under DDP's no_sync it reaches the others only through the window's
#: final all-reduce).
WINDOWS = 3
INJECTED_WINDOW = 1
INJECTED_MICRO_STEP = 0
COLUMNS = (
    columns.strategy("local", "ddp"), columns.RANKS, columns.ACCUM_STEPS,
    *columns.recipe(losses=("mean/k",), syncs=("no_sync", "none"), optimizers=("sgd",)),
    columns.SETTING.described("where the non-finite value was put", unit="text"),
    columns.DTYPE_USED,
    Column("window", "optimizer steps", "the window (optimizer step) the row describes, from 0"),
    Column("injected", "bool", "whether that window held the non-finite input"),
    Column("ranks_skipped", "ranks", "ranks whose `scaler.step` left the parameters unchanged "
           "in that window"),
    columns.SCALE_BEFORE,
    columns.SCALE_AFTER.described(columns.SCALE_AFTER.doc + "; equal on every rank when "
                                  "`scale_spread` is 0"),
    Column("scale_spread", "factor", "largest difference between a rank's scale after the "
           "window and rank 0's"),
    columns.PARAM_DISTANCE.described("`‖θ - θ_ref‖ / ‖θ_ref‖` after the window, θ_ref the "
                                     "big-batch run without the window holding the input"),
    columns.UPDATE_ERROR, columns.VERDICT,
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """The grad-scaler experiment's: one process, and DDP at the widest world size."""
    return scaler_grid(offered)


def measure(trial: Trial) -> list[dict[str, Any]] | None:
    """A row per window: which ranks skipped the step, the scale on every rank, and the
    parameters against the big batch that leaves the injected window out."""
    import torch

    from harness.studies.update import fleet
    from harness.studies.update.optimizers import OPTIMIZERS, PLAIN
    from harness.studies.update.recipes import windows
    from harness.studies.update.training import Start, big_batch_run, plain_sgd_columns

    start = Start.of(trial, WINDOWS)
    clean = windows(trial.run.seed, start.shape, WINDOWS, start.dtype)
    inject_non_finite(start.data, trial.world_size)
    trainer = fleet.fleet_trainer(trial.strategy, fleet.Fleet(start.initial, 1),
                                  trial.world_size, trial.run)
    per_window, parameters = _train_through_non_finite(trainer, start, trial.run.device.type)
    every_rank = _every_rank(torch.tensor(per_window, dtype=torch.float64), trial)
    if not trial.reports:
        return None
    reference = big_batch_run(start.initial, OPTIMIZERS[PLAIN], clean, skip=[INJECTED_WINDOW])
    recipe = plain_sgd_columns("mean/k", STRATEGIES[trial.strategy].sync(trial.accum_steps),
                               start)
    rows = []
    for w in range(WINDOWS):
        after = [float(rank[w, 2]) for rank in every_rank]
        rows.append({
            **recipe, "steps": WINDOWS,
            "setting": (f"inf in sample 0 of micro-step {INJECTED_MICRO_STEP} of device "
                        f"{trial.world_size - 1} in window {INJECTED_WINDOW}"),
            "window": w, "injected": w == INJECTED_WINDOW,
            "ranks_skipped": int(sum(rank[w, 0] for rank in every_rank)),
            "scale_before": float(every_rank[0][w, 1]), "scale_after": after[0],
            "scale_spread": max(abs(a - after[0]) for a in after),
            **start.judged(parameters[w], reference[w]),
        })
    return rows


def inject_non_finite(data: list[Window], world_size: int) -> None:
    """An infinite input in the first sample of the chosen micro-batch of the last device."""
    shard = data[INJECTED_WINDOW][INJECTED_MICRO_STEP][world_size - 1]
    shard.x[0, 0] = float("inf")


def _train_through_non_finite(trainer: StrategyTrainer, start: Start, device_type: str
                              ) -> tuple[list[tuple[float, float, float]], list[torch.Tensor]]:
    """One copy trained under a GradScaler; per window (skipped on this rank, scale before,
    scale after) and the parameters after it."""
    import torch

    from harness.studies.update import fleet
    from harness.studies.update.optimizers import OPTIMIZERS, PLAIN
    from harness.studies.update.training import Member, accumulate_window

    runs = [Member("mean/k", OPTIMIZERS[PLAIN])]
    member = fleet.members(trainer)[0]
    optimizer = OPTIMIZERS[PLAIN].build(member.parameters())
    scaler = torch.amp.GradScaler(device_type)
    per_window, parameters = [], []
    for window in start.data:
        scale_before = scaler.get_scale()
        accumulate_window(trainer, runs, window, start.shape,
                          no_sync=start.shape.accum_steps > 1, scale=scaler.scale)
        before = [p.detach().clone() for p in member.parameters()]
        scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        scaler.update()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, member.parameters(),
                                                          strict=True))
        per_window.append((float(unchanged), scale_before, scaler.get_scale()))
        parameters.append(fleet.every_member_parameters(trainer)[0])
    return per_window, parameters


def _every_rank(mine: torch.Tensor, trial: Trial) -> list[torch.Tensor]:
    """This rank's per-window record, or every rank's on rank 0 (a collective case)."""
    from harness.strategies.ddp import gather_to_leader

    if not STRATEGIES[trial.strategy].collective:
        return [mine]
    return gather_to_leader(mine, trial.run.group(trial.world_size), trial.run.device) or []


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
    measure=measure,
    cost_ms=5.0,
    findings=(non_finite_answers, non_finite_findings),
    tables=(non_finite_table,),
)
