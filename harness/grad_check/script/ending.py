"""How a rank's capture ends: its summary kept after every finished step, written whole at
step S, the wait for the other ranks' summaries, the process's end.

A summary is written under the rank's final name (``rank<R>.pt``) once, at step S or at
the process's exit; after each step before that, what the rank has captured so far goes to
``rank<R>.partial.pt``, so that a rank that crashes, hangs or is stopped later still leaves
every step it finished (records.py reads the final summary, else the partial one). A rank
that reached step S waits for every other rank's final summary inside grad-check's own
exchange, which its guard is told (guard.py), so that a hang blames the rank that never
arrived.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from harness.errors import error_file
from harness.grad_check.script.files import partial_file, save_atomically, summary_file
from harness.grad_check.script.guard import waiting_in_exchange
from harness.grad_check.script.wire import RankError, RankSummary, error_record

#: Seconds between looks for the other ranks' summaries.
POLL_S = 0.01


def keep_partial(summary: RankSummary, folder: Path, rank: int) -> None:
    """What the rank captured so far, in place of what it kept before."""
    save_atomically(summary.to_json(), partial_file(folder, rank))


def write_final(summary: RankSummary, folder: Path, rank: int) -> None:
    save_atomically(summary.to_json(), summary_file(folder, rank))
    with contextlib.suppress(OSError):
        partial_file(folder, rank).unlink()


def wait_for_every_summary(folder: Path, rank: int, world_size: int, steps: int,
                           timeout: float) -> bool:
    """Until every rank's final summary exists (no collective of step S is still running
    anywhere then); False where ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    with waiting_in_exchange(f"the end of step {steps - 1}"):
        while not all(summary_file(folder, r).exists() for r in range(world_size)):
            if time.monotonic() > deadline:
                record_line(folder, rank, f"rank {rank} waited {timeout:g} s at step {steps} "
                                          "for the other ranks' captures")
                return False
            time.sleep(POLL_S)
    return True


def record_line(folder: Path, rank: int, line: str) -> None:
    """The rank's one line for the launcher (the first one recorded is kept)."""
    path = error_file(folder, rank)
    with contextlib.suppress(OSError):
        if not path.exists():
            path.write_text(line + "\n")


def record_error(folder: Path, rank: int, error: RankError) -> None:
    """A Python error of the rank: its line, and its fields beside it (the first one
    recorded is kept, and only with the line it stands for)."""
    if error_file(folder, rank).exists():
        return
    with contextlib.suppress(OSError):
        error_record(folder, rank).write_text(error.to_json())
    record_line(folder, rank, error.line)


def exit_now(code: int) -> None:
    """End the process now: the script's own teardown (a process group, DataLoader
    workers, a framework's callbacks) would run collectives that other ranks, already
    gone, no longer answer."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
