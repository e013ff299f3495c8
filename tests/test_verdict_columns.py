"""The verdict columns the studies write for the report to read, on both sides of each tolerance.

Each judgment the report used to make from raw numbers (a spread within the tolerance, a
ratio named 1, 1/N or N (1/k or k), two methods compared, a DDP setting's outcome) is now a column
the measuring code writes. Here each is fed a value just inside its tolerance, just
outside, and far outside, and must say so; the last test keeps the report's copy of the
tolerances equal to the studies'.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from harness.config import DTYPES as DTYPE_NAMES
from harness.studies.accumulation.study import multiples
from harness.studies.base import Case, named_multiple
from harness.studies.diagnostics.study import row_verdicts, with_zero_since
from harness.studies.reduction.study import within_tolerance
from harness.studies.seed001.study import SeedSetup, predict, printed_explained
from harness.studies.seed004.study import against_big_batch
from harness.studies.training.schema import REFERENCE, RUNNING_SUM
from harness.studies.training.study import TrainingStudy
from harness.studies.training.trainer import EpochRecord
from harness.tolerances import (
    NEGLIGIBLE_RELATIVE,
    RELATIVE_TOLERANCE,
    relative_tolerance,
    trajectory_tolerance,
)
from harness.verdicts import Equivalence
from tests.reports import committed_report
from tests.test_verdicts import SIDES, nudged


@pytest.fixture(params=[torch.float64, torch.float32], ids=["float64", "float32"])
def rtol(request) -> float:
    return relative_tolerance(request.param)


@pytest.mark.parametrize("factor, holds", SIDES)
@pytest.mark.parametrize("count, letter, name, multiple", [
    (3, "N", "1", 1.0), (3, "N", "1/N", 1 / 3), (4, "N", "N", 4.0), (4, "k", "k", 4.0),
    (2, "k", "1/k", 0.5)])
def test_a_scale_is_named_a_multiple_of_its_count_only_within_the_tolerance(
        rtol, factor, holds, count, letter, name, multiple):
    assert named_multiple(nudged(multiple, factor, rtol), count, rtol, letter) == (
        name if holds else "")


def test_at_one_device_every_multiple_is_named_1(rtol):
    assert named_multiple(1.0, 1, rtol, "N") == "1"
    assert named_multiple(math.nan, 2, rtol, "N") == ""


@pytest.mark.parametrize("factor, holds", SIDES)
def test_reduction_ranks_and_running_stats_agree_within_the_tolerance(rtol, factor, holds):
    # rank_spread and running_stats_vs_first_shard are distances from 0: absolute units.
    assert within_tolerance(factor * rtol, rtol) is holds
    assert within_tolerance(math.nan, rtol) is None


@pytest.mark.parametrize("factor, holds", SIDES)
def test_accumulation_names_the_cumulative_verdict_and_multiples(rtol, factor, holds):
    k = 4
    measured = {"full_batch_scale": nudged(float(k), factor, rtol),
                "verdict": Equivalence.SCALED, "cumulative_scale": 1.0,
                "cumulative_residual": factor * rtol}
    judged = multiples(measured, k, rtol)
    assert judged["full_batch_multiple"] == ("k" if holds else "")
    assert judged["cumulative_verdict"] == (Equivalence.MATCHES if holds else Equivalence.DIFFERS)
    assert judged["cumulative_multiple"] == ("1" if holds else "")
    # A last step that fits no multiple names none, whatever its scale reads.
    assert multiples({**measured, "verdict": Equivalence.DIFFERS}, k, rtol)[
        "full_batch_multiple"] == ""


@pytest.mark.parametrize("factor, holds", SIDES)
def test_seed001_explains_a_printed_number_within_the_tolerance(rtol, factor, holds):
    setup = SeedSetup("1-per-device-factor")
    case = Case.of("seed001", strategy="dp-emulated", experiment=setup.experiment, world_size=2,
                   loss_reduction="mean")
    measured, _ = predict(setup, "dp-emulated", 2, "mean", 1)
    other, _ = predict(setup, "dp-emulated", 2, "sum", 1)
    found = printed_explained(nudged(other, factor, rtol), measured, setup, case, 1, rtol)
    assert found["printed_other_loss"] is holds
    found = printed_explained(nudged(3 * measured, factor, rtol), measured, setup, case, 1, rtol)
    assert found["printed_passes"] == (3 if holds else None)
    assert found["printed_ratio"] == nudged(3 * measured, factor, rtol) / measured
    nothing = printed_explained(None, measured, setup, case, 1, rtol)
    assert math.isnan(nothing.pop("printed_ratio"))
    assert nothing == {"printed_other_loss": None, "printed_passes": None}


@pytest.mark.parametrize("factor, holds", SIDES)
def test_seed004_compares_the_last_call_with_the_big_batch(rtol, factor, holds):
    reference = {"grad": -20.0, "weight": 1.2}
    row = {"event": "step", "quantity": "weight", "measured": nudged(1.2, factor, rtol)}
    judged = against_big_batch(row, reference, rtol)
    assert judged["equals_big_batch"] is holds
    assert judged["big_batch_difference"] == pytest.approx(row["measured"] - 1.2)
    assert against_big_batch({**row, "event": "backward-1"}, reference, rtol) == {
        "big_batch_difference": None, "equals_big_batch": None}


@pytest.mark.parametrize("factor, holds", SIDES)
def test_diagnostics_judges_ranks_updates_relus_and_running_stats(rtol, factor, holds):
    measured = {"grad_rank_spread": factor * rtol, "update_ratio": 0.0,
                "dead_relu_fraction": 1.0, "running_stats_change": 0.0}
    negligible = NEGLIGIBLE_RELATIVE["float64"]
    judged = row_verdicts(measured, rtol, negligible)
    assert judged["grads_averaged"] is holds
    assert judged == {**judged, "parameter_moved": False, "relu_dead": True,
                      "running_stats_changed": False}
    # A relative change of the negligible fraction is rounding; the next float up is a move.
    at = row_verdicts({**measured, "update_ratio": negligible, "running_stats_change": negligible},
                    rtol, negligible)
    assert (at["parameter_moved"], at["running_stats_changed"]) == (False, False)
    above = math.nextafter(negligible, 1.0)
    # A ReLU short of one unit: an exact comparison (harness/diagnostics.py says why).
    nearly = row_verdicts({**measured, "update_ratio": above, "dead_relu_fraction": 1 - 2 ** -52,
                         "running_stats_change": above}, rtol, negligible)
    assert (nearly["parameter_moved"], nearly["relu_dead"], nearly["running_stats_changed"]) == (
        True, False, True)
    unmeasured = row_verdicts(dict.fromkeys(measured, math.nan), rtol)
    assert set(unmeasured.values()) == {None}


def test_diagnostics_names_the_step_from_which_a_gradient_stayed_zero():
    fractions = {"a": (0.5, 1.0, 0.3, 1.0, 1.0), "b": (1.0, 1.0, 1.0, 1.0, 1.0),
                 "c": (1.0, 1.0, 1.0, 1.0, 0.9)}
    rows = [{"parameter": p, "step": step, "zero_grad_fraction": f}
            for step, column in zip((1, 2, 5, 10, 20), zip(*fractions.values(), strict=True),
                                    strict=True)
            for p, f in zip(fractions, column, strict=True)]
    since = {r["parameter"]: r["zero_since"] for r in with_zero_since(rows)}
    assert since == {"a": 10, "b": 1, "c": None}


def training_row(applied: float, fresh: float, rank_spread: float) -> dict:
    """The training study's row of one DDP epoch with these norms and this rank spread."""
    params = torch.linspace(-1.0, 2.0, 50, dtype=torch.float64)
    record = EpochRecord(epoch=1, steps=30, params=params, train_loss=0.5, heldout_accuracy=0.9,
                         applied_grad_norm=applied, fresh_grad_norm=fresh,
                         rank_spread=rank_spread)
    twins = {name: [params, params] for name in (REFERENCE, RUNNING_SUM)}
    digits = SimpleNamespace(train_y=torch.zeros(3), heldout_y=torch.zeros(2))
    return TrainingStudy()._row(Case.of("training", strategy="local", world_size=1),
                                "optim.SGD", record, twins, trajectory_tolerance(torch.float64),
                                relative_tolerance(torch.float64), digits)


@pytest.mark.parametrize("factor, holds", SIDES)
def test_training_ranks_in_step_and_applied_to_fresh(factor, holds):
    row = training_row(3.0, 1.5, factor * trajectory_tolerance(torch.float64))
    assert row["ranks_in_step"] is holds
    assert row["applied_to_fresh"] == 2.0
    unmeasured = training_row(math.nan, math.nan, math.nan)
    assert math.isnan(unmeasured["applied_to_fresh"]) and unmeasured["ranks_in_step"] is None


def test_the_report_draws_with_the_tolerances_the_studies_judged_with():
    from harness.report.data import tolerance

    for name, dtype in DTYPE_NAMES.items():
        assert tolerance(name) == relative_tolerance(dtype) == RELATIVE_TOLERANCE[name]


@pytest.mark.launches(seconds=5)
def test_rendering_the_committed_results_never_imports_torch_and_every_section_renders(
        tmp_path_factory):
    """The report path (the registry, every study's section) loads without torch: importing
    it was most of what a report used to cost. Rendering a copy of the committed results/
    also proves every section reads only columns its study writes (a failed section prints
    ``report: section ... failed`` and is left out)."""
    rendered = committed_report(tmp_path_factory, "results")
    assert rendered.torch_modules == []
    assert "failed" not in rendered.stderr, rendered.stderr
    assert (rendered.folder / "REPORT.md").read_text().count("\n## ") >= 2
