"""The one error type the command line turns into a one-line message and exit code 2,
and how a rank hands its error line to the launcher that started it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

#: Exit code of bad input (argparse's too).
USAGE_EXIT = 2
#: Set by ``study.py --nproc`` for the ranks it starts: a folder where each rank writes
#: its error line, which the launcher prints once (harness/launcher.py).
ERROR_DIR_VARIABLE = "HARNESS_ERROR_DIR"


class UsageError(ValueError):
    """Bad input: the message names the bad value and what is allowed."""


def launched_by_harness() -> bool:
    """True in a rank started by ``study.py --nproc``: the launcher speaks for it."""
    return ERROR_DIR_VARIABLE in os.environ


def record_error(rank: int, line: str) -> None:
    """Leave ``line`` for the launcher (the first line a rank records is kept)."""
    folder = os.environ.get(ERROR_DIR_VARIABLE)
    if not folder:
        return
    path = Path(folder) / f"rank{rank}.txt"
    with contextlib.suppress(OSError):
        if not path.exists():
            path.write_text(line + "\n")
