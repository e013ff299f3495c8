"""Ranks on this machine, forked from a fork server, watched until they end or one fails.

Two callers start ranks of their own: ``--nproc`` (harness/launcher.py) and the check's
Python API (harness/grad_check/api.py). Both fork them from ``multiprocessing``'s fork server:
a fresh interpreter that has touched no CUDA device and started no threads, which imports
torch and the harness once (``preload``) instead of once per rank -- seconds of CPU per
rank on a small machine (torch, and the ``torch._dynamo`` that DDP imports on first use).

A rank that fails leaves its one error line in the launch's folder as ``rank<R>.txt``
(harness/errors.py). When one rank fails, the others are stopped, and the failure named
is the one that came first: the rank whose line is the oldest, or a rank that had died
without a line before anyone was stopped (a signal: SIGKILL, the out-of-memory killer).
The ranks a failure brings down (a collective that lost its peer) fail after it, so
their lines are younger, whichever of them exits first.

A rank that hangs (in the user's code, say) fails nothing itself: the ranks waiting for
it in a collective time out and fail, and are its victims, not the cause. When the first
failure is such a timeout, the ranks still running once the other victims have given up
too are the ones named: they hung. So are ranks still running ``timeout`` seconds after
another finished (each rank ends right after the launch's last collective).

A launcher killed outright (SIGKILL, the out-of-memory killer) can stop nobody, so every
rank watches it: each holds the read end of a pipe whose write end only the launcher
holds, and exits at once, writing nothing more, when the pipe says the launcher is gone.
(The fork server alone would not do: every rank it forks holds the descriptor whose end
would tell the server that its launcher is gone, so the server outlives the launcher as
long as one rank does; each rank lets go of it.)
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing import reduction
from multiprocessing.connection import wait
from pathlib import Path

from harness.dies_with_launcher import LAUNCHER_VARIABLE
from harness.errors import error_file, timed_out_in_collective
from harness.failure import case_file

#: The module the fork server imports before its preload (its name, as preload takes it).
DIES_WITH_LAUNCHER = "harness.dies_with_launcher"
#: c10's log level for the ranks: what they log in C++ before raising (a lost peer, a
#: store they cannot reach) they also raise, and their launcher names the first failure.
CPP_LOG_LEVEL, RANKS_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL", "FATAL"

#: Seconds the other ranks get to end by themselves once one has failed (a rank that lost
#: its peer fails at once, with its own line and exit code), before they are stopped.
SETTLE_S = 1.0
#: Seconds a rank told to stop (SIGTERM) gets before it is killed.
STOP_GRACE_S = 2.0
#: The folder holding this harness: the fork server imports the harness from there, the
#: one this process runs, not whichever its own path would find first.
HARNESS_ROOT = str(Path(__file__).resolve().parent.parent)
#: ``prctl`` option: the signal a process gets when its parent dies (Linux).
_PR_SET_PDEATHSIG = 1
#: Exit code of a rank whose launcher is gone (nobody reads it: 128 + SIGKILL, as if the
#: launcher's death had taken the rank along).
LAUNCHER_GONE_EXIT = 128 + signal.SIGKILL


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


class LauncherWatch:
    """The read end of the pipe by which a rank sees its launcher go: nothing is ever
    written to it, and it reads end-of-file once no process holds the write end, which
    only the launcher does (the kernel closes it however the launcher ends)."""

    def __init__(self, read_fd: int) -> None:
        self.read_fd = read_fd

    def __reduce__(self):
        # Sent to the rank as a descriptor, as Surroundings sends its streams.
        return (_ReceivedWatch, (reduction.DupFd(self.read_fd),))


class _ReceivedWatch:
    def __init__(self, received) -> None:
        self.received = received

    def start(self) -> None:
        """In the rank: exit at once when the launcher is gone, whatever the rank does then
        (a thread of its own reads the pipe while the main thread computes or waits)."""
        threading.Thread(target=_exit_when_closed, args=(self.received.detach(),),
                         name="launcher-watch", daemon=True).start()


def _exit_when_closed(read_fd: int) -> None:
    while os.read(read_fd, 1):
        pass
    os._exit(LAUNCHER_GONE_EXIT)  # no cleanup, no result: the launcher cannot read it


def _rank_entry(watch: _ReceivedWatch, target: Callable[..., None], *args: object) -> None:
    """A rank, in the process the fork server forked: watch the launcher, let go of the
    fork server's liveness descriptor, then ``target(*args)``."""
    watch.start()
    _release_the_fork_server()
    target(*args)


def _release_the_fork_server() -> None:
    """Close the rank's copy of the descriptor by which the fork server sees its launcher
    alive: with it, the server would wait for this rank rather than end with the launcher.
    (A fork server this rank asks for later is one of its own.)"""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


@dataclass(frozen=True)
class Failure:
    """The rank that failed first: its exit code and its error line ('' if it wrote none);
    and every rank's exit code (the others' once they ended or were stopped)."""

    rank: int
    exitcode: int
    line: str
    exitcodes: tuple[int, ...] = ()
    #: The ranks that hung: made no progress while ``rank`` timed out waiting for them in
    #: a collective (its line says so), or once the others had finished (``line`` empty).
    hung: tuple[int, ...] = ()


def error_line(folder: Path, rank: int) -> str:
    """The line rank ``rank`` left in ``folder`` ('' if none)."""
    with contextlib.suppress(OSError):
        text = error_file(folder, rank).read_text().strip()
        return text.splitlines()[0] if text else ""
    return ""


def run_ranks(nproc: int, target: Callable[..., None], args_of: Callable[[int], tuple],
              folder: Path, preload: Sequence[str], timeout: float | None = None,
              cwd: str | None = None) -> Failure | None:
    """``target(*args_of(rank))`` on ranks 0..nproc-1, each a process forked from the fork
    server; None once all of them exit with 0, else the first failure (the others stopped).
    ``timeout``: the seconds the ranks' collectives wait, after which a rank still running
    while the others have given up on it, or have finished, hung (None: not known).
    ``cwd``: the folder the ranks start in, and the fork server if this call starts it
    (default: this process's); this process works there until they end.

    A KeyboardInterrupt here (Ctrl-C) stops the ranks and goes on to the caller.
    """
    with working_in(cwd or os.getcwd()), fork_server_environment():
        return _run_ranks(nproc, target, args_of, folder, preload, timeout)


@contextlib.contextmanager
def working_in(folder: str) -> Iterator[None]:
    """This process in ``folder`` inside, back where it was after: multiprocessing starts a
    process where its parent works (a rank: in its preparation; the fork server: with its
    relative entries of ``sys.path``)."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def fork_server_environment() -> Iterator[None]:
    """The environment a fork server started inside takes (it takes this process's, not its
    ``sys.path``), and its ranks with it:

    - PYTHONPATH led by :data:`HARNESS_ROOT`, so that it imports the same harness whatever
      folder it starts in (a checkout that is not installed, or installed from elsewhere);
    - this process named as its launcher, which it dies with (harness/dies_with_launcher.py);
    - c10's C++ log level (``TORCH_CPP_LOG_LEVEL``, :data:`RANKS_CPP_LOG_LEVEL` unless set),
      which c10 reads once, when the server imports torch: a rank whose peer was
      interrupted or failed first logs gloo's "connectFullMesh failed ... Connection closed
      by peer" on the console as it raises the same error, beside the one line its launcher
      ends with (which names the rank that failed first)."""
    told = {"PYTHONPATH": os.pathsep.join([HARNESS_ROOT, *filter(None, [
        os.environ.get("PYTHONPATH")])]), LAUNCHER_VARIABLE: str(os.getpid()),
        CPP_LOG_LEVEL: os.environ.get(CPP_LOG_LEVEL, RANKS_CPP_LOG_LEVEL)}
    before = {name: os.environ.get(name) for name in told}
    os.environ.update(told)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_ranks(nproc: int, target: Callable[..., None], args_of: Callable[[int], tuple],
               folder: Path, preload: Sequence[str],
               timeout: float | None) -> Failure | None:
    context = multiprocessing.get_context("forkserver")
    # First: the server dies with this process even while it imports the rest.
    context.set_forkserver_preload([DIES_WITH_LAUNCHER, *preload])
    read_fd, write_fd = os.pipe()  # not inherited by what this process execs
    watch = LauncherWatch(read_fd)
    # Not daemons: a rank may start processes of its own (a DataLoader's workers).
    ranks = [context.Process(target=_rank_entry, args=(watch, target, *args_of(rank)),
                             name=f"rank {rank}")
             for rank in range(nproc)]
    try:
        with _main_read_from_no_file():
            for process in ranks:
                process.start()
        os.close(read_fd)  # every rank has its own copy now
        read_fd = -1
        return _watch(ranks, folder, timeout)
    finally:
        stop(ranks)
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)


@contextlib.contextmanager
def _main_read_from_no_file() -> Iterator[None]:
    """A ``__main__`` whose ``__file__`` names no file (``python - < script``: '<stdin>')
    without that name inside: multiprocessing prepares each rank by running the calling
    script's file again, and would fail on it; without a file it prepares the rank as for
    ``python -c`` or a notebook, whose functions reach the ranks by value."""
    main = sys.modules.get("__main__")
    name = getattr(main, "__file__", None)
    if name is None or os.path.isfile(name):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = name


def _watch(ranks: list, folder: Path, timeout: float | None) -> Failure | None:
    running = list(ranks)
    finished_at: float | None = None  # when the first rank ended with 0
    while running:
        wait([process.sentinel for process in running],
             timeout=None if finished_at is None or timeout is None
             else max(0.0, finished_at + timeout - time.monotonic()))
        running = [process for process in running if process.exitcode is None]
        if any(process.exitcode for process in ranks):
            return _failed(ranks, running, folder, timeout)
        if running and finished_at is None:
            finished_at = time.monotonic()
        elif running and timeout is not None and time.monotonic() >= finished_at + timeout:
            hung = tuple(rank for rank, process in enumerate(ranks) if process.exitcode is None)
            stop(ranks)
            return Failure(hung[0], ranks[hung[0]].exitcode, "",
                           tuple(process.exitcode for process in ranks), hung)
    return None


def _failed(ranks: list, running: list, folder: Path, timeout: float | None) -> Failure:
    """The first failure, once a rank has failed; every rank stopped."""
    _settle(running)
    # Ended by themselves, before anyone was stopped (whenever their ends were seen: a
    # rank's end reaches the fork server's parent a moment after it).
    died = {rank for rank, process in enumerate(ranks) if process.exitcode}
    hung = _hung(ranks, _first_failure(ranks, died, folder), timeout)
    stop(ranks)
    return replace(_first_failure(ranks, died, folder), hung=hung)


def _hung(ranks: list, first: Failure, timeout: float | None) -> tuple[int, ...]:
    """The ranks that hung, when ``first`` timed out waiting in a collective: those still
    running once every other rank waiting has given up too, each within ``timeout`` of
    now, its wait having begun before. A rank left running alone waits for nobody (a
    collective fails at once on a peer that is gone): it hung. () when ``first`` failed
    for a reason of its own."""
    if not timed_out_in_collective(first.line):
        return ()
    running = [process for process in ranks if process.exitcode is None]
    deadline = time.monotonic() + (timeout or 0.0)
    while len(running) > 1 and (left := deadline - time.monotonic()) > 0:
        wait([process.sentinel for process in running], timeout=left)
        running = [process for process in running if process.exitcode is None]
    return tuple(rank for rank, process in enumerate(ranks) if process.exitcode is None)


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
    which ends with the launcher (the rank watches the launcher itself too:
    :class:`LauncherWatch`)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def describe_hang(failure: Failure, timeout: float | None, case_id: str = "") -> str:
    """``rank 1 hung: no progress for 10 s (rank 0 timed out waiting for it in a
    collective)``: the hung ranks, the wait and who gave up on them (and the case the
    first hung rank was in, where known)."""
    many = len(failure.hung) > 1
    who = (f"ranks {', '.join(map(str, failure.hung))}" if many
           else f"rank {failure.hung[0]}")
    where = f" in case {case_id}" if case_id else ""
    waited = f": no progress for {timeout:g} s" if timeout is not None else ""
    why = (f"rank {failure.rank} timed out waiting for {'them' if many else 'it'} in a "
           "collective" if failure.line else "the other ranks had finished")
    return f"{who} hung{where}{waited} ({why})"


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
