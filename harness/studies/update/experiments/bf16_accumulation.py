"""Experiment ``bf16-accumulation``: the error of bf16 against fp32 gradients as k grows.

The measuring code is ``harness/studies/update/bf16.py``; here: the plug-in, its
precisions, columns and grid, and its report parts (finding, figure).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.report import spec
from harness.report.section import Finding, SectionInputs
from harness.report.text import small
from harness.studies.schema import Column
from harness.studies.update import schema
from harness.studies.update.experiment import Experiment, Grid, measured_in, report_part

if TYPE_CHECKING:
    import pandas as pd

#: The precisions the window's gradient accumulates in.
SETTINGS = ("float32", "autocast-bfloat16", "bfloat16")
#: One process: the window is accumulated in ``.grad`` on the CPU.
STRATEGY = "local"
COLUMNS = (
    schema.strategy(STRATEGY), schema.WORLD_SIZE.described("1: one process", unit="devices"),
    schema.ACCUM_STEPS.described("k: micro-steps the window is split into"),
    schema.MICRO_BATCH.described("b, samples per micro-step: the window's 64 / k"),
    schema.LOSS.described("`loss / k` of each micro-step's mean loss", unit="`mean/k`"),
    schema.SYNC.described("never reduced: one process", unit="`none`"),
    schema.SETTING.described(
        "the precision: float32 throughout; float32 weights with a bfloat16 autocast forward; "
        "the model in bfloat16", unit=", ".join(f"`{s}`" for s in SETTINGS)),
    schema.DTYPE_USED.described("dtype of the accumulated gradient",
                                unit="`float32`, `bfloat16`"),
    Column("grad_error", "ratio", "`‖g - g_64‖ / ‖g_64‖`, the window's accumulated gradient "
           "against the float64 gradient of the same window and weights"),
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """One case: its rows sweep k."""
    return [{"strategy": STRATEGY, "world_size": 1}] if STRATEGY in offered.strategies else []


@report_part()
def bf16_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
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
        inputs.source("status = ok", len(rows)))]


def _bf16_title(rows: pd.DataFrame, rtol: float) -> str:
    """What happened to bfloat16's error as k grew, where it has two ks."""
    bf = rows[rows["setting"] == "bfloat16"].sort_values("accum_steps")
    if len(bf) < 2:
        return "The accumulated gradient's error against float64, by precision"
    return (f"The error of bfloat16 gradients went from {small(bf['grad_error'].iloc[0])} to "
            f"{small(bf['grad_error'].iloc[-1])} as k grew to {int(bf['accum_steps'].iloc[-1])}")


bf16_figure = spec.Lines(
    name="update_bf16_accumulation", title=_bf16_title, x="accum_steps", y=("grad_error",),
    series="setting", log_x=True, height=3.6,
    # Every error is positive (rounding): a plain log axis, without Lines' floor for zeros.
    decorate=lambda axis, rows: axis.set_yscale("log"),
    caption="Rows of {csv} with status = ok ({rows} rows): one window's gradient accumulated "
            "in k micro-steps (`accum_steps`), against the float64 gradient (`grad_error`).")


EXPERIMENT = Experiment(
    name="bf16-accumulation",
    question="how far is a gradient accumulated in bfloat16 from float64's?",
    intro=("One window of 64 samples split into k micro-batches (`loss / k` each), the "
           "gradient accumulated in `.grad` in float32, in float32 under a bfloat16 autocast "
           "forward, and in bfloat16, against the float64 gradient of the same window and "
           "weights."),
    columns=COLUMNS,
    grid=grid,
    measure=measured_in("harness.studies.update.bf16"),
    cost_ms=60.0,
    findings=(bf16_findings,),
    figures=(bf16_figure,),
)
