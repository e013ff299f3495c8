"""``study.py --nproc N``: the harness starts its own ranks, and a failure is one line."""

import os
import subprocess
import sys

import pandas as pd
import pytest

import harness.launcher as launcher
from harness.errors import ERROR_DIR_VARIABLE
from harness.launcher import strip_nproc
from tests.launch import ROOT, run_python

# Each launch is a test of its own.
pytestmark = pytest.mark.spread


def study(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python scripts/study.py args`` (forked: tests/launch.py says why)."""
    return run_python([sys.executable, str(ROOT / "scripts" / "study.py"), *args], env=env)


@pytest.mark.launches(seconds=6)
def test_nproc_runs_the_ranks_itself_and_more_ranks_than_cores_is_allowed_and_said_once(
        tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "usable_cores", lambda: 1)
    out = tmp_path / "out"
    done = study("--nproc", "2", "--studies", "seed001", "--strategies", "ddp", "--out", str(out),
                 "--quiet", "--no-report")
    assert done.returncode == 0, done.stderr
    note = ("study.py: note: 2 ranks share 1 CPU core: the findings are the same, but "
            "timings will be slow")
    assert done.stderr.count(note) == 1, done.stderr
    frame = pd.read_csv(out / "seed001.csv")
    assert sorted(frame.world_size.unique()) == [1, 2]
    assert (frame.launch_world_size == 2).all()
    import json

    command = json.loads((out / "run.json").read_text())["command"]
    assert command == ("python scripts/study.py --nproc 2 --studies seed001 --strategies ddp "
                       f"--out {out} --quiet --no-report")


def test_bad_input_is_refused_before_any_rank_starts(tmp_path):
    out = tmp_path / "out"
    done = study("--nproc", "2", "--world-sizes", "3", "--out", str(out))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "study.py: error: --world-sizes: 3 is larger than the launch's 2 ranks; allowed: 1..2 "
        "(or launch more ranks: --nproc, or torchrun --nproc_per_node)"]
    assert not out.exists()


@pytest.mark.launches(seconds=6)
def test_a_failed_rank_is_the_last_line_naming_rank_and_cause_without_traceback(tmp_path):
    out = tmp_path / "out"
    done = study("--nproc", "2", "--studies", "reduction", "--strategies", "ddp", "--out",
                 str(out), "--quiet", env={"HARNESS_FAULT": "rank=1,case=world_size=2,mode=raise"})
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == ("study.py: error: rank 1 failed: in case reduction/strategy=ddp/"
                         "world_size=2/model=toy/loss_reduction=mean: RuntimeError: fault "
                         "injected by HARNESS_FAULT")
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr


@pytest.mark.launches(seconds=6)
def test_a_rank_failing_outside_any_case_still_says_why(tmp_path):
    # The journal cannot be started: a file stands where its folder goes.
    out = tmp_path / "out"
    out.mkdir()
    (out / ".partial").write_text("not a folder")
    done = study("--nproc", "1", "--studies", "seed004", "--out", str(out), "--quiet",
                 "--no-report")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("study.py: error: rank 0 failed: FileExistsError: "), last
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("nproc, message", [
    ("0", "--nproc 0 is not allowed; allowed: 1..256"),
    ("two", "--nproc 'two' is not an integer"),
])
def test_bad_nproc(nproc, message, tmp_path):
    done = study("--nproc", nproc, "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.strip() == f"study.py: error: {message}"


def test_strip_nproc_leaves_every_other_flag():
    assert strip_nproc(["--nproc", "4", "--studies", "x", "--nproc=2", "--quiet"]) == [
        "--studies", "x", "--quiet"]


@pytest.fixture
def launcher_environment():
    """What launch_ranks sets in the launcher's environment, restored afterwards (set or
    not: with the error folder set, every later command here would think itself a rank)."""
    saved = {name: os.environ.get(name)
             for name in ("PYTHONPATH", "OMP_NUM_THREADS", ERROR_DIR_VARIABLE)}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.mark.launches(seconds=2)
def test_a_rank_that_fails_before_its_command_runs_says_why(launcher_environment, capfd):
    code = launcher.launch_ranks(1, [], "x.py", module="tests.no_such_module")
    err = capfd.readouterr().err
    assert code == 1
    assert err.strip().splitlines() == [
        "x.py: error: rank 0 failed: ImportError: No module named tests.no_such_module"], err


@pytest.mark.launches(seconds=8)
def test_a_rank_that_hangs_is_named_with_its_case_not_the_rank_that_waited_for_it(tmp_path):
    case = "reduction/strategy=ddp/world_size=2/model=mlp/loss_reduction=sum"
    done = study("--nproc", "2", "--studies", "seed001,reduction", "--strategies", "ddp",
                 "--out", str(tmp_path / "out"), "--quiet", "--no-report", "--timeout", "3",
                 env={"HARNESS_FAULT": f"rank=1,case={case},mode=hang"})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"study.py: error: rank 1 hung in case {case}: no progress for 3 s (rank 0 timed out "
        "waiting for it in a collective)"), done.stderr
