"""The update section's GradScaler parts: accumulation recipes and a non-finite micro-batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.rows import is_true, ordered
from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import capitalized, count, integers, number, small, span, strategy_name
from harness.report.text import words as listed
from harness.studies.update.report.wording import scale_text, table_of_rows, verb
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd


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
            inputs.source(f"experiment = grad-scaler, status = ok, setting = {setting}",
                          len(group))))
    return findings


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
            inputs.source(f"experiment = non-finite, status = ok, strategy = {strategy}, "
                          f"world_size = {int(n)}", len(group))))
    return findings


def non_finite_answers(rows: pd.DataFrame, scaler: pd.DataFrame | None,
                        inputs: SectionInputs) -> list[Answer]:
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
    fix = ""
    if scaler is not None:
        right = [s for s, g in scaler.groupby("setting", sort=False)
                 if (g["verdict"] == Equivalence.MATCHES).all()]
        fix = f"GradScaler recipes equal to the big batch: {listed(right, 'and')}" if right else ""
    return [Answer("GradScaler with accumulation: what does one non-finite micro-batch on one "
                   "rank do?", answer, evidence, fix)]


def scaler_table(scaler, non_finite, inputs: SectionInputs) -> str:
    body = []
    for rows in (scaler, non_finite):
        if rows is None:
            continue
        for _, r in rows.iterrows():
            window = "" if r["window"] != r["window"] else str(int(r["window"]))
            skipped = "" if r["ranks_skipped"] != r["ranks_skipped"] else \
                f"{int(r['ranks_skipped'])} of {int(r['world_size'])}"
            body.append([r["experiment"], strategy_name(r["strategy"]), str(int(r["world_size"])),
                         r["setting"], window, skipped, scale_text(r["scale_before"]),
                         scale_text(r["scale_after"]), small(r["update_error"]), r["verdict"]])
    headers = ["experiment", "strategy", "N", "setting", "window", "ranks skipped",
               "scale before", "scale after", "update_error", "verdict"]
    shown = sum(len(r) for r in (scaler, non_finite) if r is not None)
    caption = ("**GradScaler** with k-step accumulation (scale every micro-step, step once per "
               "window), against the big batch (clipped at the same max_norm where the recipe "
               "clips; leaving out the window with the non-finite input for non-finite).")
    return table_of_rows(caption, inputs, "grad-scaler or non-finite", shown, headers, body,
                          "--+-+-+++-")
