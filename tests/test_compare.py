"""scripts/compare.py on results folders written by hand, one rule per test, and on a real rerun.

Each hand-made folder is the smallest a study run could write: run.json naming
its studies and dtype, and CSVs with ``study``, ``case_id``, the context columns
and a few columns of each kind (verdict text, a number, a timing).
"""

import csv
import json
from pathlib import Path

import pytest
import torch

from harness.context import CONTEXT_COLUMNS
from harness.grad_compare import MAX_SHOWN, cells_agree, column_kind, is_timing, main
from harness.tolerances import relative_tolerance
from tests.distributed import committed_layout_run

ROOT = Path(__file__).resolve().parent.parent
RTOL64 = relative_tolerance(torch.float64)
RTOL32 = relative_tolerance(torch.float32)
CONTEXT = {"backend": "gloo", "device": "cpu", "dtype": "float64", "hosts": 1, "nodes": 1,
           "ranks_per_node": 4, "launch_world_size": 4, "slurm_job_id": "",
           "torch_version": "2.13.0+cpu"}


def row(case: str, **cells) -> dict:
    """A row of study ``toy``: a verdict, a number, a timing, then the context and status."""
    return {"study": "toy", "case_id": f"toy/case={case}", "verdict": "mean", "weight": 0.5,
            "time_s": 0.01, **CONTEXT, "status": "ok", **cells}


def write_folder(path: Path, studies: dict[str, list[dict]], dtype: str = "float64",
                 settings: dict | None = None) -> Path:
    path.mkdir(parents=True)
    manifest = {"command": "torchrun scripts/study.py", "settings": settings or {"seed": 0},
                "world_sizes": [1, 2], "started": "2026-01-01T00:00:00+00:00",
                "wall_time_s": 1.0, **CONTEXT, "dtype": dtype,
                "studies": {name: {"csv": f"{name}.csv", "cases": len(rows), "wall_time_s": 1.0}
                            for name, rows in studies.items()}}
    (path / "run.json").write_text(json.dumps(manifest))
    write_csvs(path, studies)
    return path


def compare(tmp_path: Path, a_rows: list[dict], b_rows: list[dict], *extra: str,
            dtype: str = "float64") -> int:
    a = write_folder(tmp_path / "a", {"toy": a_rows}, dtype)
    b = write_folder(tmp_path / "b", {"toy": b_rows}, dtype)
    return main([str(a), str(b), *extra])


BASE = [row("1"), row("2", verdict="sum", weight=1.0)]


# ------------------------------------------------------------------ the rules
def test_identical_folders_agree(tmp_path, capsys):
    assert compare(tmp_path, BASE, BASE) == 0
    assert "agree" in capsys.readouterr().out


def test_a_verdict_change_disagrees_and_is_listed(tmp_path, capsys):
    changed = [BASE[0], {**BASE[1], "verdict": "mean"}]
    assert compare(tmp_path, BASE, changed) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "toy/case=2" in line)
    assert line.split() == ["toy", "toy/case=2", "verdict", "sum", "mean"]


def test_a_status_change_disagrees(tmp_path):
    skipped = [BASE[0], {**BASE[1], "status": "skipped: needs 2 CUDA devices, has 0"}]
    assert compare(tmp_path, BASE, skipped) == 1


@pytest.mark.parametrize("factor, code", [(0.5, 0), (2.0, 1), (1e3, 1)])
def test_numbers_agree_exactly_within_the_dtype_tolerance(tmp_path, factor, code):
    """weight 1.0 moved by factor * rtol: half the tolerance agrees, twice it does not."""
    moved = [BASE[0], {**BASE[1], "weight": repr(1.0 + factor * RTOL64)}]
    assert compare(tmp_path, BASE, moved) == code


@pytest.mark.parametrize("factor, code", [(0.5, 0), (2.0, 1)])
def test_the_tolerance_is_the_one_of_the_runs_dtype(tmp_path, factor, code):
    """float32 runs are judged with float32's tolerance, read from run.json."""
    moved = [BASE[0], {**BASE[1], "weight": repr(1.0 + factor * RTOL32)}]
    assert compare(tmp_path, BASE, moved, dtype="float32") == code


def test_timing_columns_may_differ(tmp_path, capsys):
    slower = [{**r, "time_s": 7.0} for r in BASE]
    assert compare(tmp_path, BASE, slower) == 0
    assert "timing columns ignored: time_s" in capsys.readouterr().out


def test_context_columns_are_shown_but_do_not_disagree(tmp_path, capsys):
    elsewhere = [{**r, "hosts": 2, "torch_version": "2.14.0"} for r in BASE]
    assert compare(tmp_path, BASE, elsewhere) == 0
    out = capsys.readouterr().out
    shown = [line.split() for line in out.splitlines()]
    assert ["torch_version", "2.13.0+cpu", "2.14.0", "2"] in shown, "column, A, B, rows"


def test_nan_or_empty_on_both_sides_agrees_but_not_against_a_number(tmp_path):
    assert compare(tmp_path / "both", [row("1", weight="nan")], [row("1", weight="")]) == 0
    assert compare(tmp_path / "one", [row("1", weight="nan")], [row("1", weight=0.0)]) == 1


def test_rows_of_one_case_are_matched_by_position(tmp_path, capsys):
    epochs = [row("1", epoch=0, weight=0.5), row("1", epoch=1, weight=0.25)]
    assert compare(tmp_path / "same", epochs, epochs) == 0
    assert compare(tmp_path / "swapped", epochs, epochs[::-1]) == 1
    assert "toy/case=1 [row 2]" in capsys.readouterr().out


def test_a_row_only_one_side_has_disagrees(tmp_path, capsys):
    assert compare(tmp_path, BASE, BASE[:1]) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "toy/case=2" in line)
    assert line.split() == ["toy", "toy/case=2", "(row)", "present", "absent"]
    assert "0 cell(s) and 1 unmatched row(s)" in out


def write_csvs(path: Path, tables: dict[str, list[dict]]) -> None:
    """``<name>.csv`` in ``path`` for each table, its columns those of its first row."""
    for name, rows in tables.items():
        with open(path / f"{name}.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def write_split(path: Path, tables: dict[str, list[dict]]) -> Path:
    """A folder whose study ``toy`` wrote several CSVs, each with its own columns."""
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({**CONTEXT, "studies": {"toy": {
        "csvs": [f"{name}.csv" for name in tables], "cases": 2}}}))
    write_csvs(path, tables)
    return path


def test_a_study_split_into_several_csvs_is_matched_by_case_across_them(tmp_path, capsys):
    """One CSV with every column against a CSV per kind of case, each with its own columns:
    rows meet by case_id wherever they are, and only the cells both rows have are judged."""
    together = [row("1", clip=""), row("2", verdict="sum", weight=1.0, clip="0.5")]
    one = write_folder(tmp_path / "one", {"toy": together})
    split = {"toy-a": [{k: v for k, v in together[0].items() if k != "clip"}],
             "toy-b": [{k: v for k, v in together[1].items() if k != "weight"}]}
    assert main([str(one), str(write_split(tmp_path / "split", split))]) == 0
    assert "agree" in capsys.readouterr().out
    split["toy-b"][0]["clip"] = "0.25"
    assert main([str(one), str(write_split(tmp_path / "changed", split))]) == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if "toy/case=2" in line)
    assert line.split() == ["toy", "toy/case=2", "clip", "0.5", "0.25"]


def test_run_settings_are_shown_side_by_side_not_judged(tmp_path, capsys):
    a = write_folder(tmp_path / "a", {"toy": BASE}, settings={"seed": 0, "matrix": "default"})
    b = write_folder(tmp_path / "b", {"toy": BASE}, settings={"seed": 0, "matrix": "full"})
    assert main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert ["matrix", "default", "full"] in [line.split() for line in out.splitlines()]


def test_studies_restricts_the_comparison(tmp_path):
    other = [{**r, "study": "other", "case_id": r["case_id"].replace("toy", "other")}
             for r in BASE]
    a = write_folder(tmp_path / "a", {"toy": BASE, "other": other})
    b = write_folder(tmp_path / "b", {"toy": BASE, "other": [other[0], {**other[1],
                                                                         "verdict": "x"}]})
    assert main([str(a), str(b)]) == 1
    assert main([str(a), str(b), "--studies", "toy"]) == 0


def test_at_most_twenty_differences_are_listed_then_counted(tmp_path, capsys):
    many = [row(str(i)) for i in range(MAX_SHOWN + 5)]
    assert compare(tmp_path, many, [{**r, "verdict": "sum"} for r in many]) == 1
    out = capsys.readouterr().out.splitlines()
    assert sum("verdict" in line and "toy/case=" in line for line in out) == MAX_SHOWN
    assert "... and 5 more (--all lists every one)" in out
    assert len(out) <= MAX_SHOWN + 12


def test_all_lists_every_difference(tmp_path, capsys):
    many = [row(str(i)) for i in range(MAX_SHOWN + 5)]
    assert compare(tmp_path, many, [{**r, "verdict": "sum"} for r in many], "--all") == 1
    out = capsys.readouterr().out.splitlines()
    assert sum("verdict" in line and "toy/case=" in line for line in out) == MAX_SHOWN + 5
    assert not any("more" in line for line in out)


def test_common_rows_compares_only_the_rows_both_sides_hold(tmp_path, capsys):
    """A quick form (fewer rows) against the full run: the rows both hold are judged, the
    others counted; a row both hold that differs still disagrees."""
    assert compare(tmp_path / "same", BASE, BASE[:1], "--common-rows") == 0
    out = capsys.readouterr().out
    assert "rows only one side has (--common-rows: not compared): 1 only in A" in out
    assert out.rstrip().endswith("every number is within tolerance")
    changed = [{**BASE[0], "verdict": "sum"}]
    assert compare(tmp_path / "differs", BASE, changed, "--common-rows") == 1
    assert "0 unmatched row(s)" in capsys.readouterr().out


def test_the_column_rules():
    for name in ("time_s", "forward_s", "wall_time", "wall_time_s", "algbw_GBps", "busbw_GBps",
                 "step_ms"):
        assert is_timing(name) and column_kind(name) == "timing", name
    for name in ("steps", "rank_weight", "twin_distance", "train_loss", "bus_factor", "wrong",
                 "timestamp_index"):
        assert not is_timing(name) and column_kind(name) == "judged", name
    assert all(column_kind(c) == "context" for c in CONTEXT_COLUMNS)


def test_cells_agree_on_numbers_text_and_infinities():
    assert cells_agree("4", "4.0", RTOL64)
    assert not cells_agree("True", "False", RTOL64)
    assert cells_agree("inf", "inf", RTOL64) and not cells_agree("inf", "-inf", RTOL64)
    assert cells_agree("1e-20", "3e-20", RTOL64), "tiny numbers: the absolute floor of close()"


# ------------------------------------------------------------------ bad input
def error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert lines[0].startswith("compare.py: error: ")
    return lines[0]


def test_a_missing_folder_is_bad_input(tmp_path, capsys):
    good = write_folder(tmp_path / "a", {"toy": BASE})
    assert main([str(good), str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in error_line(capsys)


def test_a_folder_without_run_json_is_bad_input(tmp_path, capsys):
    good = write_folder(tmp_path / "a", {"toy": BASE})
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "toy.csv").write_text("study,case_id\n")
    assert main([str(good), str(tmp_path / "b")]) == 2
    assert "has no run.json" in error_line(capsys)


def test_unreadable_json_is_bad_input(tmp_path, capsys):
    good = write_folder(tmp_path / "a", {"toy": BASE})
    bad = write_folder(tmp_path / "b", {"toy": BASE})
    (bad / "run.json").write_text("{not json")
    assert main([str(good), str(bad)]) == 2
    assert "not valid JSON" in error_line(capsys)


def test_a_missing_or_ragged_csv_is_bad_input(tmp_path, capsys):
    good = write_folder(tmp_path / "a", {"toy": BASE})
    missing = write_folder(tmp_path / "b", {"toy": BASE})
    (missing / "toy.csv").unlink()
    assert main([str(good), str(missing)]) == 2
    assert "toy.csv: missing" in error_line(capsys)
    ragged = write_folder(tmp_path / "c", {"toy": BASE})
    with open(ragged / "toy.csv", "a") as handle:
        handle.write("toy,toy/case=3,mean\n")
    assert main([str(good), str(ragged)]) == 2
    assert "toy.csv: line 4" in error_line(capsys)


def test_no_study_in_common_is_bad_input(tmp_path, capsys):
    a = write_folder(tmp_path / "a", {"toy": BASE})
    b = write_folder(tmp_path / "b", {"other": [{**r, "study": "other"} for r in BASE]})
    assert main([str(a), str(b)]) == 2
    assert "no study in common" in error_line(capsys)


def test_an_unknown_study_or_a_missing_folder_argument_is_bad_input(tmp_path, capsys):
    a = write_folder(tmp_path / "a", {"toy": BASE})
    assert main([str(a), str(a), "--studies", "nope"]) == 2
    assert "'nope' is not in both folders; allowed: toy" in error_line(capsys)
    assert main([str(a)]) == 2
    error_line(capsys)


# ------------------------------------------------------------- a real rerun
@pytest.mark.launches(seconds=3)
def test_a_fresh_run_agrees_with_the_committed_results(tmp_path_factory, capsys):
    """The same studies, the same 4 ranks (world sizes 1..4) as results/: the same findings
    (a run shared with tests/test_reduction_study.py, made once per session)."""
    out = committed_layout_run(tmp_path_factory)
    assert main([str(ROOT / "results"), str(out), "--studies", "seed001,seed004"]) == 0, \
        capsys.readouterr().out


def test_help_explains_the_arguments_and_the_rules(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in ("--studies", "results folder", "timing columns", "run-context columns",
                   "Exit code: 0", f"{RTOL64:g} for float64"):
        assert needle in text, needle


def test_every_console_script_points_at_a_main_that_exists():
    import importlib

    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["grad-compare"] == "harness.grad_compare:main"
    for target in scripts.values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target
