"""The update section's clipping parts: where clip_grad_norm_ ran, findings, answer, table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import capitalized, count, integers, number, small, strategy_name
from harness.report.text import words as listed
from harness.studies.update.report.wording import table_of_rows, verb
from harness.verdicts import Equivalence, close

if TYPE_CHECKING:
    import pandas as pd


def _coefficients(row) -> str:
    low, high = row["clip_coef_min"], row["clip_coef_max"]
    return number(low) if close(low, high, 1e-12) else f"{number(low)} to {number(high)}"


def clipping_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    findings = []
    for (strategy, setting), group in rows.groupby(["strategy", "setting"], sort=False):
        clauses = []
        for _, row in group.iterrows():
            clauses.append(f"at max_norm = {number(row['max_norm_ratio'])} × ‖g_big‖ it applied "
                           f"{_coefficients(row)} where the big batch applied "
                           f"{number(row['clip_coef_reference'])}, and the update "
                           f"{verb(row['verdict'])} (update_error "
                           f"{small(row['update_error'])})")
        findings.append(Finding(
            capitalized(f"{strategy_name(strategy)} clipping {setting} (N = "
                      f"{integers(group['world_size'])}, k = {integers(group['accum_steps'])}): "
                      f"{'; '.join(clauses)}."),
            inputs.source(f"experiment = clipping, status = ok, strategy = {strategy}, "
                          f"setting = {setting}", len(group))))
    return findings


def clipping_answers(rows: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    by_setting = {setting: group for setting, group in rows.groupby("setting", sort=False)}
    right = [s for s, g in by_setting.items() if (g["verdict"] == Equivalence.MATCHES).all()]
    wrong = [s for s, g in by_setting.items() if s not in right]
    if not by_setting:
        return []
    worst = rows[rows["setting"].isin(wrong)]["update_error"].max() if wrong else 0.0
    return [Answer(
        "Where must clip_grad_norm_ run to clip the big batch's gradient?",
        f"{listed(right, 'or') or 'nowhere measured'}"
        + (f"; not {listed(wrong, 'or')}" if wrong else ""),
        f"{count(len(rows), 'run')}; update_error up to {small(worst)} where it differs",
        f"clip {listed(right, 'or')}" if right and wrong else "")]


def clipping_table(rows: pd.DataFrame, inputs: SectionInputs) -> str:
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
    return table_of_rows(caption, inputs, "clipping", len(rows), headers, body,
                          "-++-++-+-")
