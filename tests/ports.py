"""The launchers' default rendezvous port, held by one test at a time.

``torchrun``, ``accelerate launch``, ``deepspeed``, ``trl`` and ``tune run --nproc_per_node``
bind 127.0.0.1:29500 where a command names no port, as the trainers' commands do (a row's
command is the line its users type). Two of them at once, from two xdist workers or two
pytest runs, fail with EADDRINUSE; a lock file in the machine's temporary folder (seen by
every process on it) makes them take turns.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from harness.grad_check.script.launchers import launcher_of

LOCK = Path(tempfile.gettempdir()) / "grad-study-port-29500.lock"


def binds_the_default_port(command: Sequence[str], nproc: int) -> bool:
    """Whether ``command`` run bare binds the port: several ranks, or one under a launcher
    (whose agent binds it even for one rank)."""
    return nproc > 1 or launcher_of(command) is not None


@contextlib.contextmanager
def default_port_held() -> Iterator[None]:
    """Held while something that binds the default port runs."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def launchers_port(command: Sequence[str], nproc: int) -> AbstractContextManager[None]:
    """Held while a trainer's ``command`` runs bare, where it binds the default port."""
    return default_port_held() if binds_the_default_port(command, nproc) \
        else contextlib.nullcontext()
