"""Ranks on this machine, forked from a fork server, watched until they end or one fails.

Two callers start ranks of their own: ``--nproc`` (harness/launcher.py) and the check's
Python API (harness/check/api.py). Both fork them from ``multiprocessing``'s fork server:
a fresh interpreter that has touched no CUDA device and started no threads, which imports
torch and the harness once (``preload``) instead of once per rank -- seconds of CPU per
rank on a small machine (torch, and the ``torch._dynamo`` that DDP imports on first use).

A rank that fails leaves its one error line in the launch's folder as ``rank<R>.txt``
(harness/errors.py). When one rank fails, the others are stopped, and the failure named
is the one that came first: the rank whose line is the oldest, or a rank that had died
without a line before anyone was stopped (a signal: SIGKILL, the out-of-memory killer).
The ranks a failure brings down (a collective that lost its peer) fail after it, so
their lines are younger, whichever of them exits first.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import wait
from pathlib import Path

from harness.errors import error_file
from harness.failure import case_file

#: Seconds the other ranks get to end by themselves once one has failed (a rank that lost
#: its peer fails at once, with its own line and exit code), before they are stopped.
SETTLE_S = 1.0
#: Seconds a rank told to stop (SIGTERM) gets before it is killed.
STOP_GRACE_S = 2.0
#: ``prctl`` option: the signal a process gets when its parent dies (Linux).
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Surroundings:
    """What a rank takes from the process that starts it, as a subprocess would, whichever
    fork server forks it (one started earlier holds the environment, folder and streams
    of its own start): the environment, the working folder, and stdout and stderr, sent
    to the rank as descriptors."""

    environment: dict[str, str]
    cwd: str

    def __reduce__(self):
        # Called while the rank's process is being sent to the fork server: DupFd then
        # passes the descriptor along with it.
        return (_ReceivedSurroundings, (self.environment, self.cwd, reduction.DupFd(1),
                                        reduction.DupFd(2)))


class _ReceivedSurroundings:
    def __init__(self, environment: dict[str, str], cwd: str, stdout, stderr) -> None:
        self.environment, self.cwd, self.streams = environment, cwd, (stdout, stderr)

    def enter(self) -> None:
        """In the rank: take them on."""
        os.environ.clear()
        os.environ.update(self.environment)
        os.chdir(self.cwd)
        for fd, received in zip((1, 2), self.streams, strict=True):
            os.dup2(received.detach(), fd)


@dataclass(frozen=True)
class Failure:
    """The rank that failed first: its exit code and its error line ('' if it wrote none);
    and every rank's exit code (the others' once they ended or were stopped)."""

    rank: int
    exitcode: int
    line: str
    exitcodes: tuple[int, ...] = ()


def error_line(folder: Path, rank: int) -> str:
    """The line rank ``rank`` left in ``folder`` ('' if none)."""
    with contextlib.suppress(OSError):
        text = error_file(folder, rank).read_text().strip()
        return text.splitlines()[0] if text else ""
    return ""


def run_ranks(nproc: int, target: Callable[..., None], args_of: Callable[[int], tuple],
              folder: Path, preload: Sequence[str]) -> Failure | None:
    """``target(*args_of(rank))`` on ranks 0..nproc-1, each a process forked from the fork
    server; None once all of them exit with 0, else the first failure (the others stopped).

    A KeyboardInterrupt here (Ctrl-C) stops the ranks and goes on to the caller.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    # Not daemons: a rank may start processes of its own (a DataLoader's workers).
    ranks = [context.Process(target=target, args=args_of(rank), name=f"rank {rank}")
             for rank in range(nproc)]
    try:
        for process in ranks:
            process.start()
        return _watch(ranks, folder)
    finally:
        stop(ranks)


def _watch(ranks: list, folder: Path) -> Failure | None:
    running = list(ranks)
    while running:
        wait([process.sentinel for process in running])
        running = [process for process in running if process.exitcode is None]
        if any(process.exitcode for process in ranks):
            _settle(running)
            # Ended by themselves, before anyone was stopped (whenever their ends were
            # seen: a rank's end reaches the fork server's parent a moment after it).
            died = {rank for rank, process in enumerate(ranks) if process.exitcode}
            stop(ranks)
            return _first_failure(ranks, died, folder)
    return None


def _settle(running: list) -> None:
    """Up to :data:`SETTLE_S` for the ranks still running to end by themselves (those that
    are failing too, with their own lines and codes)."""
    deadline = time.monotonic() + SETTLE_S
    while running and (left := deadline - time.monotonic()) > 0:
        wait([process.sentinel for process in running], timeout=left)
        running = [process for process in running if process.exitcode is None]


def _first_failure(ranks: list, died: set[int], folder: Path) -> Failure:
    """The first failure among the ranks that left a line and those that died by themselves.

    A line is dated by its file; a rank that died without one (a signal) by the case it
    had announced and never withdrawn (``rank<R>.case``, harness/failure.py): it began
    before the others noticed the death. Without either, it counts as the first.
    """
    def failed_at(rank: int) -> float:
        for path in (error_file(folder, rank), case_file(folder, rank)):
            with contextlib.suppress(OSError):
                return path.stat().st_mtime
        return float("-inf")

    candidates = [rank for rank in range(len(ranks))
                  if rank in died or error_file(folder, rank).is_file()]
    first = min(candidates, key=failed_at)
    return Failure(first, ranks[first].exitcode, error_line(folder, first),
                   tuple(process.exitcode for process in ranks))


def stop(ranks: list) -> None:
    """Terminate the ranks still running, kill those that do not stop, reap all."""
    for process in ranks:
        if process.is_alive():
            process.terminate()
    for process in ranks:
        if process.pid is not None:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()


def detach_from_launcher() -> None:
    """In a rank: a session of its own, as torchrun gives its ranks (Ctrl-C at the terminal
    reaches the launcher alone, which stops the ranks), and death with the fork server,
    which ends with the launcher (a launcher killed outright leaves no rank behind)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def describe_exit(exitcode: int, case_id: str = "") -> str:
    """How a rank that left no line ended: its signal or exit code, and its case."""
    where = f" in case {case_id}" if case_id else ""
    if exitcode < 0:
        try:
            name = f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            name = ""
        return f"killed by signal {-exitcode}{name}{where}"
    return f"exited with code {exitcode}{where} without saying why"
