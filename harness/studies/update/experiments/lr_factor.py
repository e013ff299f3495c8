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

Here: its columns, grid and verdict words, its measurement (torch imported inside, so that
the spec reads without it) and its report parts (the what-to-change table, its answers and
findings).
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from harness.report.rows import ordered
from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import count, integers, small, span, strategy_name, table, words
from harness.strategies import STRATEGIES
from harness.studies.schema import Column
from harness.studies.update import columns
from harness.studies.update.experiment import Experiment, Grid, report_part
from harness.studies.update.wording import factor_text, is_scaled
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd
    import torch
    from torch import nn

    from harness.fit import ScaleFit
    from harness.strategies.common import Trainer
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
STRATEGY_NAMES = ("local", "ddp", "fsdp", "dp-emulated", "dp")
COLUMNS = (
    columns.strategy(*STRATEGY_NAMES),
    columns.WORLD_SIZE.described(columns.WORLD_SIZE.doc + "; 1 for `local`"),
    columns.ACCUM_STEPS, *columns.recipe(), columns.GRAD_SCALE, columns.GRAD_RESIDUAL,
    columns.PARAM_DISTANCE, columns.UPDATE_ERROR, columns.VERDICT,
    Column("lr_factor", "ratio", "c: the run at lr·c gives the big-batch parameters "
           "(candidates 1 and 1/s; empty when none does)"),
    Column("lr_factor_residual", "ratio", "`update_error` of the run at lr·c for the best "
           "candidate"),
    Column("lr_factor_verdict", ", ".join(f"`{v}`" for v in LrFactor),
           "the residual within the update tolerance; within 1e-3; neither"),
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """One optimizer step per batch at every world size; k-step accumulation at the widest
    (every size in the full matrix); one process accumulates only. A sharded strategy's
    cases (FSDP) are the costliest: the widest sizes only, unless the matrix is full."""
    k = offered.accum_steps
    cases = []
    for strategy in (s for s in offered.strategies if s in STRATEGY_NAMES):
        spec = STRATEGIES[strategy]
        if spec.reference:
            pairs = [(1, k)]
        else:
            single = offered.widest if spec.sharded else offered.sizes
            pairs = [(n, 1) for n in single] + [(n, k) for n in offered.widest]
        cases += [{"strategy": strategy, "world_size": n, "accum_steps": steps}
                  for n, steps in pairs]
    return cases


def summary(rows: pd.DataFrame) -> str:
    """The verdicts on the factor at the widest world size, a column per optimizer."""
    shown = rows[(rows.status == "ok") & (rows.world_size == rows.world_size.max())]
    if shown.empty:
        return "no rows measured"
    table = shown.pivot_table(index=["strategy", "accum_steps", "loss"], columns="optimizer",
                              values="lr_factor_verdict", aggfunc="first", sort=False)
    return ("learning-rate factor that gives the big-batch update, at the widest world "
            "size (exact / approximate / none):\n" + table.to_string())


# ------------------------------------------------------------------ measuring
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


def _train(trainer: Trainer, optimizer: FleetOptimizers, runs: list[tuple[Member, str]],
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


def _gradient_scales(trainer: Trainer, runs: list[tuple[Member, str]], reference: torch.Tensor
                     ) -> dict[str, ScaleFit]:
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


# ------------------------------------------------------ the what-to-change table
def _cell(row, rtol: float) -> str:
    if row["verdict"] == Equivalence.MATCHES:
        return "✓"
    verdict = row["lr_factor_verdict"]
    if verdict == LrFactor.EXACT:
        return f"lr × {factor_text(row['lr_factor'], rtol)}"
    if verdict == LrFactor.APPROXIMATE:
        factor = factor_text(row["lr_factor"], rtol)
        what = "as is" if factor == "1" else f"lr × {factor}"
        return f"≈ {what} ({small(row['lr_factor_residual'])})"
    return f"✗ ({small(row['lr_factor_residual'])})"


@report_part()
def what_to_change(lr: pd.DataFrame, inputs: SectionInputs) -> str:
    widest = int(lr["world_size"].max())
    rows = lr[lr["world_size"] == widest]
    optimizers = ordered(rows, "optimizer")
    lines: dict[tuple, list[str]] = {}
    for (k, loss, strategy), group in rows.groupby(["accum_steps", "loss", "strategy"],
                                                   sort=False):
        by_optimizer = {r["optimizer"]: _cell(r, inputs.rtol) for _, r in group.iterrows()}
        scale = factor_text(float(group["grad_scale"].iloc[0]), inputs.rtol)
        key = (int(k), loss, scale, *(by_optimizer.get(o, "") for o in optimizers))
        lines.setdefault(key, []).append(strategy_name(strategy))
    body = [[str(key[0]), key[1], ", ".join(names), key[2], *key[3:]]
            for key, names in lines.items()]
    headers = ["k", "loss", "strategies", "s", *optimizers]
    caption = (f"**What to change** at N = {widest} devices: the parameters after "
               f"{integers(rows['steps'])} optimizer steps of each recipe (k micro-steps, the "
               f"loss) and optimizer, against one process on the big batch. s: the recipe's "
               f"gradient over the big batch's. ✓: equal as it is; lr × c: equal after "
               f"multiplying the learning rate by c (exact); ≈: equal only up to the residual "
               f"in brackets (`lr_factor_residual`, the update error as a fraction of the big "
               f"batch's update); ✗ (e): no factor gets closer than e. Rows of "
               f"`{inputs.csv_name}` with status = ok, world_size = "
               f"{widest} ({len(rows)} rows); strategies whose cells agree share a line; an empty "
               f"cell: that optimizer was not measured for that strategy.")
    return caption + "\n\n" + table(headers, body, [False] * 4 + [False] * len(optimizers))


# --------------------------------------------------------- lr-factor findings
def _matching_recipes(lr: pd.DataFrame) -> list[tuple[str, str, int, pd.DataFrame]]:
    """(strategy, loss, k, rows) of the recipes equal to the big batch with every optimizer."""
    found = []
    for (strategy, loss, k), group in lr.groupby(["strategy", "loss", "accum_steps"],
                                                 sort=False):
        if (group["verdict"] == Equivalence.MATCHES).all():
            found.append((strategy, loss, int(k), group))
    return found


def _evidence(recipes: list[tuple[str, str, int, pd.DataFrame]]) -> tuple[int, float]:
    """How many rows ``recipes`` hold, and their largest update_error."""
    together = [group for *_, group in recipes]
    return (sum(len(g) for g in together),
            max(float(g["update_error"].max()) for g in together))


def _by_strategy(recipes: list[tuple[str, str, int, pd.DataFrame]]) -> str:
    """``DDP: mean, sum/b, mean/k (k = 4); FSDP: mean``: the recipes, grouped by strategy."""
    losses: dict[str, list[str]] = {}
    for strategy, loss, k, _ in recipes:
        losses.setdefault(strategy, []).append(loss + (f" (k = {k})" if k > 1 else ""))
    return "; ".join(f"{strategy_name(s)}: {', '.join(names)}" for s, names in losses.items())


def _alike_strategies(recipes: list[tuple[str, str, int, pd.DataFrame]]) -> str:
    """``DDP, FSDP: mean, sum/b, mean/k; one process (local): mean/k``: each strategy's loss
    recipes (at any k: the evidence gives the k), strategies with the same ones sharing a
    clause, short enough for the answer table."""
    losses: dict[str, list[str]] = {}
    for strategy, loss, _, _ in recipes:
        if loss not in losses.setdefault(strategy, []):
            losses[strategy].append(loss)
    alike: dict[str, list[str]] = {}
    for strategy, names_ in losses.items():
        alike.setdefault(", ".join(names_), []).append(strategy_name(strategy))
    return "; ".join(f"{', '.join(s)}: {names_}" for names_, s in alike.items())


def _optimizer_outcomes(scaled: pd.DataFrame, rtol: float) -> dict[str, list[str]]:
    """Optimizers by what fixed a scaled gradient: lr/s exactly, lr as is approximately, none."""
    outcomes: dict[str, list[str]] = {}
    for optimizer, group in scaled.groupby("optimizer", sort=False):
        verdicts = set(group["lr_factor_verdict"])
        # The study writes the candidate it chose: exactly 1.0, or 1/s (never 1 where s ≠ 1).
        inverse = (group["lr_factor"] != 1).all()
        unchanged = (group["lr_factor"] == 1).all()
        if verdicts == {LrFactor.EXACT} and inverse:
            kind = "exact-inverse"
        elif verdicts == {LrFactor.APPROXIMATE} and unchanged:
            kind = "approximate-unchanged"
        elif verdicts == {LrFactor.NONE}:
            kind = "none"
        else:
            kind = "mixed"
        outcomes.setdefault(kind, []).append(optimizer)
    return outcomes


@report_part()
def lr_findings(lr: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    findings = []
    matching = _matching_recipes(lr)
    if matching:
        rows, worst = _evidence(matching)
        findings.append(Finding(
            f"Equal to the big-batch update with every optimizer, at the unchanged learning "
            f"rate, at every world size measured for it (N = {integers(lr['world_size'])} in "
            f"all): {_by_strategy(matching)} (largest update_error {small(worst)}).",
            inputs.source("status = ok, recipes whose every row has verdict = matches", rows)))
    scaled = lr[is_scaled(lr, inputs.rtol)]
    for (loss, k), group in scaled.groupby(["loss", "accum_steps"], sort=False):
        parts = []
        for strategy, by_strategy in group.groupby("strategy", sort=False):
            first = by_strategy.drop_duplicates("world_size")
            values = ", ".join(factor_text(s, inputs.rtol) for s in first["grad_scale"])
            parts.append(f"{values} for {strategy_name(strategy)} at N = "
                         f"{integers(first['world_size'])}")
        at_k = f" and k = {int(k)}" if int(k) > 1 else ""
        findings.append(Finding(
            f"With loss = {loss}{at_k}, the gradient was s times the big batch's: s = "
            f"{'; '.join(parts)}.",
            inputs.source(f"status = ok, loss = {loss}, accum_steps = {int(k)}, grad_scale ≠ 1",
                          len(group))))
    if not scaled.empty:
        findings.append(_optimizer_finding(scaled, inputs))
    return findings


def _optimizer_finding(scaled: pd.DataFrame, inputs: SectionInputs) -> Finding:
    outcomes = _optimizer_outcomes(scaled, inputs.rtol)

    def residuals(optimizers: list[str]) -> str:
        rows = scaled[scaled["optimizer"].isin(optimizers)]
        return f"lr_factor_residual {span(rows['lr_factor_residual'])}"

    clauses = []
    if chosen := outcomes.get("exact-inverse"):
        clauses.append(f"lr × 1/s restored it exactly for {words(chosen)} ({residuals(chosen)})")
    if chosen := outcomes.get("approximate-unchanged"):
        clauses.append(f"the unchanged lr came closest for {words(chosen)}, equal only "
                       f"approximately ({residuals(chosen)})")
    if chosen := outcomes.get("none"):
        clauses.append(f"no factor did for {words(chosen)} ({residuals(chosen)})")
    if chosen := outcomes.get("mixed"):
        clauses.append(f"the outcome depended on the recipe for {words(chosen)}")
    recipes = scaled.drop_duplicates(["strategy", "world_size", "accum_steps", "loss"])
    return Finding(
        f"Over the {count(len(recipes), 'recipe')} whose gradient was s ≠ 1 times the big "
        f"batch's, after {integers(scaled['steps'])} steps: {'; '.join(clauses)}.",
        inputs.source("status = ok, grad_scale ≠ 1", len(scaled)))


@report_part()
def lr_answers(lr: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    matching = _matching_recipes(lr)
    return [*_unchanged_answer(lr, matching), *_scaled_answer(lr, bool(matching), inputs.rtol)]


def _unchanged_answer(lr: pd.DataFrame, matching: list) -> list[Answer]:
    """Which losses give the big-batch update at the unchanged learning rate, if any does."""
    if not matching:
        return []
    runs, worst = _evidence(matching)
    return [Answer(
        "N devices or k micro-steps: which loss gives the big-batch update unchanged?",
        _alike_strategies(matching),
        f"{count(runs, 'run')} over {count(lr['optimizer'].nunique(), 'optimizer')} (N = "
        f"{integers(lr['world_size'])}, k = {integers(lr['accum_steps'])}), worst "
        f"update_error {small(worst)}")]


def _scaled_answer(lr: pd.DataFrame, some_matched: bool, rtol: float) -> list[Answer]:
    """Which learning rate restores the update of a recipe whose gradient is s ≠ 1 times the
    big batch's, per optimizer; ``some_matched``: a loss of the answer above is the fallback."""
    scaled = lr[is_scaled(lr, rtol)]
    if scaled.empty:
        return []
    outcomes = _optimizer_outcomes(scaled, rtol)
    answer = "; ".join(f"{label}: {words(outcomes[kind])}" for kind, label in (
        ("exact-inverse", "lr × 1/s, exact"), ("approximate-unchanged", "lr as is, ≈"),
        ("none", "no factor"), ("mixed", "depends")) if kind in outcomes)
    fix = []
    if "exact-inverse" in outcomes:
        fix.append(f"lr × 1/s for {words(outcomes['exact-inverse'])}")
    if "none" in outcomes and some_matched:
        fix.append("otherwise a loss of the row above")
    scales = scaled["grad_scale"]
    return [Answer(
        "Gradient s × the big batch's (a sum loss, a per-device normalization): which "
        "learning rate restores the update?", answer,
        f"{count(len(scaled), 'run')}, s from {factor_text(scales.min(), rtol)} to "
        f"{factor_text(scales.max(), rtol)}; lr_factor_residual "
        f"{span(scaled['lr_factor_residual'])}", "; ".join(fix))]


EXPERIMENT = Experiment(
    name="lr-factor",
    question="which learning-rate factor makes a recipe's update the big batch's?",
    intro=("Each loss recipe (N devices, k micro-steps) crossed with each optimizer, trained T "
           "steps at its own learning rate and at lr × 1/s (s: its gradient over the big "
           "batch's), against one process training on the big batch; which factor, if any, "
           "makes the parameters equal."),
    columns=COLUMNS,
    grid=grid,
    measure=measure,
    cost_ms=60.0,
    findings=(lr_answers, lr_findings),
    tables=(what_to_change,),
    summary=summary,
)
