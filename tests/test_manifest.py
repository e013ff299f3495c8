"""run.json: what the runner writes is what the one reader gives back, typed and without torch."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from harness.manifest import ManifestError, RunManifest, StudyEntry, read_manifest

MANIFEST = RunManifest(
    command="python scripts/study.py --nproc 2", settings={"seed": 0}, config={"quiet": True},
    world_sizes=[1, 2], context={"backend": "gloo", "dtype": "float32", "torch_version": "x"},
    started="2026-01-01T00:00:00+00:00", wall_time_s=1.5,
    studies={"reduction": StudyEntry(csvs=("reduction.csv",), cases=3, wall_time_s=0.5),
             "update": StudyEntry(csvs=("update-a.csv", "update-b.csv"), cases=4,
                                  wall_time_s=0.25)})


def test_what_the_runner_writes_reads_back_field_by_field(tmp_path):
    (tmp_path / "run.json").write_text(MANIFEST.to_json())
    read = read_manifest(tmp_path)
    assert read == MANIFEST
    assert read.dtype == "float32" and read.value("backend") == "gloo"
    assert read.value("command") == MANIFEST.command and read.value("absent", "-") == "-"
    assert read.csv_names("reduction") == ("reduction.csv",)
    assert read.csv_names("update") == ("update-a.csv", "update-b.csv")
    assert read.csv_names("comm") == ("comm.csv",)


def test_an_older_run_json_without_timings_reads_with_empty_fields(tmp_path):
    (tmp_path / "run.json").write_text('{"studies": {"reduction": {}}, "dtype": "float64"}')
    read = read_manifest(tmp_path)
    assert read.studies["reduction"] == StudyEntry(csvs=(), cases=0, wall_time_s=0.0)
    assert read.csv_names("reduction") == ("reduction.csv",) and math.isnan(read.wall_time_s)


def test_an_older_run_json_naming_one_csv_per_study_reads_as_a_list_of_one(tmp_path):
    (tmp_path / "run.json").write_text(
        '{"studies": {"comm": {"csv": "comm-old.csv", "cases": 2}}, "dtype": "float64"}')
    assert read_manifest(tmp_path).csv_names("comm") == ("comm-old.csv",)


@pytest.mark.parametrize("content, message", [
    (None, "has no run.json"), ("{", "not valid JSON"), ("[]", "has no 'studies' object"),
    ('{"studies": {}}', "lists no studies"),
])
def test_a_folder_that_is_not_a_finished_run_is_refused_in_one_line(tmp_path, content, message):
    (tmp_path / "other.txt").write_text("")
    if content is not None:
        (tmp_path / "run.json").write_text(content)
    with pytest.raises(ManifestError, match=message):
        read_manifest(tmp_path)


def test_reading_run_json_and_the_tolerances_imports_no_torch():
    code = ("import sys\nimport harness.manifest, harness.tolerances, harness.strategies\n"
            "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"
