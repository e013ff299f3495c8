"""harness/ranks.py: the first failure among local ranks, and what a rank takes from the
process that starts it, whichever fork server forks it."""

from __future__ import annotations

import os
import time
from multiprocessing import forkserver
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.errors import timed_out_in_collective
from harness.ranks import Surroundings, _first_failure, describe_hang, run_ranks


def _ranks(*exitcodes: int | None) -> list:
    return [SimpleNamespace(exitcode=code) for code in exitcodes]


def _line(folder: Path, rank: int, text: str, age_s: float) -> None:
    path = folder / f"rank{rank}.txt"
    path.write_text(text + "\n")
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_the_rank_whose_line_is_oldest_failed_first_whichever_exited_first(tmp_path):
    # Rank 0 lost its peer and exited first; rank 1 raised before that, and was stopped.
    _line(tmp_path, 0, "RuntimeError: Connection reset by peer", age_s=1)
    _line(tmp_path, 1, "RuntimeError: the cause", age_s=2)
    failure = _first_failure(_ranks(1, -15), died={0}, folder=tmp_path)
    assert (failure.rank, failure.exitcode, failure.line) == (1, -15, "RuntimeError: the cause")


def test_a_rank_that_died_without_a_line_failed_before_every_line(tmp_path):
    _line(tmp_path, 0, "RuntimeError: Connection reset by peer", age_s=5)
    failure = _first_failure(_ranks(1, -9), died={0, 1}, folder=tmp_path)
    assert (failure.rank, failure.exitcode, failure.line) == (1, -9, "")


def test_a_rank_killed_in_a_case_failed_when_the_case_began(tmp_path):
    # Its end was seen after the line of the rank that lost it; its case began before.
    _line(tmp_path, 0, "RuntimeError: Connection reset by peer", age_s=1)
    case = tmp_path / "rank1.case"
    case.write_text("reduction/strategy=ddp/world_size=2\n")
    then = time.time() - 2
    os.utime(case, (then, then))
    failure = _first_failure(_ranks(1, -9), died={0, 1}, folder=tmp_path)
    assert (failure.rank, failure.exitcode, failure.exitcodes) == (1, -9, (1, -9))


def test_a_rank_stopped_without_a_line_is_not_the_cause(tmp_path):
    _line(tmp_path, 1, "ValueError: bad", age_s=0)
    failure = _first_failure(_ranks(-15, 1, -15), died={1}, folder=tmp_path)
    assert failure.rank == 1


def _report_surroundings(rank: int, surroundings, folder: str) -> None:
    surroundings.enter()
    print(f"rank {rank} says hello", flush=True)
    Path(folder, f"rank{rank}.seen").write_text(
        f"{os.environ.get('HARNESS_TEST_VALUE')}\n{os.getcwd()}")


@pytest.mark.launches(seconds=3)
def test_a_rank_takes_the_environment_folder_and_stdout_of_its_launch(tmp_path, monkeypatch):
    forkserver.ensure_running()  # started before any of what the ranks must see
    monkeypatch.setenv("HARNESS_TEST_VALUE", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    stdout = tmp_path / "stdout"
    saved = os.dup(1)
    os.dup2(os.open(stdout, os.O_WRONLY | os.O_CREAT, 0o644), 1)
    try:
        failure = run_ranks(2, _report_surroundings, lambda rank: (
            rank, Surroundings(dict(os.environ), os.getcwd()), str(tmp_path)), tmp_path, [])
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert failure is None
    for rank in range(2):
        value, cwd = (tmp_path / f"rank{rank}.seen").read_text().splitlines()
        assert (value, cwd) == ("set after the fork server started", str(tmp_path))
    assert sorted(stdout.read_text().splitlines()) == ["rank 0 says hello",
                                                       "rank 1 says hello"]


@pytest.mark.parametrize(("line", "timed_out"), [
    ("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for "
     "recv operation to complete", True),
    ("in case reduction/x: DistBackendError: [Rank 0] Watchdog caught collective operation "
     "timeout: WorkNCCL(SeqNum=4, OpType=ALLREDUCE) ran for 3000 milliseconds before timing "
     "out.", True),
    ("DistStoreError: Timed out after 4 seconds waiting for clients. 1/2 clients joined.", True),
    ("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer", False),
    ("ValueError: the user's own error", False),
    ("TimeoutError: the user's own data server timed out", False),
])
def test_a_collective_that_timed_out_is_told_from_other_failures(line, timed_out):
    assert timed_out_in_collective(line) is timed_out


def _finishes_or_sleeps(rank: int, folder: str) -> None:
    if rank == 1:
        Path(folder, "sleeping.pid").write_text(str(os.getpid()))
        time.sleep(600)


@pytest.mark.launches(seconds=3)
def test_a_rank_still_running_a_timeout_after_the_others_finished_hung(tmp_path):
    failure = run_ranks(2, _finishes_or_sleeps, lambda rank: (rank, str(tmp_path)), tmp_path,
                        [], timeout=1)
    assert failure is not None and failure.hung == (1,)
    assert describe_hang(failure, 1) == ("rank 1 hung: no progress for 1 s (the other ranks "
                                         "had finished)")
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "sleeping.pid").read_text()), 0)


LAUNCHER = """
import sys
from pathlib import Path
from harness.ranks import run_ranks

run_ranks(1, print, lambda rank: (rank,), Path(sys.argv[1]), preload=["tests.stalled_import"])
"""


@pytest.mark.launches(seconds=2)
def test_a_fork_server_ends_with_its_launcher_even_in_its_preload(tmp_path):
    """Its launcher killed outright while the server still imports its preload (torch, on
    a loaded machine: seconds; here, a module whose import never ends), the server ends
    with it rather than living on as an orphan until the import is done."""
    import subprocess
    import sys

    from tests.launch import ROOT
    from tests.process_tree import descendants, kill_left, running, wait_until

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], cwd=ROOT)
    servers: set[int] = set()
    try:
        def started() -> bool:
            servers.update(pid for pid in descendants(launcher.pid)
                           if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes())
            return bool(servers) or launcher.poll() is not None

        wait_until(started, 120, "no fork server started")
        [server] = servers
        wait_until(lambda: b"stalled_import" in Path(f"/proc/{server}/cmdline").read_bytes(),
                   5, "not the server of this preload")
        launcher.kill()
        launcher.wait()
        # Its preload never ends: only its launcher's death can end it.
        wait_until(lambda: not running(server), 60, "the fork server outlived its launcher")
    finally:
        launcher.kill()
        kill_left(servers)


C10_LOGGING = """
import sys
from pathlib import Path
from harness.ranks import run_ranks
from tests.c10_logging_rank import unreachable_store

run_ranks(1, unreachable_store, lambda rank: (rank,), Path(sys.argv[1]), preload=["torch"])
"""


@pytest.mark.launches(seconds=4)
def test_what_a_rank_logs_in_cpp_as_it_fails_stays_off_the_console(tmp_path):
    """c10 reads its log level once, as the fork server imports torch: the server is
    started with TORCH_CPP_LOG_LEVEL=FATAL (unless set), so a rank that logs in C++ what it
    also raises (gloo's 'connectFullMesh failed ... Connection closed by peer' once its peer
    was interrupted) prints nothing beside the launcher's one line; a level the user set
    holds."""
    import os
    import subprocess
    import sys

    from tests.launch import ROOT

    environment = {name: value for name, value in os.environ.items()
                   if name != "TORCH_CPP_LOG_LEVEL"}
    quiet = subprocess.run([sys.executable, "-c", C10_LOGGING, str(tmp_path)], cwd=ROOT,
                           env=environment, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and quiet.stdout.strip() == "raised DistNetworkError"
    assert quiet.stderr == ""
    told = subprocess.run([sys.executable, "-c", C10_LOGGING, str(tmp_path)], cwd=ROOT,
                          env={**environment, "TORCH_CPP_LOG_LEVEL": "ERROR"},
                          capture_output=True, text=True, timeout=120)
    assert told.returncode == 0 and "[c10d] The client socket has timed out" in told.stderr
