"""What a failing rank leaves behind, so that its line reaches the user however it was launched.

Two launchers read it:

- ``study.py --nproc`` (harness/launcher.py) reads the folder named by
  :data:`~harness.errors.ERROR_DIR_VARIABLE`: ``rank<R>.txt`` (the rank's error line) and
  ``rank<R>.case`` (the case it was running);
- torchrun reads the file named by :data:`TORCHRUN_ERROR_FILE`: its summary prints the
  file's message as the rank's "traceback" and names the failure with the earliest
  timestamp as the root cause.

A rank that raises writes its line to both. A rank killed by a signal (SIGKILL, the
out-of-memory killer) can write nothing when it dies, so each case is announced before
it runs and withdrawn when it ends: a rank that dies inside it leaves the case behind,
stamped with the time the case began, earlier than any rank that noticed the death
afterwards. A rank that torchrun stops with SIGTERM because another one failed was not
the cause: :func:`withdraw_on_stop` withdraws its announcement at once and exits, even
when the rank is blocked inside a collective (see the function).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from harness.errors import ERROR_DIR_VARIABLE, record_error

#: Set by torchrun's agent for each rank: where the rank may leave its failure message.
TORCHRUN_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
#: Exit code of a rank that withdrew after torchrun's SIGTERM (the shell's 128 + 15).
STOPPED_EXIT = 128 + signal.SIGTERM
#: The socket pair of :func:`withdraw_on_stop`, kept open for the life of the process.
_WAKEUP: list[socket.socket] = []


def case_file(folder: str | Path, rank: int) -> Path:
    """Where rank ``rank`` announces the case it runs in a launcher's folder."""
    return Path(folder) / f"rank{rank}.case"


def case_marker(rank: int) -> Path | None:
    """``rank<R>.case`` in the --nproc launcher's folder (None outside --nproc)."""
    folder = os.environ.get(ERROR_DIR_VARIABLE)
    return case_file(folder, rank) if folder else None


def _write_torchrun_message(line: str, timestamp: float) -> None:
    """torchrun's error file, in the plain-message form its summary prints.

    Stamped one second early: torchrun compares whole seconds and, on a tie, may name
    whichever rank it lists first; the ranks a failure brings down (a collective that
    lost its peer, SIGTERM) fail within the same second, and must sort after it."""
    path = os.environ.get(TORCHRUN_ERROR_FILE)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps({"message": line,
                                              "timestamp": int(timestamp) - 1}))


def _remove(path: str | Path | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.remove(path)


def report_failure(rank: int, line: str) -> None:
    """The rank's error line, for whichever launcher started it (the first line is kept)."""
    record_error(rank, line)
    _write_torchrun_message(f"study.py: rank {rank} failed: {line}", time.time())


@contextlib.contextmanager
def running_case(rank: int, case_id: str) -> Iterator[None]:
    """Announce ``case_id`` while it runs: what a rank killed inside it leaves behind.
    Withdrawn when the case ends, by returning or by raising (which reports its own line)."""
    marker = case_marker(rank)
    if marker is not None:
        with contextlib.suppress(OSError):
            marker.write_text(case_id + "\n")
    _write_torchrun_message(f"study.py: rank {rank} died in case {case_id} without a Python "
                            "error: killed by a signal (out of memory, or from outside)",
                            time.time())
    try:
        yield
    except BaseException:
        _remove(marker)
        raise
    _remove(marker)
    _remove(os.environ.get(TORCHRUN_ERROR_FILE))


def killed_in_case(error_dir: Path, rank: int) -> str:
    """The case rank ``rank`` announced and never withdrew ('' if none)."""
    with contextlib.suppress(OSError):
        return case_file(error_dir, rank).read_text().strip()
    return ""


def withdraw_on_stop(rank: int) -> None:
    """On SIGTERM (torchrun stopping the ranks after another failed): withdraw this rank's
    case announcement and exit at once.

    A Python signal handler alone would run only when the main thread next executes
    Python, never while it waits inside a collective; so the handler's C part also writes
    the signal to a socket (``signal.set_wakeup_fd``) that a helper thread waits on, and
    the thread, which runs while the main thread waits, withdraws and exits.
    Only under torchrun's agent, from the main thread (``--nproc`` names the first failure
    itself: harness/ranks.py).
    """
    if TORCHRUN_ERROR_FILE not in os.environ:
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    _WAKEUP[:] = [reader, writer]  # a collected socket would close, and wake the thread

    def stop(*_: object) -> None:
        _remove(case_marker(rank))
        _remove(os.environ.get(TORCHRUN_ERROR_FILE))
        os._exit(STOPPED_EXIT)

    def wait_for_sigterm() -> None:
        while received := reader.recv(1):  # b"": closed, at the interpreter's exit
            if received == bytes([signal.SIGTERM]):
                stop()

    signal.signal(signal.SIGTERM, stop)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=wait_for_sigterm, name="withdraw-on-sigterm", daemon=True).start()
