"""A test's processes as Linux's ``/proc`` shows them: who descends from whom, who still
runs, and the leftovers of a test that failed, killed by pid (never by name)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def parents() -> dict[int, int]:
    """Every process's parent, from /proc (Linux)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (name) state ppid ...": the name may hold spaces and parentheses.
            found[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    return found


def descendants(pid: int) -> set[int]:
    known, found, frontier = parents(), set(), {pid}
    while frontier:
        frontier = {child for child, parent in known.items() if parent in frontier} - found
        found |= frontier
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (a process reparented to an init that does not reap stays
    one)."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    return False


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} after {seconds:g} s"
        time.sleep(0.05)


def kill_left(pids: set[int]) -> None:
    """This test's own processes that outlived it (SIGKILL by pid)."""
    for pid in pids:
        if running(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
