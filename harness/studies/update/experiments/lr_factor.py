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

Here: its columns, grid and report parts (the what-to-change table, its answers and
findings). Its measurement and the verdict words it writes are in lr_factor_measure.py
(torch imported inside, so that the spec reads without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.report.rows import ordered
from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import count, integers, small, span, strategy_name, table, words
from harness.strategies import STRATEGIES
from harness.studies.schema import Column
from harness.studies.update import columns
from harness.studies.update.experiment import Experiment, Grid, report_part
from harness.studies.update.experiments.lr_factor_measure import LrFactor, measure
from harness.studies.update.wording import factor_text, is_scaled
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd


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
