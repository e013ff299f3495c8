"""Experiment ``momentum-correction``: momentum SGD when the learning rate changes.

Goyal et al. 2017 (section 2.1) write momentum SGD with the learning rate inside
the velocity, ``v <- m v + lr g``, ``θ <- θ - v``. When lr changes (scaled for a new
GPU count, or by a schedule), v still holds steps of the old size, and their
"momentum correction" multiplies v by ``lr_new / lr_old`` at the change.
``torch.optim.SGD`` keeps lr outside, ``v <- m v + g``, ``θ <- θ - lr v``: the same
update as the corrected form, with no correction to apply.

One case at the widest N: T steps at lr, then T at lr x N (the linear scaling
rule's new rate), on fresh N-device batches, with torch.optim.SGD (the
reference) and with the lr-inside form written out, corrected and not. Each row
is one lr-inside variant against the reference.

Here: its variants, columns and grid, its measurement (torch imported inside, so that the
spec reads without it) and its report parts (finding, answer).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import small
from harness.studies.update import columns
from harness.studies.update.experiment import Experiment, Grid, report_part
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd
    import torch
    from torch import nn

    from harness.studies.update.trial import Trial
    from harness.tasks import Batch

#: Goyal's lr-inside momentum, with their correction at the lr change and without it.
CORRECTED, UNCORRECTED = "lr-inside-corrected", "lr-inside-uncorrected"
SETTINGS = (CORRECTED, UNCORRECTED)
STRATEGY = "local"
COLUMNS = (
    *columns.one_process("N: the lr multiplier's devices (the widest of the run)"),
    *columns.recipe(losses=("mean",), syncs=("none",), optimizers=("sgd-momentum",)),
    columns.SETTING.described("the lr-inside momentum form, corrected at the lr change or not",
                              unit=", ".join(f"`{s}`" for s in SETTINGS)),
    columns.DTYPE_USED, columns.LR_MULTIPLIER,
    columns.PARAM_DISTANCE.described("`‖θ - θ_ref‖ / ‖θ_ref‖` after the last step, θ_ref "
                                     "torch.optim.SGD's"),
    columns.UPDATE_ERROR, columns.VERDICT,
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """One case, at the widest N (none without two devices)."""
    if STRATEGY not in offered.strategies or max(offered.sizes) < 2:
        return []
    return [{"strategy": STRATEGY, "world_size": max(offered.sizes), "accum_steps": 1}]


def measure(trial: Trial) -> list[dict[str, Any]]:
    """A row per lr-inside variant, against torch.optim.SGD over the same lr change."""
    from harness.studies.update.optimizers import MOMENTUM, SGD_LR
    from harness.studies.update.recipes import MICRO_BATCH, initial_model
    from harness.studies.update.training import flat_parameters, judged
    from harness.tolerances import dtype_name, update_tolerance

    world_size, steps = trial.world_size, trial.options.steps
    dtype, seed = trial.run.dtype, trial.run.seed
    start = initial_model(seed, dtype)
    lrs = [SGD_LR] * steps + [SGD_LR * world_size] * steps
    data = batches(seed, world_size, len(lrs), dtype)
    reference = flat_parameters(torch_sgd(start, data, lrs))
    origin = flat_parameters(start)
    rows = []
    for setting in SETTINGS:
        params = flat_parameters(lr_inside_sgd(start, data, lrs, corrected=setting == CORRECTED))
        rows.append({
            "micro_batch": MICRO_BATCH, "loss": "mean", "sync": "none",
            "optimizer": "sgd-momentum",
            "optimizer_settings": (f"v <- {MOMENTUM:g} v + lr g, θ <- θ - v; lr = {SGD_LR:g} "
                                   f"for {steps} steps, then {SGD_LR * world_size:g}"),
            "learning_rate": SGD_LR, "steps": len(lrs), "setting": setting,
            "dtype_used": dtype_name(dtype), "lr_multiplier": world_size, "device": "cpu",
            **judged(params, reference, origin, update_tolerance(dtype)),
        })
    return rows


def batches(seed: int, world_size: int, count: int, dtype: torch.dtype) -> list[Batch]:
    """``count`` big batches, each of N devices' b samples."""
    from harness.seeding import generator_for
    from harness.studies.update.recipes import MICRO_BATCH, TASK
    from harness.tasks import Batch

    generator = generator_for(seed, "update-momentum-correction", world_size)
    return [Batch.cat([TASK.make_shard(MICRO_BATCH, j, generator, dtype)
                       for j in range(world_size)]) for _ in range(count)]


def torch_sgd(start: nn.Module, data: list[Batch], lrs: list[float]) -> nn.Module:
    """torch.optim.SGD with momentum, its lr set before each step."""
    import torch

    from harness.studies.update.optimizers import MOMENTUM
    from harness.studies.update.training import descend

    model = copy.deepcopy(start)
    optimizer = torch.optim.SGD(model.parameters(), lr=lrs[0], momentum=MOMENTUM)
    for batch, lr in zip(data, lrs, strict=True):
        optimizer.param_groups[0]["lr"] = lr
        descend(model, optimizer, batch)
    return model


def lr_inside_sgd(start: nn.Module, data: list[Batch], lrs: list[float],
                  corrected: bool) -> nn.Module:
    """``v <- m v + lr g``, ``θ <- θ - v``; ``corrected``: v scaled by lr_new / lr_old first."""
    import torch

    from harness.studies.update.optimizers import MOMENTUM

    model = copy.deepcopy(start)
    velocity = [torch.zeros_like(p) for p in model.parameters()]
    previous = lrs[0]
    for batch, lr in zip(data, lrs, strict=True):
        gradients = _gradients(model, batch)
        correction = lr / previous if corrected else 1.0
        with torch.no_grad():
            for p, v, g in zip(model.parameters(), velocity, gradients, strict=True):
                v.mul_(MOMENTUM * correction).add_(g, alpha=lr)
                p.sub_(v)
        previous = lr
    return model


def _gradients(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, ...]:
    import torch

    from harness.studies.update.recipes import TASK

    loss = TASK.loss(model(batch.x), batch, "mean")
    return torch.autograd.grad(loss, list(model.parameters()))


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
    measure=measure,
    cost_ms=5.0,
    findings=(momentum_findings, momentum_answers),
)
