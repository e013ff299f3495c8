"""Experiment ``bf16-accumulation``: the error of bf16 against fp32 gradients as k grows.

One window of 64 samples split into k micro-batches (``loss / k`` each), gradients
accumulated in ``.grad``: float32 throughout; float32 weights with a bfloat16 autocast
forward (the gradient accumulates in float32); the model in bfloat16 (the gradient
accumulates in bfloat16). Each is compared with the float64 gradient of the same window
and the same weights (rounded to bfloat16 first, so that every variant starts from
identical numbers).

Here: its precisions, columns and grid, its measurement (torch imported inside, so that
the spec reads without it) and its report parts (finding, figure).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from harness.report import spec
from harness.report.section import Finding, SectionInputs
from harness.report.text import small
from harness.studies.schema import Column
from harness.studies.update import columns
from harness.studies.update.experiment import Experiment, Grid, report_part

if TYPE_CHECKING:
    import pandas as pd
    import torch
    from torch import nn

    from harness.studies.update.trial import Trial
    from harness.tasks import Batch

#: The precisions the window's gradient accumulates in.
SETTINGS = ("float32", "autocast-bfloat16", "bfloat16")
#: One process: the window is accumulated in ``.grad`` on the CPU.
STRATEGY = "local"
#: Samples of the window, and the k it is split into.
WINDOW = 64
STEPS = {"default": (1, 4, 16, 64), "full": (1, 2, 4, 8, 16, 32, 64)}
COLUMNS = (
    columns.strategy(STRATEGY), columns.WORLD_SIZE.described("1: one process", unit="devices"),
    columns.ACCUM_STEPS.described("k: micro-steps the window is split into"),
    columns.MICRO_BATCH.described(f"b, samples per micro-step: the window's {WINDOW} / k"),
    columns.LOSS.described("`loss / k` of each micro-step's mean loss", unit="`mean/k`"),
    columns.SYNC.described("never reduced: one process", unit="`none`"),
    columns.SETTING.described(
        "the precision: float32 throughout; float32 weights with a bfloat16 autocast forward; "
        "the model in bfloat16", unit=", ".join(f"`{s}`" for s in SETTINGS)),
    columns.DTYPE_USED.described("dtype of the accumulated gradient",
                                 unit="`float32`, `bfloat16`"),
    Column("grad_error", "ratio", "`‖g - g_64‖ / ‖g_64‖`, the window's accumulated gradient "
           "against the float64 gradient of the same window and weights"),
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """One case: its rows sweep k."""
    return [{"strategy": STRATEGY, "world_size": 1}] if STRATEGY in offered.strategies else []


def measure(trial: Trial) -> list[dict[str, Any]]:
    """A row per k and precision: the window's accumulated gradient against float64's."""
    import torch

    from harness.seeding import generator_for
    from harness.studies.update.recipes import TASK, initial_model
    from harness.studies.update.training import big_batch_gradient
    from harness.tolerances import dtype_name

    seed = trial.run.seed
    generator = generator_for(seed, "update-bf16")
    window = TASK.make_shard(WINDOW, 0, generator, torch.float64)
    # Weights representable in bfloat16, so every variant starts from the same numbers.
    initial = initial_model(seed, torch.float64).to(torch.bfloat16).to(torch.float64)
    reference = big_batch_gradient(initial, [[window]])
    rows = []
    for k in STEPS["full" if trial.full else "default"]:
        for setting in SETTINGS:
            grad = _accumulated_gradient(initial, window, k, setting)
            rows.append({
                "accum_steps": k, "micro_batch": WINDOW // k, "loss": "mean/k",
                "sync": "none", "setting": setting, "dtype_used": dtype_name(grad.dtype),
                # On the CPU whatever the run's device: autocast runs here on the CPU.
                "device": "cpu",
                "grad_error": float((grad.to(torch.float64) - reference).norm()
                                    / reference.norm()),
            })
    return rows


def _accumulated_gradient(initial: nn.Module, window: Batch, k: int, setting: str
                          ) -> torch.Tensor:
    """``.grad`` after k micro-steps of ``loss / k`` over the window's k equal pieces."""
    import torch

    from harness.strategies.common import flat_grad
    from harness.studies.update.recipes import TASK

    dtype = torch.bfloat16 if setting == "bfloat16" else torch.float32
    model = copy.deepcopy(initial).to(dtype)
    for piece in window.chunk(k):
        x, y = piece.x.to(dtype), piece.y.to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast-bfloat16"):
            output = model(x)
        loss = TASK.loss(output, type(piece)(x, y), "mean") / k
        loss.backward()
    return flat_grad(model)


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
    intro=(f"One window of {WINDOW} samples split into k micro-batches (`loss / k` each), the "
           "gradient accumulated in `.grad` in float32, in float32 under a bfloat16 autocast "
           "forward, and in bfloat16, against the float64 gradient of the same window and "
           "weights."),
    columns=COLUMNS,
    grid=grid,
    measure=measure,
    cost_ms=60.0,
    findings=(bf16_findings,),
    figures=(bf16_figure,),
)
