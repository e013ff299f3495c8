"""Atomic writes and the journal: what a crash can and cannot leave behind."""

import json
import os

import pytest

from harness.errors import UsageError
from harness.results import Journal, atomic_path, write_csv_atomic, write_text_atomic


def test_atomic_write_replaces_whole_files_with_normal_permissions(tmp_path):
    target = tmp_path / "a.csv"
    write_text_atomic(target, "old\n")
    write_text_atomic(target, "new\n")
    assert target.read_text() == "new\n"
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["a.csv"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "a.csv"
    write_text_atomic(target, "old\n")
    with pytest.raises(RuntimeError), atomic_path(target) as temp:
        temp.write_text("half")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a.csv"]


def test_csv_rows_must_match_the_documented_schema(tmp_path):
    with pytest.raises(ValueError, match="undocumented \\['surprise'\\]"):
        write_csv_atomic(tmp_path / "x.csv", [{"a": 1, "surprise": 2}], ["a"])
    assert not (tmp_path / "x.csv").exists()


def test_floats_round_trip_exactly(tmp_path):
    import pandas as pd

    value = 1 / 3 + 1e-17
    write_csv_atomic(tmp_path / "x.csv", [{"a": value}], ["a"])
    assert pd.read_csv(tmp_path / "x.csv").a.iloc[0] == value


def test_journal_keeps_finished_cases_and_drops_a_torn_last_line(tmp_path):
    journal = Journal(tmp_path, "abc", rank=1)
    journal.start({})
    journal.append("s/case=1", [{"x": 1.5, "y": float("nan")}])
    journal.append("s/case=2", [{"x": 2.5, "y": 0.0}])
    with open(journal.path, "a") as handle:
        handle.write('{"case_id": "s/case=3", "rows": [{"x"')  # the write a crash cut short
    loaded = Journal(tmp_path, "abc", rank=1).load()
    assert list(loaded) == ["s/case=1", "s/case=2"]
    assert loaded["s/case=1"][0]["x"] == 1.5
    assert loaded["s/case=1"][0]["y"] != loaded["s/case=1"][0]["y"], "NaN survives"


def test_journal_of_another_configuration_is_refused(tmp_path):
    journal = Journal(tmp_path, "abc")
    journal.start({})
    journal.append("s/case=1", [{"x": 1}])
    with pytest.raises(UsageError, match="used a different configuration"):
        Journal(tmp_path, "other").load()
    header = json.loads(journal.path.read_text().splitlines()[0])
    assert header == {"fingerprint": "abc"}
