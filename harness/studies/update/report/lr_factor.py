"""The update section's lr-factor parts: the what-to-change table, its answers and findings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.rows import ordered
from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import count, integers, small, span, strategy_name, table, words
from harness.studies.update.report.wording import factor_text, is_scaled
from harness.studies.update.verdicts import LrFactor
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd


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
               f"`{inputs.csv_name}` with experiment = lr-factor, status = ok, world_size = "
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


def lr_findings(lr: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    findings = []
    matching = _matching_recipes(lr)
    if matching:
        together = [g for *_, g in matching]
        rows = sum(len(g) for g in together)
        worst = max(float(g["update_error"].max()) for g in together)
        findings.append(Finding(
            f"Equal to the big-batch update with every optimizer, at the unchanged learning "
            f"rate, at every world size measured for it (N = {integers(lr['world_size'])} in "
            f"all): {_by_strategy(matching)} (largest update_error {small(worst)}).",
            inputs.source("experiment = lr-factor, status = ok, recipes whose every row has "
                          "verdict = matches", rows)))
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
            inputs.source(f"experiment = lr-factor, status = ok, loss = {loss}, accum_steps = "
                          f"{int(k)}, grad_scale ≠ 1", len(group))))
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
        inputs.source("experiment = lr-factor, status = ok, grad_scale ≠ 1", len(scaled)))


def lr_answers(lr: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    answers = []
    matching = _matching_recipes(lr)
    if matching:
        together = [g for *_, g in matching]
        answers.append(Answer(
            "N devices or k micro-steps: which loss gives the big-batch update unchanged?",
            _alike_strategies(matching),
            f"{count(sum(len(g) for g in together), 'run')} over "
            f"{count(lr['optimizer'].nunique(), 'optimizer')} (N = "
            f"{integers(lr['world_size'])}, k = {integers(lr['accum_steps'])}), worst "
            f"update_error {small(max(float(g['update_error'].max()) for g in together))}"))
    scaled = lr[is_scaled(lr, inputs.rtol)]
    if not scaled.empty:
        outcomes = _optimizer_outcomes(scaled, inputs.rtol)
        answer = "; ".join(f"{label}: {words(outcomes[kind])}" for kind, label in (
            ("exact-inverse", "lr × 1/s, exact"), ("approximate-unchanged", "lr as is, ≈"),
            ("none", "no factor"), ("mixed", "depends")) if kind in outcomes)
        fix = []
        if "exact-inverse" in outcomes:
            fix.append(f"lr × 1/s for {words(outcomes['exact-inverse'])}")
        if "none" in outcomes and matching:
            fix.append("otherwise a loss of the row above")
        scales = scaled["grad_scale"]
        answers.append(Answer(
            "Gradient s × the big batch's (a sum loss, a per-device normalization): which "
            "learning rate restores the update?", answer,
            f"{count(len(scaled), 'run')}, s from {factor_text(scales.min(), inputs.rtol)} to "
            f"{factor_text(scales.max(), inputs.rtol)}; lr_factor_residual "
            f"{span(scaled['lr_factor_residual'])}", "; ".join(fix)))
    return answers
