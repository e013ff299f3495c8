"""grad-compare's tolerances: the looser dtype's for mixed runs, and the tolerances columns
declare: a count that may move by a unit, a low-precision rounding error that another CPU
rounds otherwise."""

import pytest
import torch

from harness.grad_compare import main
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


def bf16_rows(grad_error: float) -> list[dict]:
    """A row of the update study's bf16-accumulation CSV: its float32 setting at k = 16."""
    return [{**row("1"), "study": "update",
             "case_id": "update/experiment=bf16-accumulation/strategy=local/world_size=1",
             "setting": "float32", "grad_error": grad_error}]


@pytest.mark.parametrize("committed, other, code", [
    # An AMD EPYC against the committed run: float32's rounding, summed in another order.
    (8.39e-8, 7.43e-8, 0),
    (7.43e-8, 8.39e-8, 0),
    # A float32 error against bfloat16's, and bfloat16's at k = 1 against k = 4: what the
    # finding tells apart.
    (8.39e-8, 2.5e-3, 1),
    (2.498e-3, 3.094e-3, 1),
])
def test_a_rounding_error_agrees_within_the_tolerance_its_column_declares(
        tmp_path, capsys, committed, other, code):
    assert column_tolerance("update", "grad_error") == 1e-6
    a = write_folder(tmp_path / "a", {"update": bf16_rows(committed)})
    b = write_folder(tmp_path / "b", {"update": bf16_rows(other)})
    assert main([str(a), str(b)]) == code
    assert "update.grad_error within ±1e-06" in capsys.readouterr().out


def test_the_rounding_tolerance_is_the_columns_own(tmp_path):
    """The AMD difference in a column that declares nothing is still a difference: only the
    columns that measure a low-precision rounding error are forgiven it."""
    rows = [{**r, "grad_residual": 8.39e-8} for r in bf16_rows(8.39e-8)]
    moved = [{**r, "grad_residual": 7.43e-8} for r in rows]
    a = write_folder(tmp_path / "a", {"update": rows})
    b = write_folder(tmp_path / "b", {"update": moved})
    assert column_tolerance("update", "grad_residual") == 0.0
    assert main([str(a), str(b)]) == 1


def test_no_declared_tolerance_loosens_another_column(tmp_path):
    assert column_tolerance("toy", "weight") == 0.0
    assert compare(tmp_path, BASE, [BASE[0], {**BASE[1], "weight": 1.001}]) == 1
