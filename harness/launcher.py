"""``study.py --nproc N``: start the ranks ourselves, without torchrun's noise.

torch's elastic launch API (what torchrun itself calls) starts N ranks of
``python -m harness`` on this machine, rendezvousing on a free local port as
``torchrun --standalone`` does. Every flag has been validated before this runs,
so a rank that fails now fails for a reason of its own (an exception, a crash,
a hang): each rank writes its one error line into a folder the launcher hands
it (:data:`ERROR_DIR_VARIABLE`), and the launcher turns the first failure into
one line naming the rank and the cause -- the line always reaches the user,
whichever rank died first, and no launcher traceback follows it. A rank killed by a
signal writes nothing, so the line names the signal and the case the rank had
announced (harness/failure.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from harness.errors import ERROR_DIR_VARIABLE, INTERRUPTED_EXIT, USAGE_EXIT
from harness.failure import killed_in_case

ROOT = Path(__file__).resolve().parent.parent
#: Loggers of torch's launcher: their per-rank failure reports and tracebacks are what
#: the one line replaces.
LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")


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


def _quiet_launcher() -> None:
    # torch gives some of its modules' loggers a level of their own (e.g. the agent's
    # "Received 2 death signal" warning on Ctrl-C): those are silenced one by one.
    names = [name for name in logging.root.manager.loggerDict
             if name.startswith(LAUNCHER_LOGGERS)]
    for name in {*LAUNCHER_LOGGERS, *names}:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _rank_environment(error_dir: str) -> None:
    """What every rank inherits: the harness importable, one thread each, the error folder."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # torchrun's default too, without its warning: tiny models gain nothing from threads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[ERROR_DIR_VARIABLE] = error_dir


def _first_error_line(error_dir: Path, rank: int) -> str:
    """The line rank ``rank`` wrote, else any rank's, else ''."""
    own = error_dir / f"rank{rank}.txt"
    for path in [own, *sorted(error_dir.glob("rank*.txt"))]:
        if path.is_file() and (text := path.read_text().strip()):
            return text.splitlines()[0]
    return ""


def launch_ranks(nproc: int, argv: Sequence[str], prog: str, module: str = "harness",
                 name_rank_of_bad_input: bool = True) -> int:
    """Run ``python -m <module> argv`` on ``nproc`` local ranks; 0, 1 (a rank failed) or 2.

    ``name_rank_of_bad_input=False``: bad input that only the ranks can find (e.g. the
    check's randomness in a user's loss) is reported as the launcher-side checks report
    theirs, without a rank number: it is the input's fault, not the rank's.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_launcher()
    with tempfile.TemporaryDirectory(prefix="harness-errors-") as error_dir:
        _rank_environment(error_dir)
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                              run_id=f"{module}-{os.getpid()}", rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", max_restarts=0)
        try:
            elastic_launch(config, sys.executable)("-m", module, *strip_nproc(argv))
        except (SignalException, KeyboardInterrupt):
            # Ctrl-C: torch's agent stops the ranks and raises; one line, nothing else.
            print(f"{prog}: interrupted", file=sys.stderr)
            return INTERRUPTED_EXIT
        except ChildFailedError as failed:
            if any(f.exitcode == INTERRUPTED_EXIT for f in failed.failures.values()):
                print(f"{prog}: interrupted", file=sys.stderr)
                return INTERRUPTED_EXIT
            rank, failure = failed.get_first_failure()
            cause = _first_error_line(Path(error_dir), rank)
            usage = failure.exitcode == USAGE_EXIT
            if usage and cause and not name_rank_of_bad_input:
                print(f"{prog}: error: {cause}", file=sys.stderr)
                return USAGE_EXIT
            # The rank's own line, where it wrote one, even if a signal ended it after
            # (a crash while exiting must not hide the error that made it exit).
            what = cause or _describe_exit(failure.exitcode,
                                           killed_in_case(Path(error_dir), rank))
            print(f"{prog}: error: rank {rank} failed: {what}", file=sys.stderr)
            return USAGE_EXIT if usage else 1
    return 0


def _describe_exit(exitcode: int, case_id: str = "") -> str:
    where = f" in case {case_id}" if case_id else ""
    if exitcode < 0:
        try:
            name = f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            name = ""
        return f"killed by signal {-exitcode}{name}{where}"
    return f"exited with code {exitcode}{where} without saying why"


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
