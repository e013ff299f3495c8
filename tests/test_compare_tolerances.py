"""grad-compare's tolerances: the looser dtype's for mixed runs, and declared count tolerances."""

import pytest
import torch

from harness.compare import main
from harness.tolerances import column_tolerance, relative_tolerance
from tests.test_compare import BASE, compare, row, write_folder

RTOL32 = relative_tolerance(torch.float32)


@pytest.mark.parametrize("dtypes", [("float64", "float32"), ("float32", "float64")])
def test_a_float64_run_against_a_float32_run_is_judged_at_the_looser_tolerance(
        tmp_path, capsys, dtypes):
    # A float32 run differs from a float64 one by float32 rounding, far above float64's 1e-9.
    rounded = [BASE[0], {**BASE[1], "weight": 1.0 + RTOL32 / 10}]
    a = write_folder(tmp_path / "a", {"toy": BASE}, dtypes[0])
    b = write_folder(tmp_path / "b", {"toy": rounded}, dtypes[1])
    assert main([str(a), str(b)]) == 0
    assert f"numbers within rtol {RTOL32:g}" in capsys.readouterr().out


def test_mixed_dtypes_still_catch_a_difference_above_the_looser_tolerance(tmp_path):
    changed = [BASE[0], {**BASE[1], "weight": 1.0 + RTOL32 * 10}]
    a = write_folder(tmp_path / "a", {"toy": BASE}, "float64")
    b = write_folder(tmp_path / "b", {"toy": changed}, "float32")
    assert main([str(a), str(b)]) == 1


def training_rows(accuracy: float) -> list[dict]:
    return [{**row("1"), "study": "training", "case_id": "training/case=1",
             "heldout_accuracy": accuracy}]


@pytest.mark.parametrize("digits, code", [(1, 0), (2, 1)])
def test_a_declared_count_tolerance_is_applied_and_printed(tmp_path, capsys, digits, code):
    step = column_tolerance("training", "heldout_accuracy")
    assert step == pytest.approx(1 / 297)
    a = write_folder(tmp_path / "a", {"training": training_rows(0.9)})
    b = write_folder(tmp_path / "b", {"training": training_rows(0.9 + digits * step)})
    assert main([str(a), str(b)]) == code
    assert "training.heldout_accuracy within ±0.00337" in capsys.readouterr().out


def test_no_declared_tolerance_loosens_another_column(tmp_path):
    assert column_tolerance("toy", "weight") == 0.0
    assert compare(tmp_path, BASE, [BASE[0], {**BASE[1], "weight": 1.001}]) == 1
