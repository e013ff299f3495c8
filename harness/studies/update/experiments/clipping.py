"""Experiment ``clipping``: where ``clip_grad_norm_`` runs decides what it clips.

The measuring code is ``harness/studies/update/clipping.py``; here: the plug-in, its
settings, columns and grid, and its report parts (findings, answer, table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.report import spec
from harness.report.section import Finding, SectionInputs
from harness.report.text import capitalized, integers, number, small, strategy_name
from harness.strategies import STRATEGIES
from harness.studies.update import schema
from harness.studies.update.experiment import Experiment, Grid, measured_in, report_part
from harness.studies.update.wording import IDENTITY, OUTCOME, SettingsAnswer, verb
from harness.verdicts import close

if TYPE_CHECKING:
    import pandas as pd

#: Where each strategy clips: the first of each pair is the right place.
SETTINGS = {
    "local": ("per-window", "per-micro-step"),
    "ddp": ("after-reduction", "before-reduction"),
    "fsdp": ("total-norm", "local-shard-norm"),
}
COLUMNS = (
    schema.strategy(*SETTINGS), schema.RANKS, schema.ACCUM_STEPS,
    *schema.recipe(losses=("mean", "mean/k"), syncs=("every-micro-step", "none"),
                   optimizers=("sgd",)),
    schema.SETTING.described(
        "where `clip_grad_norm_` runs: once per window after the k micro-steps (one process), "
        "or after each micro-step's backward; after DDP's all-reduce, or on each rank's own "
        "gradient before it (averaged by hand after); FSDP2's total norm over the shards, or "
        "each rank's shard by its own norm",
        unit=", ".join(f"`{s}`" for settings in SETTINGS.values() for s in settings)),
    schema.DTYPE_USED, *schema.CLIP_COLUMNS,
    schema.PARAM_DISTANCE.described(schema.PARAM_DISTANCE.doc + " clipped at the same "
                                    "`max_norm`"),
    schema.UPDATE_ERROR, schema.VERDICT,
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """One process clips k micro-steps; DDP and FSDP, one micro-step per step on N ranks, at
    the widest world size (every one in the full matrix)."""
    return [{"strategy": s, "world_size": 1, "accum_steps": offered.accum_steps}
            if STRATEGIES[s].reference else {"strategy": s, "world_size": n, "accum_steps": 1}
            for s in offered.strategies if s in SETTINGS
            for n in ([1] if STRATEGIES[s].reference else offered.widest)]


def _coefficients(row) -> str:
    low, high = row["clip_coef_min"], row["clip_coef_max"]
    return number(low) if close(low, high, 1e-12) else f"{number(low)} to {number(high)}"


@report_part()
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
            inputs.source(f"status = ok, strategy = {strategy}, setting = {setting}",
                          len(group))))
    return findings


clipping_answers = SettingsAnswer(
    question="Where must clip_grad_norm_ run to clip the big batch's gradient?", fix="clip",
    none="nowhere measured")


clipping_table = spec.Records(
    caption=lambda rows: (
        f"**Clipping**: the factor each `clip_grad_norm_` call applied at the first step (per "
        f"micro-step, or per rank), measured as ‖g after‖ / ‖g before‖, and the update error "
        f"after {integers(rows['steps'])} steps against the big batch clipped at the same "
        f"max_norm. Rows of {{csv}} with status = ok ({{rows}} rows)."),
    columns=(*IDENTITY, ("where it clips", spec.cell("setting")),
             ("max_norm / ‖g_big‖", spec.cell("max_norm_ratio", number)),
             ("big batch's coef", spec.cell("clip_coef_reference", number)),
             ("coefficients applied (first step)",
              spec.cell("clip_coefs", lambda c: str(c).replace(";", "; "))),
             *OUTCOME),
    numeric=(False, True, True, False, True, True, False, True, False))


EXPERIMENT = Experiment(
    name="clipping",
    question="where must `clip_grad_norm_` run?",
    intro=("A recipe that equals the big batch without clipping (`mean/k` accumulation, DDP's "
           "`mean`) clipping in each place a loop may put `clip_grad_norm_`, against the big "
           "batch clipped once per step at the same `max_norm`: below its gradient norm (0.5 ×: "
           "the big batch clips) and above it (2 ×: it does not, yet a partial sum or one "
           "rank's gradient still may)."),
    columns=COLUMNS,
    grid=grid,
    measure=measured_in("harness.studies.update.clipping"),
    cost_ms=10.0,
    findings=(clipping_answers, clipping_findings),
    tables=(clipping_table,),
)
