"""Imported first by the fork server that forks a launcher's ranks (harness/ranks.py), so
that the server dies with the launcher that started it, however the launcher ends.

The fork server notices its launcher's end through a pipe only after its preload has
imported torch and the harness: seconds, in which a launcher killed outright (SIGKILL,
the out-of-memory killer) left it running alone. Here the kernel is asked to kill it the
moment its parent ends (``PR_SET_PDEATHSIG``). Only in the process this was meant for:
the launcher names itself in :data:`LAUNCHER_VARIABLE`, and any process but a fork server
(one that merely imports this module) is left alone. A server whose launcher ended before
it got here (it was still starting its interpreter) ends at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

#: The pid of the launcher whose fork server imports this module first.
LAUNCHER_VARIABLE = "HARNESS_FORK_SERVER_LAUNCHER"
#: ``prctl`` option: the signal a process gets when its parent dies (Linux).
PR_SET_PDEATHSIG = 1


def is_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server (``python -c 'from
    multiprocessing.forkserver import main; main(...)'``), importing its preload."""
    return "multiprocessing.forkserver" in sys.modules and sys.argv[:1] == ["-c"]


def die_with_launcher() -> None:
    """In a launcher's fork server: SIGKILL at the launcher's end; at once where the
    launcher has ended already (the server's parent is another by now)."""
    launcher = os.environ.get(LAUNCHER_VARIABLE)
    if not sys.platform.startswith("linux") or not launcher or not is_fork_server():
        return
    if str(os.getppid()) == launcher:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if str(os.getppid()) != launcher:  # it ended, before the request or since
        os._exit(1)


die_with_launcher()
