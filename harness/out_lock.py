"""One run of a command at a time in an ``--out``: two ``grad-check run`` would mix their
logs and overwrite each other's script.csv, two ``grad-study`` each other's CSVs (run.json
of one beside the rows of the other), each announcing its rows there.

A POSIX lock on a file in ``--out`` (``lockf``): the kernel releases it when the holder
ends, however it ends (a SIGKILL too), and a process the holder forks (a rank) does not
hold it. The file is removed when the check ends, so that ``--out`` holds only the rows
and the logs; a check that opened the file just before it was removed finds, once it holds
the lock, that the file it locked is no longer the one at that name, and tries again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from harness.errors import UsageError

#: The command that holds an --out -> its lock's file there, present while it runs.
LOCK_NAMES = {"grad-check run": ".grad-check-run.lock", "grad-study": ".grad-study.lock"}


@contextlib.contextmanager
def out_lock(out: Path, command: str = "grad-check run") -> Iterator[None]:
    """``--out`` for this run of ``command`` alone while inside; another run's is refused
    (bad input, one line naming the folder and the pid that holds it). A folder made for
    the lock is removed again where the run wrote nothing into it (it was refused)."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAMES[command]
    handle = locked(path, command)
    try:
        # The pid only names the holder in another check's refusal: a disk too full to take
        # it does not stop this check (what it writes later says so, with its path).
        with contextlib.suppress(OSError):
            handle.truncate(0)
            handle.write(f"{os.getpid()}\n")
            handle.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # before the lock goes: the next check makes its own file
        with contextlib.suppress(OSError):  # a pid the full disk never took, flushed again
            handle.close()
        if made:
            with contextlib.suppress(OSError):  # not empty: the run's own files
                out.rmdir()


def locked(path: Path, command: str):
    """The lock file at ``path``, opened and locked by this process."""
    while True:
        handle = path.open("a+")
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise UsageError(f"--out {str(path.parent)!r} is in use by another {command}"
                             f"{f' (pid {holder})' if holder else ''}; allowed: another "
                             "--out, or this one once that run has ended") from None
        if still_named(handle, path):
            return handle
        handle.close()  # the file its holder removed as it ended: lock the new one


def still_named(handle, path: Path) -> bool:
    """Whether the open file is the one at ``path`` (not one removed since it was opened)."""
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False
