"""The ``update`` study's section: what to change when N devices or k micro-steps make the batch.

Every number and word comes from the rows of ``update.csv``: the verdicts
(``verdict``, ``lr_factor_verdict``) were written by the study; this module
groups them into the "what to change" table, answers, findings, a figure and
two tables. It knows the experiments' names and columns, never their outcomes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.rows import is_true, measured, ordered
from harness.report.section import Answer, Finding, Section, SectionInputs, SectionOutput
from harness.report.text import (
    capitalized,
    count,
    integers,
    number,
    small,
    span,
    strategy_name,
    table,
    words,
)
from harness.studies.update.verdicts import LrFactor, ScalingRule
from harness.verdicts import Equivalence, close

if TYPE_CHECKING:
    import pandas as pd

#: linear-scaling settings of the early-training comparison (linear_scaling.SCHEDULES).
WARM_UP_SCHEDULES = ("no-warm-up", "warm-up")

COLUMNS = (
    "experiment", "strategy", "world_size", "accum_steps", "micro_batch", "loss", "sync",
    "optimizer", "learning_rate", "steps", "setting", "dtype_used", "grad_scale",
    "param_distance", "update_error", "verdict", "lr_factor", "lr_factor_residual",
    "lr_factor_verdict", "max_norm_ratio", "clip_coef_reference", "clip_coefs", "clip_coef_min",
    "clip_coef_max", "window", "injected", "ranks_skipped", "scale_before", "scale_after",
    "scale_spread", "grad_error", "lr_multiplier",
)


def render(frame: pd.DataFrame, inputs: SectionInputs) -> SectionOutput:
    ok = measured(frame)
    output = SectionOutput()
    parts = {name: ok[ok["experiment"] == name] for name in ordered(ok, "experiment")}
    lr = parts.get("lr-factor")
    if lr is not None:
        output.blocks.append(_what_to_change(lr, inputs))
        output.answers += _lr_answers(lr, inputs)
        output.findings += _lr_findings(lr, inputs)
    scaling, early = _split_scaling(parts.get("linear-scaling"))
    figure = _figure(scaling, parts.get("bf16-accumulation"), inputs)
    if figure:
        output.blocks.append(figure)
    if (clipping := parts.get("clipping")) is not None:
        output.answers += _clipping_answers(clipping, inputs)
        output.findings += _clipping_findings(clipping, inputs)
        output.blocks.append(_clipping_table(clipping, inputs))
    scaler, non_finite = parts.get("grad-scaler"), parts.get("non-finite")
    if scaler is not None:
        output.findings += _scaler_findings(scaler, inputs)
    if non_finite is not None:
        output.findings += _non_finite_findings(non_finite, inputs)
        output.answers += _non_finite_answers(non_finite, scaler, inputs)
    if scaler is not None or non_finite is not None:
        output.blocks.append(_scaler_table(scaler, non_finite, inputs))
    if (bf16 := parts.get("bf16-accumulation")) is not None:
        output.findings += _bf16_findings(bf16, inputs)
    if scaling is not None:
        output.findings += _scaling_findings(scaling, inputs)
        output.answers += _scaling_answers(scaling, inputs)
    if early is not None:
        output.findings += _warm_up_findings(early, inputs)
    if (momentum := parts.get("momentum-correction")) is not None:
        output.findings += _momentum_findings(momentum, inputs)
        output.answers += _momentum_answers(momentum, inputs)
    output.findings += _skipped_findings(frame, inputs)
    return output


# ------------------------------------------------------------------ wording
def factor_text(factor: float, rtol: float) -> str:
    """``1/4``, ``3``, ``1``, or the number when neither it nor its inverse is an integer."""
    if factor >= 1 and close(factor, round(factor), rtol):
        return str(round(factor))
    if factor < 1 and close(1 / factor, round(1 / factor), rtol):
        return f"1/{round(1 / factor)}"
    return number(factor)


def recipe_name(row) -> str:
    """``DDP, N = 4, loss = sum`` (with ``k = 4`` when accumulating)."""
    k = f", k = {int(row['accum_steps'])}" if int(row["accum_steps"]) > 1 else ""
    return f"{strategy_name(row['strategy'])}, N = {int(row['world_size'])}{k}, loss = " \
           f"{row['loss']}"


def _scaled(rows: pd.DataFrame, rtol: float) -> pd.Series:
    """Rows whose gradient is not the big batch's (s ≠ 1)."""
    return ~rows["grad_scale"].map(lambda s: close(s, 1.0, rtol))


def _scale(value: float) -> str:
    """GradScaler's scale, a power of two: ``65536``, not ``6.554e+04``."""
    return f"{value:.0f}" if value == int(value) else number(value)


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


def _what_to_change(lr: pd.DataFrame, inputs: SectionInputs) -> str:
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


def _recipe_label(strategy: str, loss: str, k: int) -> str:
    return f"{strategy_name(strategy)} {loss}" + (f" (k = {k})" if k > 1 else "")


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
        inverse = all(close(f, 1 / s, rtol) for f, s in zip(group["lr_factor"],
                                                             group["grad_scale"], strict=True))
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


def _lr_findings(lr: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
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
    scaled = lr[_scaled(lr, inputs.rtol)]
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


def _lr_answers(lr: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
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
    scaled = lr[_scaled(lr, inputs.rtol)]
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


# ------------------------------------------------------------------- clipping
def _coefficients(row) -> str:
    low, high = row["clip_coef_min"], row["clip_coef_max"]
    return number(low) if close(low, high, 1e-12) else f"{number(low)} to {number(high)}"


def _clipping_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    findings = []
    for (strategy, setting), group in rows.groupby(["strategy", "setting"], sort=False):
        clauses = []
        for _, row in group.iterrows():
            clauses.append(f"at max_norm = {number(row['max_norm_ratio'])} × ‖g_big‖ it applied "
                           f"{_coefficients(row)} where the big batch applied "
                           f"{number(row['clip_coef_reference'])}, and the update "
                           f"{_verb(row['verdict'])} (update_error "
                           f"{small(row['update_error'])})")
        findings.append(Finding(
            capitalized(f"{strategy_name(strategy)} clipping {setting} (N = "
                      f"{integers(group['world_size'])}, k = {integers(group['accum_steps'])}): "
                      f"{'; '.join(clauses)}."),
            inputs.source(f"experiment = clipping, status = ok, strategy = {strategy}, "
                          f"setting = {setting}", len(group))))
    return findings


def _verb(verdict: str) -> str:
    return "matched the big batch's" if verdict == Equivalence.MATCHES else "differed"


def _clipping_answers(rows: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    by_setting = {setting: group for setting, group in rows.groupby("setting", sort=False)}
    right = [s for s, g in by_setting.items() if (g["verdict"] == Equivalence.MATCHES).all()]
    wrong = [s for s, g in by_setting.items() if s not in right]
    if not by_setting:
        return []
    worst = rows[rows["setting"].isin(wrong)]["update_error"].max() if wrong else 0.0
    return [Answer(
        "Where must clip_grad_norm_ run to clip the big batch's gradient?",
        f"{words(right, 'or') or 'nowhere measured'}"
        + (f"; not {words(wrong, 'or')}" if wrong else ""),
        f"{count(len(rows), 'run')}; update_error up to {small(worst)} where it differs",
        f"clip {words(right, 'or')}" if right and wrong else "")]


def _clipping_table(rows: pd.DataFrame, inputs: SectionInputs) -> str:
    body = [[strategy_name(r["strategy"]), str(int(r["world_size"])), str(int(r["accum_steps"])),
             r["setting"], number(r["max_norm_ratio"]), number(r["clip_coef_reference"]),
             str(r["clip_coefs"]).replace(";", "; "), small(r["update_error"]), r["verdict"]]
            for _, r in rows.iterrows()]
    headers = ["strategy", "N", "k", "where it clips", "max_norm / ‖g_big‖", "big batch's coef",
               "coefficients applied (first step)", "update_error", "verdict"]
    caption = (f"**Clipping**: the factor each `clip_grad_norm_` call applied at the first step "
               f"(per micro-step, or per rank), measured as ‖g after‖ / ‖g before‖, and the "
               f"update error after {integers(rows['steps'])} steps against the big batch "
               f"clipped at the same max_norm.")
    return _table_of_rows(caption, inputs, "clipping", len(rows), headers, body,
                          "-++-++-+-")


# ----------------------------------------------------------------- GradScaler
def _scaler_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
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
            f"({where}): the update {' / '.join(_verb(v) for v in verdicts)} (update_error "
            f"{span(group['update_error'])}{coefficient}).",
            inputs.source(f"experiment = grad-scaler, status = ok, setting = {setting}",
                          len(group))))
    return findings


def _non_finite_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
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
                   f"step and the scale went from {_scale(row['scale_before'])} to "
                   f"{_scale(row['scale_after'])} (largest difference between ranks "
                   f"{small(group['scale_spread'].max())})")
        rest = (f"in the other {count(len(others), 'window')} "
                f"{int(others['ranks_skipped'].sum())} ranks skipped")
        against = (f"Against the big batch that leaves that window out, every window "
                   f"{'matched' if matched else 'did not match'} (update_error ≤ "
                   f"{small(group['update_error'].max())})")
        findings.append(Finding(
            f"{where}: {skipped}; {rest}. {against}.",
            inputs.source(f"experiment = non-finite, status = ok, strategy = {strategy}, "
                          f"world_size = {int(n)}", len(group))))
    return findings


def _non_finite_answers(rows: pd.DataFrame, scaler: pd.DataFrame | None,
                        inputs: SectionInputs) -> list[Answer]:
    injected = is_true(rows["injected"])
    hit = rows[injected]
    if hit.empty:
        return []
    everywhere = (hit["ranks_skipped"] == hit["world_size"]).all()
    halved = ", ".join(dict.fromkeys(f"{_scale(b)} → {_scale(a)}" for b, a in
                                     zip(hit["scale_before"], hit["scale_after"], strict=True)))
    answer = (f"the whole step is skipped on {'every' if everywhere else 'not every'} rank; "
              f"scale {halved}")
    evidence = (f"{count(len(hit), 'injected window')} (N = {integers(hit['world_size'])}); "
                f"other windows skipped on {int(rows[~injected]['ranks_skipped'].sum())} ranks")
    fix = ""
    if scaler is not None:
        right = [s for s, g in scaler.groupby("setting", sort=False)
                 if (g["verdict"] == Equivalence.MATCHES).all()]
        fix = f"GradScaler recipes equal to the big batch: {words(right, 'and')}" if right else ""
    return [Answer("GradScaler with accumulation: what does one non-finite micro-batch on one "
                   "rank do?", answer, evidence, fix)]


def _scaler_table(scaler, non_finite, inputs: SectionInputs) -> str:
    body = []
    for rows in (scaler, non_finite):
        if rows is None:
            continue
        for _, r in rows.iterrows():
            window = "" if r["window"] != r["window"] else str(int(r["window"]))
            skipped = "" if r["ranks_skipped"] != r["ranks_skipped"] else \
                f"{int(r['ranks_skipped'])} of {int(r['world_size'])}"
            body.append([r["experiment"], strategy_name(r["strategy"]), str(int(r["world_size"])),
                         r["setting"], window, skipped, _scale(r["scale_before"]),
                         _scale(r["scale_after"]), small(r["update_error"]), r["verdict"]])
    headers = ["experiment", "strategy", "N", "setting", "window", "ranks skipped",
               "scale before", "scale after", "update_error", "verdict"]
    shown = sum(len(r) for r in (scaler, non_finite) if r is not None)
    caption = ("**GradScaler** with k-step accumulation (scale every micro-step, step once per "
               "window), against the big batch (clipped at the same max_norm where the recipe "
               "clips; leaving out the window with the non-finite input for non-finite).")
    return _table_of_rows(caption, inputs, "grad-scaler or non-finite", shown, headers, body,
                          "--+-+-+++-")


def _table_of_rows(caption: str, inputs: SectionInputs, experiments: str, shown: int,
                   headers: list[str], body: list[list[str]], numeric: str) -> str:
    """``caption``, the rows it shows cited, and the table; ``numeric``: + per right-aligned
    column, - per text column."""
    cited = (f" Rows of `{inputs.csv_name}` with experiment = {experiments}, status = ok "
             f"({shown} rows).")
    return caption + cited + "\n\n" + table(headers, body, [c == "+" for c in numeric])


# -------------------------------------------------------------- bf16, scaling
def _bf16_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = []
    for setting, group in rows.groupby("setting", sort=False):
        ordered_k = group.sort_values("accum_steps")
        first, last = ordered_k.iloc[0], ordered_k.iloc[-1]
        clauses.append(f"{setting} ({group['dtype_used'].iloc[0]} gradients): "
                       f"{small(first['grad_error'])} at k = {int(first['accum_steps'])}, "
                       f"{small(last['grad_error'])} at k = {int(last['accum_steps'])}")
    window = int(rows["micro_batch"].iloc[0] * rows["accum_steps"].iloc[0])
    return [Finding(
        f"Accumulating one window of {window} samples in k micro-steps, the gradient's error "
        f"against float64 was {'; '.join(clauses)}.",
        inputs.source("experiment = bf16-accumulation, status = ok", len(rows)))]


def _rule_limits(group: pd.DataFrame) -> tuple[float | None, float | None]:
    """The largest learning rate below which the rule held throughout, and the first break."""
    held, broke = None, None
    for _, row in group.sort_values("learning_rate").iterrows():
        if row["verdict"] == ScalingRule.HOLDS and broke is None:
            held = row["learning_rate"]
        elif row["verdict"] == ScalingRule.BREAKS and broke is None:
            broke = row["learning_rate"]
    return held, broke


def _scaling_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
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
        inputs.source("experiment = linear-scaling, status = ok", len(rows)))]


def _scaling_answers(rows: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
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


def _split_scaling(rows: pd.DataFrame | None) -> tuple[pd.DataFrame | None, ...]:
    """(one-step rows, early-training rows with and without warm-up); None where empty."""
    if rows is None:
        return None, None
    early = rows["setting"].isin(WARM_UP_SCHEDULES)
    return tuple(part if len(part) else None for part in (rows[~early], rows[early]))


def _warm_up_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = []
    for n, group in rows.groupby("world_size", sort=False):
        by = {schedule: g.set_index("learning_rate") for schedule, g in group.groupby("setting")}
        plain, ramped = by.get("no-warm-up"), by.get("warm-up")
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
        inputs.source("experiment = linear-scaling, setting = no-warm-up or warm-up, status = "
                      "ok", len(rows)))]


def _momentum_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = [f"{row['setting']} {row['verdict']} (update_error {small(row['update_error'])})"
               for _, row in rows.iterrows()]
    first = rows.iloc[0]
    return [Finding(
        f"Momentum SGD written with lr inside the velocity (v ← m v + lr g), lr × "
        f"{int(first['lr_multiplier'])} after {int(first['steps']) // 2} of "
        f"{int(first['steps'])} steps, against torch.optim.SGD (v ← m v + g, θ ← θ − lr v): "
        f"{'; '.join(clauses)}.",
        inputs.source("experiment = momentum-correction, status = ok", len(rows)))]


def _momentum_answers(rows: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    verdicts = dict(zip(rows["setting"], rows["verdict"], strict=True))
    needed = (verdicts.get("lr-inside-corrected") == Equivalence.MATCHES
              and verdicts.get("lr-inside-uncorrected") == Equivalence.DIFFERS)
    return [Answer(
        "Momentum after an lr change (Goyal's momentum correction): needed with torch.optim.SGD?",
        "no: torch's form equals the corrected one" if needed else
        "see the momentum-correction rows: " + ", ".join(f"{k} {v}" for k, v in verdicts.items()),
        "; ".join(f"{setting}: update_error {small(error)}"
                  for setting, error in zip(rows["setting"], rows["update_error"], strict=True)),
        "only a hand-written lr-inside momentum needs v × lr_new / lr_old" if needed else "")]


# --------------------------------------------------------------------- figure
def _figure(scaling, bf16, inputs: SectionInputs) -> str | None:
    if scaling is None and bf16 is None:
        return None
    from matplotlib.figure import Figure

    from harness.report.figures import COLOURS, MARKERS

    figure = Figure(figsize=(10, 4.4), dpi=100)
    axes = figure.subplots(1, 2)
    figure.subplots_adjust(left=0.08, right=0.98, bottom=0.3, top=0.86, wspace=0.28)
    titles = []
    if scaling is not None:
        series = list(scaling.groupby(["world_size", "setting"], sort=False))
        for i, ((n, phase), group) in enumerate(series):
            group = group.sort_values("learning_rate")
            holds = group["verdict"] == ScalingRule.HOLDS
            colour, marker = COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]
            axes[0].plot(group["learning_rate"], group["update_error"], color=colour,
                         linewidth=1.2, label=f"N = {int(n)}, {phase}")
            axes[0].plot(group["learning_rate"][holds], group["update_error"][holds],
                         linestyle="", marker=marker, color=colour)
            axes[0].plot(group["learning_rate"][~holds], group["update_error"][~holds],
                         linestyle="", marker=marker, color=colour, markerfacecolor="white")
        axes[0].set_xscale("log")
        axes[0].set_yscale("log")
        axes[0].set_xlabel("small-batch learning rate (big step: × N)")
        axes[0].set_ylabel("update_error")
        axes[0].set_title("Linear scaling rule: filled = holds, open = breaks")
        axes[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, fontsize=8,
                       frameon=False)
        held = [h for _, g in series if (h := _rule_limits(g)[0]) is not None]
        titles.append(f"the linear scaling rule held up to lr = {number(min(held))} everywhere"
                      if held and len(held) == len(series) else
                      "the linear scaling rule failed somewhere at every lr")
    if bf16 is not None:
        for i, (setting, group) in enumerate(bf16.groupby("setting", sort=False)):
            group = group.sort_values("accum_steps")
            axes[1].plot(group["accum_steps"], group["grad_error"], color=COLOURS[i],
                         marker=MARKERS[i], label=setting)
        axes[1].set_xscale("log", base=2)
        axes[1].set_yscale("log")
        ks = sorted(int(k) for k in bf16["accum_steps"].unique())
        axes[1].set_xticks(ks, [str(k) for k in ks])
        axes[1].minorticks_off()
        axes[1].set_xlabel("micro-steps k (one window of fixed size)")
        axes[1].set_ylabel("grad_error vs float64")
        axes[1].set_title("Accumulated gradient's error by precision")
        axes[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, fontsize=8,
                       frameon=False)
        bf = bf16[bf16["setting"] == "bfloat16"].sort_values("accum_steps")
        if len(bf) >= 2:
            titles.append(f"bfloat16 gradients' error went from {small(bf['grad_error'].iloc[0])}"
                          f" to {small(bf['grad_error'].iloc[-1])} as k grew to "
                          f"{int(bf['accum_steps'].iloc[-1])}")
    title = "; ".join(titles)
    figure.suptitle(title[:1].upper() + title[1:], fontsize=10, fontweight="bold")
    shown = sum(len(r) for r in (scaling, bf16) if r is not None)
    caption = (f"Left: rows of `{inputs.csv_name}` with experiment = linear-scaling, status = "
               f"ok: ‖θ_big − θ_small‖ / ‖θ_small − θ_0‖ after one step at lr × N against N "
               f"steps at lr, per N and phase (initial weights, or after pre-training). Right: "
               f"experiment = bf16-accumulation: the accumulated gradient against float64, per "
               f"precision. {shown} rows.")
    return inputs.figures.save(figure, "update_scaling_and_bf16", title, caption)


# -------------------------------------------------------------------- skipped
def _skipped_findings(frame: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    skipped = frame[frame["status"] != "ok"]
    findings = []
    for strategy, group in skipped.groupby("strategy", sort=False):
        reasons = ordered(group, "status")
        findings.append(Finding(
            f"{strategy_name(strategy)} was not measured in {count(len(group), 'case')} "
            f"({'; '.join(reasons[:2])}{'; ...' if len(reasons) > 2 else ''}).",
            inputs.source(f"strategy = {strategy}, status != ok", len(group))))
    return findings


SECTION = Section(
    study="update",
    title="update: is the optimizer step still the big batch's, and what must change?",
    intro=("The parameters after the optimizer step, against one process training on the "
           "big batch (every sample of the step, mean loss), in the run's dtype: loss recipes "
           "(N devices, k micro-steps) crossed with optimizers and the learning-rate factor "
           "that makes them equal (`lr-factor`); where `clip_grad_norm_` runs (`clipping`); "
           "GradScaler with accumulation and a non-finite micro-batch (`grad-scaler`, "
           "`non-finite`); bf16 accumulation (`bf16-accumulation`); the linear scaling "
           "rule over a sweep of learning rates, and early training with and without "
           "warm-up (`linear-scaling`); momentum at an lr change (`momentum-correction`)."),
    columns=COLUMNS,
    render=render,
)
