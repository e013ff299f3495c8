"""The processes of a split as Linux's ``/proc`` shows them, to grad-check and to the guards
alike: a process named by its pid and start time (a pid alone may be reused), whether it
still runs, grad-check's own, and every process started with the split's folder in its
environment, whatever session or group it moved to."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from harness.grad_check.script.wire import FOLDER_VARIABLE


def process_start(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot, from ``/proc``; '' where unknown):
    with the pid, it names one process, not whichever reuses the number later."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    return ""


def alive(pid: int, start: str) -> bool:
    """Whether process ``pid`` that started at ``start`` still runs (a zombie does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return fields[0] not in "ZX" and (not start or fields[19] == start)


def marked(folder: Path) -> list[int]:
    """The processes, other than this one, started with ``folder`` as their split's
    (``GRAD_CHECK_CAPTURE`` in the environment they were started with, which every process
    of the split inherits, whatever session or group it moved to)."""
    marker = f"{FOLDER_VARIABLE}={folder}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(environ.parent.name)
            if pid != os.getpid() and marker in environ.read_bytes().split(b"\0"):
                found.append(pid)
    return found


def grad_check_process() -> tuple[int, str, int]:
    """This process (grad-check's) as its ranks know it: pid, start time, process group."""
    return os.getpid(), process_start(os.getpid()), os.getpgrp()
