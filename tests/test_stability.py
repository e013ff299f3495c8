"""Findings that hold on any CPU: the diagnostics study under rounding it cannot control.

Another CPU rounds differently (other kernels, another summation order). Two
stand-ins for it: every input pixel moved by one ulp, and a second BLAS thread.
Under both, every verdict, every count-like column (fractions of dead entries or
units, ``zero_since``, steps) and every number must agree with the unperturbed
run by grad-compare's own rules: the tolerance of the dtype, and any count
tolerance harness/tolerances.py declares for a column.
"""

import pandas as pd
import pytest
import torch

import harness.studies.training.data as data
from harness.grad_compare import cells_agree
from harness.studies.diagnostics.model import DiagnosticsSetup
from harness.studies.diagnostics.study import DiagnosticsStudy
from harness.tolerances import column_tolerance, relative_tolerance
from tests.runs import make_run

#: The lr-sweep reduced (the rest at full size: the BatchNorm CNN's batch is one step).
SETUP = DiagnosticsSetup(epochs=1, train_samples=300, learning_rates=(0.1, 10.0),
                         reported_steps=(1, 2, 5, 10))
#: Columns whose exact-zero definition a one-ulp change used to flip.
COUNT_LIKE = ("zero_grad_fraction", "dead_relu_fraction", "zero_since", "steps_completed")
VERDICTS = ("parameter_moved", "relu_dead", "grads_averaged", "running_stats_changed")
#: Each test runs the (reduced) study once more: seconds, not for the quick run.
pytestmark = pytest.mark.launches(seconds=1)


def one_ulp_up(images: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(images, torch.full_like(images, float("inf")))


def run_study(monkeypatch, perturb=None, threads: int | None = None) -> pd.DataFrame:
    images, labels = data.digits_arrays()
    if perturb is not None:
        monkeypatch.setattr(data, "digits_arrays", lambda: (perturb(images), labels))
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        study, run = DiagnosticsStudy(setup=SETUP), make_run("diagnostics")
        return pd.DataFrame([row for case in study.cases(run)
                             for row in study.run_case(case, run)]).astype(str)
    finally:
        torch.set_num_threads(before)
        monkeypatch.undo()


@pytest.fixture(scope="module")
def unperturbed():
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_study(monkeypatch)


def disagreements(a: pd.DataFrame, b: pd.DataFrame) -> list[tuple]:
    rtol = relative_tolerance(torch.float64)
    return [(column, index, a.at[index, column], b.at[index, column])
            for column in a.columns for index in a.index
            if not cells_agree(a.at[index, column], b.at[index, column],
                               rtol, column_tolerance("diagnostics", column))]


def test_one_ulp_on_every_input_changes_no_finding(unperturbed, monkeypatch):
    perturbed = run_study(monkeypatch, perturb=one_ulp_up)
    assert list(perturbed.columns) == list(unperturbed.columns)
    assert set(COUNT_LIKE + VERDICTS) <= set(perturbed.columns)
    assert disagreements(unperturbed, perturbed) == []


def test_another_thread_count_changes_no_finding(unperturbed, monkeypatch):
    assert disagreements(unperturbed, run_study(monkeypatch, threads=2)) == []


def test_the_train_mode_gradient_has_mathematically_zero_entries_judged_dead(unperturbed):
    # The conv bias feeding BatchNorm: its gradient is 0 in train mode, computed as 0 or as
    # rounding residue depending on the CPU; both count as dead, so the fraction is > 0.
    train = unperturbed[(unperturbed.experiment == "train-vs-eval")
                        & (unperturbed.setting == "train()")].iloc[0]
    assert float(train.zero_grad_fraction) > 0
