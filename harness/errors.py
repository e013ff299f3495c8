"""The one error type the command line turns into a one-line message and exit code 2,
and how a rank hands its error line to the launcher that started it."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from pathlib import Path

#: Exit code of bad input (argparse's too).
USAGE_EXIT = 2
#: Exit code after Ctrl-C, as a shell gives a command killed by SIGINT (128 + 2).
INTERRUPTED_EXIT = 130
#: The line an interrupted rank leaves for the launcher.
INTERRUPTED_LINE = "interrupted"
#: How long a rank other than 0 waits before exiting on bad input: torchrun stops every
#: rank once one exits, and rank 0 (the one that prints) must have printed by then.
QUIET_RANK_EXIT_DELAY_S = 2.0
#: Set by ``study.py --nproc`` for the ranks it starts: a folder where each rank writes
#: its error line, which the launcher prints once (harness/launcher.py).
ERROR_DIR_VARIABLE = "HARNESS_ERROR_DIR"


#: How torch words a collective, or the rendezvous store, that waited too long for a rank:
#: gloo's "Timed out waiting 10000ms for recv operation", nccl's "... ran for 10000
#: milliseconds before timing out", the store's "Timed out after 11 seconds waiting for
#: clients" (RuntimeError or one of torch.distributed's Dist*Error).
_COLLECTIVE_TIMEOUT = re.compile(r"\b(RuntimeError|Dist\w*Error)\b.*\b(timed out|timing out|"
                                 r"timeout)\b", re.IGNORECASE)


def timed_out_in_collective(line: str) -> bool:
    """Whether the error ``line`` (``Type: message``) is a collective that timed out
    waiting for another rank: then that rank hung, not this one."""
    return bool(_COLLECTIVE_TIMEOUT.search(line))


class UsageError(ValueError):
    """Bad input: the message names the bad value and what is allowed."""


def launched_by_harness() -> bool:
    """True in a rank started by ``study.py --nproc``: the launcher speaks for it."""
    return ERROR_DIR_VARIABLE in os.environ


def error_file(folder: str | Path, rank: int) -> Path:
    """Where rank ``rank`` leaves its error line in a launcher's folder."""
    return Path(folder) / f"rank{rank}.txt"


def record_error(rank: int, line: str) -> None:
    """Leave ``line`` for the launcher (the first line a rank records is kept)."""
    folder = os.environ.get(ERROR_DIR_VARIABLE)
    if not folder:
        return
    path = error_file(folder, rank)
    with contextlib.suppress(OSError):
        if not path.exists():
            path.write_text(line + "\n")


def refuse(error: UsageError, rank: int, prog: str = "study.py", wait: bool = True) -> int:
    """Bad input, said once: through the launcher that started the ranks, or by rank 0
    (the others wait for its line to get out: ``wait=False`` where the caller makes them
    wait on rank 0 itself); the exit code to return."""
    if launched_by_harness():
        record_error(rank, str(error))
    elif rank == 0:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    elif wait:
        time.sleep(QUIET_RANK_EXIT_DELAY_S)
    return USAGE_EXIT


def interrupted(prog: str, speaks: bool) -> int:
    """Ctrl-C (or a KeyboardInterrupt in the user's code): one line, by the launcher that
    started the ranks or else by ``speaks`` (rank 0), no traceback; the exit code."""
    if launched_by_harness():
        record_error(0, INTERRUPTED_LINE)
    elif speaks:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT


def first_sentence(error: BaseException) -> str:
    """``Type: first sentence``: enough to recognise the error, short enough for a CSV cell."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text.split('. ')[0].rstrip('.')}"
