"""``study.py --nproc N``: the harness starts its own ranks, and a failure is one line."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import harness.launcher as launcher
from harness.errors import ERROR_DIR_VARIABLE
from harness.launcher import strip_nproc
from harness.ranks import Failure
from tests import check_setups
from tests.launch import ROOT, ForkedPython, run_python
from tests.process_tree import descendants, kill_left, running, wait_until

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
    ("two", "--nproc 'two' is not an integer; allowed: ASCII digits with an optional sign, "
            "e.g. 4"),
])
def test_bad_nproc(nproc, message, tmp_path):
    done = study("--nproc", nproc, "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.strip() == f"study.py: error: {message}"


def test_a_rank_stopped_after_it_wrote_its_line_is_named_by_its_line(capsys, tmp_path):
    # Its line is the cause; SIGTERM is only how the launcher stopped it afterwards.
    failure = Failure(rank=1, exitcode=-15, line="RuntimeError: the cause",
                      exitcodes=(-15, -15))
    assert launcher._said(failure, "x.py", tmp_path, True) == 1
    assert capsys.readouterr().err.strip() == "x.py: error: rank 1 failed: RuntimeError: the cause"


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


#: How soon after its launcher is killed no rank may be running (measured: at once).
RANKS_GONE_S = 5
#: ... and no process it started (measured: its fork server ends 3.5 to 16 s after it on a
#: 2-core machine with a load average of 15 to 20).
SERVER_GONE_S = 30


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
@pytest.mark.launches(seconds=20)
def test_a_launcher_killed_outright_leaves_no_rank_or_fork_server_behind(tmp_path):
    """A fresh interpreter (its own fork server): ``grad-check --nproc 2`` killed by
    SIGKILL while its ranks run, as the out-of-memory killer or ``kill -9`` does."""
    out = tmp_path / "out"
    with open(tmp_path / "stderr", "w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "check.py"), "--nproc", "2",
             "tests.check_setups:make_sleeping_setup", "--strategies", "ddp", "--world-sizes",
             "2", "--accum-steps", "1", "--out", str(out), "--quiet"],
            cwd=ROOT, env={**os.environ, check_setups.SLEEP_PID_DIR: str(tmp_path)},
            stdout=subprocess.DEVNULL, stderr=stderr)
    left: set[int] = set()
    try:
        wait_until(lambda: len(list(tmp_path.glob("*.pid"))) == 2 or launcher.poll() is not None,
                   120, "the ranks did not start")
        assert launcher.poll() is None, (tmp_path / "stderr").read_text()
        ranks = {int(path.stem) for path in tmp_path.glob("*.pid")}
        left = descendants(launcher.pid)  # the fork server, its resource tracker, the ranks
        assert ranks < left
        launcher.kill()
        launcher.wait()
        wait_until(lambda: not any(map(running, ranks)), RANKS_GONE_S,
                   f"ranks still running: {sorted(filter(running, ranks))}")
        # The fork server ends once no process holds its launcher's end of their pipe;
        # it writes nothing, but ends as an interpreter with torch loaded does (seconds
        # on a loaded machine), and its resource tracker with it.
        wait_until(lambda: not any(map(running, left)), SERVER_GONE_S,
                   f"still running: {sorted(filter(running, left))}")
    finally:
        launcher.kill()
        kill_left(left)
    assert not out.exists()


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
@pytest.mark.launches(seconds=8)
def test_a_study_launcher_killed_outright_leaves_no_rank_behind(tmp_path):
    """``grad-study --nproc 2`` (forked: its ranks come from this process's fork server,
    which outlives it) killed by SIGKILL while rank 1 hangs in a case and rank 0 waits for
    it there."""
    from multiprocessing import forkserver

    out, case = tmp_path / "out", "reduction/strategy=ddp/world_size=2/model=mlp/loss_reduction=sum"
    # The launcher's error folder (harness-errors-*) then lies here, with each rank's case.
    launcher = ForkedPython([sys.executable, str(ROOT / "scripts" / "study.py"), "--nproc", "2",
                             "--studies", "seed001,reduction", "--strategies", "ddp", "--out",
                             str(out), "--quiet", "--no-report"],
                            {**os.environ, "TMPDIR": str(tmp_path),
                             "HARNESS_FAULT": f"rank=1,case={case},mode=hang"},
                            tmp_path / "stdout", tmp_path / "stderr")

    def hanging() -> bool:
        return any(path.read_text().strip() == case
                   for path in tmp_path.glob("harness-errors-*/rank1.case"))

    ranks: set[int] = set()
    try:
        wait_until(lambda: hanging() or launcher.poll() is not None, 120,
                   "rank 1 did not reach the case it hangs in")
        assert launcher.poll() is None, (tmp_path / "stderr").read_text()
        ranks = descendants(forkserver._forkserver._forkserver_pid)
        assert len(ranks) == 2, ranks
        launcher.kill()
        launcher.wait()
        wait_until(lambda: not any(map(running, ranks)), RANKS_GONE_S,
                   f"still running: {sorted(filter(running, ranks))}")
    finally:
        launcher.kill()
        kill_left(ranks)
    assert not (out / "reduction.csv").exists()


def _blocked_signals(thread_id: int) -> set[int]:
    """The signals a thread of this process blocks, from its SigBlk mask in /proc."""
    status = Path(f"/proc/self/task/{thread_id}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("SigBlk:")), 16)
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_the_rendezvous_store_s_threads_leave_signals_to_the_main_thread():
    """A Ctrl-C the kernel hands to the store's server thread would never reach the
    launcher's main thread, asleep in its wait for the ranks: the launch would finish
    with exit code 0. The store's threads block the signals the launcher handles."""
    before = set(os.listdir("/proc/self/task"))
    main_mask = _blocked_signals(threading_main_id())
    store = launcher.rendezvous_store(1)
    try:
        started = set(os.listdir("/proc/self/task")) - before
        assert started, "the store started no thread: nothing to check"
        for thread in started:
            assert {signal.SIGINT, signal.SIGTERM} <= _blocked_signals(int(thread))
        assert _blocked_signals(threading_main_id()) == main_mask
    finally:
        del store


def threading_main_id() -> int:
    import threading

    return threading.main_thread().native_id
