"""The ``update`` study's section: what to change when N devices or k micro-steps make the batch.

Every number and word comes from the rows of ``update.csv``: the verdicts
(``verdict``, ``lr_factor_verdict``) were written by the study. The section is
declared like every other one; each part reads the rows of one experiment
(``lr_factor.py``: the what-to-change table; ``clipping.py``; ``scaler.py``:
GradScaler; ``scaling.py``: bf16, the linear scaling rule, momentum and the
figure). It knows the experiments' names and columns, never their outcomes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from harness.report.rows import ordered
from harness.report.section import Finding, Part, Rows, Section, SectionInputs
from harness.report.text import count, strategy_name
from harness.studies.update.report import clipping, lr_factor, scaler, scaling
from harness.studies.update.report.scaling import WARM_UP_SCHEDULES

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["SECTION", "WARM_UP_SCHEDULES"]

LR_FACTOR = "experiment == 'lr-factor'"
CLIPPING = "experiment == 'clipping'"
GRAD_SCALER = "experiment == 'grad-scaler'"
NON_FINITE = "experiment == 'non-finite'"
BF16 = "experiment == 'bf16-accumulation'"
ONE_STEP = f"experiment == 'linear-scaling' and setting not in {list(WARM_UP_SCHEDULES)}"
EARLY = f"experiment == 'linear-scaling' and setting in {list(WARM_UP_SCHEDULES)}"
MOMENTUM = "experiment == 'momentum-correction'"

Build = Callable[["pd.DataFrame", SectionInputs], Any]


def _of(where: str, *builds: Build) -> Part:
    """A part made of ``builds``, each reading the measured rows ``where`` selects (one
    experiment); nothing when that experiment measured no row."""
    def part(rows: Rows) -> list:
        selected = rows.select(where)
        if selected.empty:
            return []
        made: list = []
        for build in builds:
            item = build(selected, rows.inputs)
            made += item if isinstance(item, list) else [] if item is None else [item]
        return made
    return part


def _present(rows: Rows, where: str) -> pd.DataFrame | None:
    selected = rows.select(where)
    return None if selected.empty else selected


def _non_finite_answers(rows: Rows) -> list:
    """The answer on a non-finite micro-batch, with the GradScaler recipes that matched."""
    non_finite = _present(rows, NON_FINITE)
    if non_finite is None:
        return []
    return scaler.non_finite_answers(non_finite, _present(rows, GRAD_SCALER), rows.inputs)


def _scaler_table(rows: Rows) -> str | None:
    recipes, non_finite = _present(rows, GRAD_SCALER), _present(rows, NON_FINITE)
    if recipes is None and non_finite is None:
        return None
    return scaler.scaler_table(recipes, non_finite, rows.inputs)


def _figure(rows: Rows) -> str | None:
    return scaling.figure(_present(rows, ONE_STEP), _present(rows, BF16), rows.inputs)


def _skipped(rows: Rows) -> list[Finding]:
    """Per strategy, how many cases were not measured, and why."""
    skipped = rows.all[rows.all["status"] != "ok"]
    findings = []
    for strategy, group in skipped.groupby("strategy", sort=False):
        reasons = ordered(group, "status")
        findings.append(Finding(
            f"{strategy_name(strategy)} was not measured in {count(len(group), 'case')} "
            f"({'; '.join(reasons[:2])}{'; ...' if len(reasons) > 2 else ''}).",
            rows.inputs.source(f"strategy = {strategy}, status != ok", len(group))))
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
    # A part gives findings and the answers they rest on: both land in the order declared.
    findings=(
        _of(LR_FACTOR, lr_factor.lr_answers, lr_factor.lr_findings),
        _of(CLIPPING, clipping.clipping_answers, clipping.clipping_findings),
        _of(GRAD_SCALER, scaler.scaler_findings),
        _of(NON_FINITE, scaler.non_finite_findings),
        _non_finite_answers,
        _of(BF16, scaling.bf16_findings),
        _of(ONE_STEP, scaling.scaling_findings, scaling.scaling_answers),
        _of(EARLY, scaling.warm_up_findings),
        _of(MOMENTUM, scaling.momentum_findings, scaling.momentum_answers),
        _skipped,
    ),
    # The figure sits between the table of recipes and the clipping and GradScaler tables.
    tables=(_of(LR_FACTOR, lr_factor.what_to_change), _figure,
            _of(CLIPPING, clipping.clipping_table), _scaler_table),
)
