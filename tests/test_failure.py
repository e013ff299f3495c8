"""The error line reaches the user: under --nproc, under plain torchrun, and after a signal.

A rank killed by a signal writes nothing as it dies; the case it had announced is what
names it (harness/failure.py). Ranks that torchrun then stops were not the cause.
"""

import json
import signal
import sys

import pytest

import harness.launcher as launcher
from harness import ranks
from harness.failure import TORCHRUN_ERROR_FILE, killed_in_case, report_failure, running_case
from tests.launch import ROOT, run_python, torchrun

pytestmark = pytest.mark.spread

ARGS = ("--studies", "reduction", "--strategies", "ddp", "--quiet", "--no-report")
VICTIM = "reduction/strategy=ddp/world_size=2/model=toy/loss_reduction=mean"
KILL = {"HARNESS_FAULT": "rank=1,case=world_size=2,mode=kill"}


def study(*args: str, env: dict | None = None):
    return run_python([sys.executable, str(ROOT / "scripts" / "study.py"), *args], env=env)


@pytest.mark.launches(seconds=8)
def test_under_nproc_a_killed_rank_is_named_with_its_signal_and_case(tmp_path):
    done = study("--nproc", "2", *ARGS, "--out", str(tmp_path / "out"), env=KILL)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"study.py: error: rank 1 failed: killed by signal 9 (SIGKILL) in case {VICTIM}")


@pytest.mark.launches(seconds=8)
def test_under_plain_torchrun_the_summary_names_the_killed_rank_and_its_case(tmp_path):
    done = torchrun(*ARGS, "--out", str(tmp_path / "out"), nproc=2, env=KILL)
    assert done.returncode != 0
    root_cause = done.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "(SIGKILL)" in root_cause
    assert (f"traceback : study.py: rank 1 died in case {VICTIM} without a Python error: "
            "killed by a signal") in root_cause


@pytest.mark.launches(seconds=8)
def test_under_plain_torchrun_a_raising_rank_is_the_root_cause_with_its_line(tmp_path):
    raising = {"HARNESS_FAULT": "rank=1,case=world_size=2,mode=raise"}
    done = torchrun(*ARGS, "--out", str(tmp_path / "out"), nproc=2, env=raising)
    root_cause = done.stderr.split("Root Cause (first observed failure):")[1]
    assert (f"traceback : study.py: rank 1 failed: in case {VICTIM}: RuntimeError: fault "
            "injected by HARNESS_FAULT") in root_cause


def test_no_note_when_the_cores_suffice(capsys):
    # More ranks than cores: tests/test_launcher.py's --nproc run says so once.
    launcher.say_if_oversubscribed(launcher.usable_cores(), "study.py")
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------ the pieces, in-process
@pytest.fixture
def launched(tmp_path, monkeypatch):
    """A rank's environment under --nproc and torchrun's agent: both places to write."""
    monkeypatch.setenv("HARNESS_ERROR_DIR", str(tmp_path))
    monkeypatch.setenv(TORCHRUN_ERROR_FILE, str(tmp_path / "error.json"))
    return tmp_path


def test_a_case_is_announced_while_it_runs_and_withdrawn_after(launched):
    with running_case(1, "study/case=a"):
        assert killed_in_case(launched, 1) == "study/case=a"
        message = json.loads((launched / "error.json").read_text())["message"]
        assert message.startswith("study.py: rank 1 died in case study/case=a")
    assert killed_in_case(launched, 1) == ""
    assert not (launched / "error.json").exists()


def test_a_raising_case_leaves_its_own_line_not_the_announcement(launched):
    with pytest.raises(ValueError), running_case(0, "study/case=b"):
        report_failure(0, "in case study/case=b: ValueError: bad")
        raise ValueError("bad")
    assert killed_in_case(launched, 0) == ""
    assert (launched / "rank0.txt").read_text() == "in case study/case=b: ValueError: bad\n"
    written = json.loads((launched / "error.json").read_text())
    assert written["message"] == "study.py: rank 0 failed: in case study/case=b: ValueError: bad"


@pytest.mark.parametrize("exitcode, words", [
    (-signal.SIGKILL, "killed by signal 9 (SIGKILL) in case c"),
    (-99, "killed by signal 99 in case c"),
    (3, "exited with code 3 in case c without saying why"),
])
def test_an_exit_without_a_line_is_described(exitcode, words):
    assert ranks.describe_exit(exitcode, "c") == words
