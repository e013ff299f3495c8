"""``study.py --nproc N``: start the ranks ourselves, without torchrun's noise.

The launcher does what ``torchrun --standalone`` does for one machine: it hosts the
ranks' rendezvous store (a TCPStore on a free port of localhost) and starts N ranks of
``python -m harness`` with torchrun's variables (RANK, WORLD_SIZE, MASTER_PORT...). The
ranks are forked from a fork server that has imported torch and the harness once
(harness/ranks.py), not N interpreters importing them afresh. Every flag has been
validated before this runs, so a rank that fails now fails for a reason of its own (an
exception, a crash, a hang): each rank writes its one error line into a folder the
launcher hands it (:data:`ERROR_DIR_VARIABLE`), and the launcher turns the first failure
into one line naming the rank and the cause -- the line always reaches the user,
whichever rank died first, and no traceback follows it. A rank killed by a signal writes
nothing, so the line names the signal and the case the rank had announced
(harness/failure.py).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from harness.errors import (
    ERROR_DIR_VARIABLE,
    INTERRUPTED_EXIT,
    INTERRUPTED_LINE,
    USAGE_EXIT,
    record_error,
)
from harness.failure import STOPPED_EXIT, killed_in_case
from harness.ranks import (
    Failure,
    Surroundings,
    describe_exit,
    describe_hang,
    detach_from_launcher,
    run_ranks,
)

ROOT = Path(__file__).resolve().parent.parent
#: What the fork server imports before it forks the ranks: torch, what DDP imports on first
#: use (torch._dynamo, ~1 s of CPU) and the harness's two command lines.
PRELOADED = ("torch", "torch._dynamo", "torch.distributed", "harness.grad_study", "harness.runner",
             "harness.grad_check.cli", "harness.grad_check.matrix")
#: Where the ranks meet: the launcher's store, on loopback.
STORE_HOST = "127.0.0.1"


def rendezvous_store(nproc: int) -> dist.TCPStore:
    """The ranks' rendezvous store, hosted by this process on a free port of localhost.

    Its server runs in threads of its own (C++), which block SIGINT and SIGTERM: a signal
    meant for this process must reach its main thread. Taken by another thread, Python
    notes it there and the main thread, asleep in a wait for the ranks, never learns of
    it until the ranks end by themselves (a Ctrl-C that did nothing, and exit code 0).
    """
    meant_for_main = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, meant_for_main)
    try:  # threads inherit the mask of the thread that starts them
        return dist.TCPStore(STORE_HOST, 0, nproc, is_master=True, wait_for_workers=False)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N``: the ranks are launched already."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


def rank_environment(error_dir: str, nproc: int, port: int) -> dict[str, str]:
    """What every rank gets: the harness importable (by what the rank starts too), one
    thread each, the error folder, and torchrun's variables but the rank's own."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
            # torchrun's default too, without its warning: tiny models gain nothing from
            # threads.
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            ERROR_DIR_VARIABLE: error_dir,
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": STORE_HOST, "MASTER_PORT": str(port),
            # init_process_group("env://") then joins the launcher's store as a client.
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _rank(module: str, argv: list[str], surroundings) -> None:
    """One rank: ``python -m <module> argv``, in a process forked from the fork server
    (``sys.exit(code)`` inside makes ``code`` the rank's exit code)."""
    detach_from_launcher()
    surroundings.enter()
    # The fork server's OpenMP read its variable when it loaded torch, maybe another value.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except Exception as error:  # noqa: BLE001 -- what the command did not say itself
        # Its line, not a traceback: the launcher names every rank's failure in one line
        # (a line the command recorded already is kept).
        record_error(int(os.environ["RANK"]), f"{type(error).__name__}: {error}")
        sys.exit(1)


class Stopped(Exception):
    """The launcher was told to stop (SIGTERM: ``kill``, a job scheduler's cancel)."""


@contextlib.contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`Stopped` inside, so that the ranks are stopped before the
    launcher exits (from the main thread only, where Python runs signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(*_: object) -> None:
        raise Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch_ranks(nproc: int, argv: Sequence[str], prog: str, module: str = "harness",
                 name_rank_of_bad_input: bool = True, timeout: float | None = None,
                 cwd: str | None = None) -> int:
    """Run ``python -m <module> argv`` on ``nproc`` local ranks; 0, 1 (a rank failed), 2,
    130 (interrupted) or 143 (SIGTERM).

    ``name_rank_of_bad_input=False``: bad input that only the ranks can find (e.g. the
    check's randomness in a user's loss) is reported as the launcher-side checks report
    theirs, without a rank number: it is the input's fault, not the rank's.
    ``timeout``: the ranks' ``--timeout``, after which a rank that makes no progress hung
    (harness/ranks.py). ``cwd``: the folder the ranks start in (default: this process's):
    the one the command started in, whatever folder the launcher's own checks of the
    user's code moved it to.
    """
    store = rendezvous_store(nproc)
    ranks_argv = strip_nproc(argv)
    with tempfile.TemporaryDirectory(prefix="harness-errors-") as error_dir:
        environment = rank_environment(error_dir, nproc, store.port)
        # Here too, before the fork server starts: OpenMP reads its variable when torch
        # loads it, and the launcher's own checks ask whether a launcher speaks for them.
        os.environ.update({name: environment[name]
                           for name in ("PYTHONPATH", "OMP_NUM_THREADS", ERROR_DIR_VARIABLE)})
        try:
            with stopped_by_sigterm():
                failure = run_ranks(nproc, _rank, lambda rank: (
                    module, ranks_argv, Surroundings({**os.environ, **environment,
                                                      "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                                     os.getcwd())),
                    Path(error_dir), PRELOADED, timeout, cwd)
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return INTERRUPTED_EXIT
        except Stopped:
            print(f"{prog}: stopped by SIGTERM", file=sys.stderr)
            return STOPPED_EXIT
        return 0 if failure is None else _said(failure, prog, Path(error_dir),
                                               name_rank_of_bad_input, timeout)


def _said(failure: Failure, prog: str, error_dir: Path, name_rank_of_bad_input: bool,
          timeout: float | None = None) -> int:
    """The one line a failed launch ends with; its exit code."""
    # By its code, or by its line: a rank stopped while it was exiting has neither its own
    # code nor any other.
    if INTERRUPTED_EXIT in failure.exitcodes or failure.line == INTERRUPTED_LINE:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    if failure.hung:
        hung_in = killed_in_case(error_dir, failure.hung[0])
        print(f"{prog}: error: {describe_hang(failure, timeout, hung_in)}", file=sys.stderr)
        return 1
    usage = failure.exitcode == USAGE_EXIT
    if usage and failure.line and not name_rank_of_bad_input:
        print(f"{prog}: error: {failure.line}", file=sys.stderr)
        return USAGE_EXIT
    what = failure.line or describe_exit(failure.exitcode,
                                          killed_in_case(error_dir, failure.rank))
    print(f"{prog}: error: rank {failure.rank} failed: {what}", file=sys.stderr)
    return USAGE_EXIT if usage else 1


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def say_if_oversubscribed(local_ranks: int, prog: str) -> None:
    """More ranks on this machine than cores is allowed (the findings do not change), but
    every rank then waits for a core: say so once, before anything runs."""
    cores = usable_cores()
    if local_ranks > cores:
        print(f"{prog}: note: {local_ranks} ranks share {cores} CPU core"
              f"{'s' if cores > 1 else ''}: the findings are the same, but timings "
              "will be slow", file=sys.stderr, flush=True)
