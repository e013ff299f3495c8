"""An --out on a file system that is full, or fills during the run: one line naming the
path, exit 2 before anything runs (nothing half-written), exit 1 once it fills mid-run,
every file finished before it kept whole (grad-study's journal resumes the run once there
is room). Each file system is a small tmpfs of the test's own (tests/filesystems.py)."""

from __future__ import annotations

import threading
import time

import pandas as pd
import pytest

from harness.grad_check.cli import main as grad_check
from harness.grad_study import main as grad_study
from harness.results import JOURNAL_DIR
from tests.distributed import launch
from tests.filesystems import fill, small_filesystem
from tests.script_runs import PROGRAM, python, run_check

pytestmark = pytest.mark.spread

STUDY = ["--studies", "seed001,reduction", "--strategies", "ddp", "--quiet", "--no-report"]


def full_refusal(out) -> str:
    return (f"--out {str(out)!r} cannot be created or written: No space left on device in "
            f"{str(out.parent)!r}; allowed: a folder you can write with free space")


def test_a_full_out_is_one_line_before_anything_runs(tmp_path, capsys):
    """Once a 29-line traceback (grad-check run) and a rank's 'OSError: [Errno 28]' naming
    no path (grad-study): a folder still fits on a full disk, a file's bytes do not."""
    with small_filesystem(tmp_path / "disk", kib=64) as disk:
        fill(disk)
        out = disk / "out"
        commands = [
            (grad_study, ["--nproc", "2", *STUDY, "--out", str(out)], "study.py"),
            (grad_check, ["--nproc", "2", "examples.readme_check:make_setup", "--out",
                          str(out)], "check.py"),
            (grad_check, ["run", "--global-batch", "8", "--out", str(out), "--",
                          *python(PROGRAM, "--batch-size", "{batch}", "--grad-accum",
                                  "{accum}")], "grad-check run"),
        ]
        for command, argv, prog in commands:
            assert command(argv) == 2
            assert capsys.readouterr().err.strip() == f"{prog}: error: {full_refusal(out)}"
            assert not out.exists()


@pytest.mark.launches(seconds=6)
def test_a_disk_that_fills_mid_run_keeps_every_finished_csv_and_resumes(tmp_path, capfd):
    """The disk fills once seed001.csv is written: the run ends in a line naming the file it
    could not write, seed001.csv stays whole, and --resume, once there is room, finishes
    with the numbers of a run that never stopped."""
    clean = tmp_path / "clean"
    assert launch(2, [*STUDY, "--out", str(clean)], tmp_path) == [0, 0]
    with small_filesystem(tmp_path / "disk", kib=1024) as disk:
        out = disk / "out"
        filler = threading.Thread(target=fill_once_written, args=(out / "seed001.csv", disk))
        filler.start()
        codes = launch(2, [*STUDY, "--out", str(out)], tmp_path)
        filler.join()
        err = capfd.readouterr().err
        assert 1 in codes and 0 not in codes, (codes, err)
        assert "failed: cannot write " in err and (
            ": No space left on device; every file written before is kept whole; once there "
            "is room, --resume finishes the run in the same --out") in err, err
        pd.testing.assert_frame_equal(pd.read_csv(out / "seed001.csv"),
                                      pd.read_csv(clean / "seed001.csv"))
        assert not (out / "reduction.csv").exists()
        (disk / "filler").unlink()
        assert launch(2, [*STUDY, "--out", str(out), "--resume"], tmp_path) == [0, 0]
        for name in ("seed001.csv", "reduction.csv"):
            pd.testing.assert_frame_equal(pd.read_csv(out / name), pd.read_csv(clean / name))
        assert not (out / JOURNAL_DIR).exists()


def fill_once_written(path, disk, timeout: float = 120) -> None:
    """Fill ``disk`` as soon as ``path`` exists (the run has written it whole: a rename)."""
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    fill(disk)


@pytest.mark.launches(seconds=4)
def test_grad_check_run_on_a_disk_that_fills_keeps_the_rows_of_the_splits_before(tmp_path):
    """The script fills --out's disk at split 2x1 (its logs then go nowhere, nor its rows):
    one line naming script.csv, exit 1, and script.csv holding the rows of 1x2, written
    when that split ended."""
    # --out is the small disk itself: the test's console is beside it, with room.
    with small_filesystem(tmp_path / "out", kib=1024) as out:
        done = run_check(["--global-batch", "8", "--splits", "1x2,2x1", "--reference-once",
                          "--", *python(PROGRAM, "--batch-size", "{batch}", "--grad-accum",
                                        "{accum}", "--fill-at-n2", str(out))], out)
        assert done.code == 1, done.stderr
        assert done.stderr.strip().splitlines()[-1] == (
            f"grad-check run: error: cannot write {out / 'script.csv'}: No space left on "
            "device; every file written before is kept whole")
        assert set(done.rows["split"]) == {"1x2"}
        assert set(done.rows["verdict"]) == {"matches"}
