"""Experiment ``momentum-correction``: momentum SGD when the learning rate changes.

The measuring code is ``harness/studies/update/momentum.py``; here: the plug-in, its
variants, columns and grid, and its report parts (finding, answer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import small
from harness.studies.update import schema
from harness.studies.update.experiment import Experiment, Grid, measured_in, report_part
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd

#: Goyal's lr-inside momentum, with their correction at the lr change and without it.
CORRECTED, UNCORRECTED = "lr-inside-corrected", "lr-inside-uncorrected"
SETTINGS = (CORRECTED, UNCORRECTED)
STRATEGY = "local"
COLUMNS = (
    *schema.one_process("N: the lr multiplier's devices (the widest of the run)"),
    *schema.recipe(losses=("mean",), syncs=("none",), optimizers=("sgd-momentum",)),
    schema.SETTING.described("the lr-inside momentum form, corrected at the lr change or not",
                             unit=", ".join(f"`{s}`" for s in SETTINGS)),
    schema.DTYPE_USED, schema.LR_MULTIPLIER,
    schema.PARAM_DISTANCE.described("`‖θ - θ_ref‖ / ‖θ_ref‖` after the last step, θ_ref "
                                    "torch.optim.SGD's"),
    schema.UPDATE_ERROR, schema.VERDICT,
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """One case, at the widest N (none without two devices)."""
    if STRATEGY not in offered.strategies or max(offered.sizes) < 2:
        return []
    return [{"strategy": STRATEGY, "world_size": max(offered.sizes), "accum_steps": 1}]


@report_part()
def momentum_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = [f"{row['setting']} {row['verdict']} (update_error {small(row['update_error'])})"
               for _, row in rows.iterrows()]
    first = rows.iloc[0]
    return [Finding(
        f"Momentum SGD written with lr inside the velocity (v ← m v + lr g), lr × "
        f"{int(first['lr_multiplier'])} after {int(first['steps']) // 2} of "
        f"{int(first['steps'])} steps, against torch.optim.SGD (v ← m v + g, θ ← θ − lr v): "
        f"{'; '.join(clauses)}.",
        inputs.source("status = ok", len(rows)))]


@report_part()
def momentum_answers(rows: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    verdicts = dict(zip(rows["setting"], rows["verdict"], strict=True))
    needed = (verdicts.get(CORRECTED) == Equivalence.MATCHES
              and verdicts.get(UNCORRECTED) == Equivalence.DIFFERS)
    return [Answer(
        "Momentum after an lr change (Goyal's momentum correction): needed with torch.optim.SGD?",
        "no: torch's form equals the corrected one" if needed else
        "see the rows: " + ", ".join(f"{setting} {verdict}"
                                     for setting, verdict in verdicts.items()),
        "; ".join(f"{setting}: update_error {small(error)}"
                  for setting, error in zip(rows["setting"], rows["update_error"], strict=True)),
        "only a hand-written lr-inside momentum needs v × lr_new / lr_old" if needed else "")]


EXPERIMENT = Experiment(
    name="momentum-correction",
    question="does momentum need Goyal's correction at an lr change?",
    intro=("Momentum SGD written with lr inside the velocity (Goyal's form), T steps at lr then "
           "T at lr × N, with and without their momentum correction at the change, against "
           "torch.optim.SGD, which keeps lr outside."),
    columns=COLUMNS,
    grid=grid,
    measure=measured_in("harness.studies.update.momentum"),
    cost_ms=5.0,
    findings=(momentum_findings, momentum_answers),
)
