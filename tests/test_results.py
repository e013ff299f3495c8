"""Atomic writes and the journal: what a crash can and cannot leave behind."""

import contextlib
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


@pytest.mark.parametrize("damage, what", [
    ('[1, 2]\n', "line 1 is not its header"),
    ('{"fingerprint": "abc"}\n{"case_id": "s/case=1"}\n{"case_id": "s/case=2", "rows": []}\n',
     "line 2 is not a finished case's rows"),
    ('{"fingerprint": "abc"}\n"rows"\n{"case_id": "s/case=2", "rows": []}\n',
     "line 2 is not a finished case's rows"),
    ('{"fingerprint": "abc"}\nnot json\n{"case_id": "s/case=2", "rows": []}\n',
     "line 2 is not a finished case's rows"),
    ('{"fingerprint": "abc"}\n{"case_id": "s/case=1", "rows": [1]}\n',
     "line 2 is not a finished case's rows"),
])
def test_a_journal_this_run_did_not_write_is_refused_naming_its_file(damage, what, tmp_path):
    """JSON of another shape (once "KeyError: 'rows'", naming no file) anywhere but a last
    line a crash cut short: one line naming the journal and the way out."""
    journal = Journal(tmp_path, "abc", rank=1)
    journal.path.parent.mkdir(parents=True)
    journal.path.write_text(damage)
    with pytest.raises(UsageError) as refused:
        journal.load()
    assert str(refused.value) == (
        f"--resume: the journal {str(journal.path)!r} is corrupted ({what}); allowed: delete "
        "it and resume (that rank's cases run again), or run without --resume")


def test_a_journal_of_bytes_that_are_not_utf8_is_refused_naming_its_file(tmp_path):
    journal = Journal(tmp_path, "abc")
    journal.path.parent.mkdir(parents=True)
    journal.path.write_bytes(b'{"fingerprint": "abc"}\n\xff\xfe\x00garbage\n')
    with pytest.raises(UsageError, match=r"journal\.rank0\.jsonl' is corrupted \(bytes that "
                                         r"are not UTF-8 at offset 23\)"):
        journal.load()


def test_a_file_that_cannot_be_written_is_named_not_its_temporary_stand_in(tmp_path,
                                                                            monkeypatch):
    """A full disk fails the write to the temporary file, which names no file: the error
    names the file meant, and the one there before stays whole."""
    import errno

    from harness.results import WriteError

    target = tmp_path / "rows.csv"
    write_text_atomic(target, "before\n")

    def full(self, text, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(target), "write_text", full)
    with pytest.raises(WriteError) as failed:
        write_text_atomic(target, "after\n")
    monkeypatch.undo()
    assert failed.value.filename == str(target) and failed.value.errno == errno.ENOSPC
    assert failed.value.line() == (f"cannot write {target}: No space left on device; every "
                                   "file written before is kept whole")
    assert target.read_text() == "before\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rows.csv"]  # no stand-in left


def test_a_journal_line_that_cannot_be_written_names_the_journal(tmp_path):
    from harness.results import WriteError

    journal = Journal(tmp_path, "abc")
    journal.start({})
    journal._handle.close()
    # Every write: No space left on device (its close, flushing again, too).
    with contextlib.suppress(OSError), open("/dev/full", "a") as full:
        journal._handle = full
        with pytest.raises(WriteError) as failed:
            journal.append("s/case=1", [{"x": 1}])
    assert failed.value.filename == str(journal.path)


def test_a_failed_rename_names_the_file_meant_not_the_temporary_one(tmp_path, monkeypatch):
    import errno

    import harness.results
    from harness.results import WriteError

    target = tmp_path / "rows.csv"

    def refused(source, destination):
        raise OSError(errno.EIO, "Input/output error", str(source), str(destination))

    monkeypatch.setattr(harness.results.os, "replace", refused)
    with pytest.raises(WriteError) as failed:
        write_text_atomic(target, "rows\n")
    assert failed.value.filename == str(target)
