"""What ``grad-check run`` watches inside every process of a split, beside the capture.

``startup/sitecustomize.py`` installs it (installed.py) in each Python process the
command starts (the ranks, a launcher at the command's head and the workers
it starts, a DataLoader's spawned workers), wherever ``GRAD_CHECK_CAPTURE`` names the
split's folder. In each it:

- registers the process (``processes/<pid>``: its start time, process group, rank and
  command), so that grad-check can end, after the split, what its own stop did not reach
  (a launcher's workers run in sessions of their own);
- watches grad-check: a thread holds a pidfd of grad-check's process (the pid and start
  time come through the environment, as a pipe's end cannot: a launcher in the command
  closes the descriptors it does not know before it starts its workers) and, once
  grad-check is gone however it ended (SIGKILL included), kills its own process group
  (its DataLoader workers with it) and exits;
- in a rank (any process but the launcher grad-check started for a command that starts
  its own ranks): installs the capture, writes the rank's progress (optimizer steps and
  forward passes, ``progress/rank<R>``) for the hang that names the rank that made
  none, claims its RANK when it joins the process group (``claims/rank<R>``, created
  exclusively: a second live process joining as the same rank ends the split at once,
  naming both), and, under a launcher, checks that the launcher started the split's N.

A failure that ends the split at once is ``fatal`` in the folder (its rank and line),
which grad-check looks for while the split runs. Nothing here imports torch before the
capture has (a launcher's process need not load it).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import select
import signal
import sys
import sysconfig
import threading
import time
import traceback as tracebacks
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from harness.errors import USAGE_EXIT
from harness.grad_check.script.pids import alive, marked, process_start
from harness.grad_check.script.wire import (
    CLAIMS,
    FATAL,
    PROCESSES,
    PROGRESS,
    Claim,
    Fatal,
    ProcessEntry,
    Progress,
    RankError,
    RankSettings,
)

#: Seconds between looks at grad-check where no pidfd is to be had, and between writes
#: of the rank's progress.
WATCH_S = 0.2
#: Exit code of a process whose grad-check is gone (nobody reads it).
GONE_EXIT = 128 + signal.SIGKILL


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(
            errors="replace").split("\0")).strip()
    return ""


def write_exclusively(path: Path, text: str) -> bool:
    """``text`` into a new file ``path``; False where it exists already."""
    try:
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(handle, "w") as file:
        file.write(text)
    return True


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


# ---------------------------------------------------------------- the failing frame
#: Where Python's own modules and installed packages live (this interpreter's, and any
#: ``site-packages`` on the path): a frame there is not the line of the user's that failed,
#: unless no frame of theirs is on the way.
_LIBRARIES = tuple({os.path.realpath(path) + os.sep for path in (
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]) if path})
_PACKAGES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
#: grad-check's own code in the user's processes (the guard's wrapper of
#: init_process_group, the capture's hooks): never the user's line either.
_OURS = os.path.dirname(os.path.realpath(__file__)) + os.sep


def failing_frame(traceback) -> tracebacks.FrameSummary | None:
    """The frame to name for an error: the innermost of the user's own code (not Python's
    library, not an installed package, not grad-check's), else the innermost."""
    frames = tracebacks.extract_tb(traceback) if traceback is not None else []
    for frame in reversed(frames):
        path = os.path.realpath(frame.filename)
        if os.path.isfile(path) and not path.startswith((*_LIBRARIES, _OURS)) and \
                not any(folder in path for folder in _PACKAGES):
            return frame
    return frames[-1] if frames else None


def shown_path(filename: str) -> str:
    """A file as the user would type it: relative to the current folder where under it."""
    path = os.path.realpath(filename)
    here = os.path.realpath(os.getcwd()) + os.sep
    return path[len(here):] if path.startswith(here) else filename


def failed(error: BaseException, traceback) -> RankError:
    """The error as a rank reports it: its type, its first sentence (where it says nothing,
    a bare ``assert``, the failing source line stands for it), and the frame it names."""
    from harness.errors import first_sentence

    kind = type(error).__name__
    message = first_sentence(error).removeprefix(f"{kind}: ")
    frame = failing_frame(traceback)
    if frame is None:
        return RankError(kind, message)
    if not str(error).strip():
        message = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return RankError(kind, message, f"{shown_path(frame.filename)}:{frame.lineno}")


# ---------------------------------------------------------------- the guard
class Guard:
    """The guard of one process of a split (see the module's docstring)."""

    def __init__(self, settings: RankSettings, environment: Mapping[str, str]) -> None:
        self.folder = settings.folder
        self.grad_check, self.grad_check_start = settings.pid, settings.pid_start
        self.grad_check_group = settings.pgid
        self.nproc, self.split = settings.nproc, settings.split
        self.launched_by_command = settings.launched_by_command
        self.launcher_name = settings.launcher or "the launcher"
        self.rank = int(environment.get("RANK") or 0)
        self.world_size = environment.get("WORLD_SIZE")
        #: The process grad-check started, where the command starts the ranks itself.
        self.is_launcher = self.launched_by_command and os.getppid() == self.grad_check
        self.steps = 0
        self.forwards = 0
        self.depth = 0
        #: Where the rank waits in grad-check's own exchange, if it does: it has reached
        #: that point of the step (harness/grad_check/script/failures.py hang()).
        self.waiting: str | None = None
        self._written: tuple[int, int, str | None] | None = None
        self._writing = threading.Lock()
        self.progressing = False

    # ------------------------------------------------------------ every process
    def start(self) -> None:
        """Register this process and watch grad-check from a thread of its own."""
        with contextlib.suppress(OSError):
            (self.folder / PROCESSES).mkdir(exist_ok=True)
            write_atomically(self.folder / PROCESSES / str(os.getpid()), ProcessEntry(
                os.getpid(), process_start(os.getpid()), os.getpgrp(),
                None if self.is_launcher else self.rank, " ".join(sys.argv)).to_json())
        if self.grad_check:
            threading.Thread(target=self._watch, name="grad-check-watch", daemon=True).start()

    def _watch(self) -> None:
        """Until grad-check is gone: write the rank's progress now and then; then end."""
        handle = None
        with contextlib.suppress(OSError, AttributeError):
            handle = os.pidfd_open(self.grad_check)
        # Opened after grad-check ended, the number may be another process's already.
        if not alive(self.grad_check, self.grad_check_start):
            self.end()
        poller = None
        if handle is not None:
            poller = select.poll()
            poller.register(handle, select.POLLIN)
        while True:
            if poller is not None:
                gone = bool(poller.poll(WATCH_S * 1000))
            else:
                time.sleep(WATCH_S)
                gone = not alive(self.grad_check, self.grad_check_start)
            if gone:
                self.end()
            if self.progressing:
                self.write_progress()

    def end(self) -> None:
        """grad-check is gone: every other process of the split (a daemon the script
        started in a session of its own too: pids.py :func:`marked`), this process's group
        (its DataLoader workers, a launcher's own children), and this process."""
        for pid in marked(self.folder):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        group = os.getpgrp()
        if group != self.grad_check_group and group > 1:
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
        os._exit(GONE_EXIT)

    # ------------------------------------------------------------ a rank
    def check_world_size(self) -> None:
        """Under a launcher: it must have started the split's N ranks."""
        if not self.launched_by_command or self.world_size in (None, ""):
            return
        if int(self.world_size) != self.nproc:
            self.fail(f"{self.launcher_name} started {self.world_size} rank(s) "
                      f"(WORLD_SIZE={self.world_size}) at split {self.split}, which needs "
                      f"{self.nproc}; allowed: a launcher given {{nproc}} as its number of "
                      "processes (e.g. torchrun --nproc_per_node={nproc}, accelerate launch "
                      "--num_processes {nproc})", USAGE_EXIT)

    def watch_training(self) -> None:
        """The rank's progress, and its claim on its RANK when it joins the process group
        (torch is loaded by now: the capture loaded it)."""
        import torch.distributed
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.progressing = True
        register_module_forward_pre_hook(self._entering)
        register_module_forward_hook(self._leaving, always_call=True)
        register_optimizer_step_post_hook(self._stepped)
        if torch.distributed.is_available():
            import torch.distributed.distributed_c10d as c10d

            original = c10d.init_process_group

            def init_process_group(*args: Any, **kwargs: Any) -> Any:
                self.check_joining(joining(original, args, kwargs, "world_size"))
                self.claim(kwargs.get("rank", -1))
                return original(*args, **kwargs)

            init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
            c10d.init_process_group = init_process_group
            torch.distributed.init_process_group = init_process_group

    def check_joining(self, world_size: Any) -> None:
        """The process group this rank joins is the split's N ranks: a world size the
        script sets itself (``init_process_group(world_size=4)``) waits forever for ranks
        nobody starts, or leaves some out; said at once, naming the value."""
        told = os.environ.get("WORLD_SIZE")
        asked = told if world_size in (None, -1) else world_size
        with contextlib.suppress(TypeError, ValueError):
            if int(asked) != self.nproc:
                given = (f"world_size={world_size}" if world_size not in (None, -1)
                         else f"WORLD_SIZE={told} from its environment")
                self.fail(f"joined the process group with {given}, but "
                          f"split {self.split} runs {self.nproc} rank(s); allowed: the "
                          "launch's world size (init_process_group() without world_size, "
                          "or world_size=int(os.environ['WORLD_SIZE']))", 1)

    def _entering(self, _module, _args) -> None:
        self.depth += 1

    def _leaving(self, _module, _args, _result) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.forwards += 1

    def _stepped(self, _optimizer, _args, _kwargs) -> None:
        self.steps += 1

    def write_progress(self) -> None:
        """The rank's steps, forwards and wait into ``progress/rank<R>`` where they changed:
        the file's time is the rank's last progress, as far as the watch's period tells."""
        with self._writing:  # the watch's thread and a wait's start both write
            now = (self.steps, self.forwards, self.waiting)
            if now == self._written:
                return
            self._written = now
            with contextlib.suppress(OSError):
                (self.folder / PROGRESS).mkdir(exist_ok=True)
                write_atomically(self.folder / PROGRESS / f"rank{self.rank}",
                                 Progress(*now).to_json())

    @contextlib.contextmanager
    def waits_in_exchange(self, where: str) -> Iterator[None]:
        """The rank waits for the others inside grad-check's own exchange (a comparison's
        collective, the summaries at step S): said at once, so that a hang blames the rank
        that never arrived, not this one, which did."""
        self.waiting = where
        self.write_progress()
        try:
            yield
        finally:
            self.waiting = None

    def claim(self, rank: int) -> None:
        """This process joins the process group as ``rank`` (its RANK where not given):
        another live process that did already is named with it, and the split ends."""
        rank = self.rank if rank is None or int(rank) < 0 else int(rank)
        me = Claim(os.getpid(), process_start(os.getpid()), " ".join(sys.argv))
        claims = self.folder / CLAIMS
        with contextlib.suppress(OSError):
            claims.mkdir(exist_ok=True)
        path = claims / f"rank{rank}"
        for _ in range(2):
            with contextlib.suppress(OSError):
                if write_exclusively(path, me.to_json()):
                    return
            try:
                other = Claim.from_json(path.read_text())
            except (OSError, ValueError, TypeError):
                return  # nothing to name: let it join
            if other.pid == me.pid:
                return  # the same process again (after destroy_process_group)
            if alive(other.pid, other.start):
                self.fail(twice_line(rank, other, me, self.launched_by_command,
                                     self.launcher_name), 1)
            with contextlib.suppress(OSError):
                path.unlink()  # a claim its process left behind

    def fail(self, line: str, code: int) -> None:
        """End the split now: ``line`` for grad-check (``fatal``, and the rank's line),
        then this process."""
        from harness.errors import error_file

        with contextlib.suppress(OSError):
            write_exclusively(self.folder / FATAL, Fatal(self.rank, line, code).to_json())
            write_exclusively(error_file(self.folder, self.rank), line + "\n")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def joining(function: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of parameter ``name`` in a call of ``function`` (positional or keyword),
    None where not given or where the call does not bind."""
    import inspect

    with contextlib.suppress(TypeError, ValueError):
        return inspect.signature(function).bind_partial(*args, **kwargs).arguments.get(name)
    return None


def twice_line(rank: int, first: Claim, second: Claim, launched_by_command: bool,
               launcher_name: str) -> str:
    """Two live processes joining the process group as one rank, named."""
    what = (f"the command's processes join as the ranks {launcher_name} started; let only "
            "the workers it starts join" if launched_by_command else
            "the command starts workers of its own, which join as the ranks grad-check "
            "started; let it start them: --launcher command, with {nproc} passed to it")
    return (f"rank {rank} joined the process group twice, by {first.named} and "
            f"{second.named}: {what}")


def install(settings: RankSettings, environment: Mapping[str, str]) -> Guard:
    """This process's guard, started once (installed.py installs it)."""
    global INSTALLED
    if INSTALLED is None:
        INSTALLED = Guard(settings, environment)
        INSTALLED.start()
    return INSTALLED


def waiting_in_exchange(where: str) -> contextlib.AbstractContextManager[None]:
    """This rank's guard told that the rank waits in grad-check's exchange (nothing where
    no guard runs: the check's own tests, a process without a split)."""
    return INSTALLED.waits_in_exchange(where) if INSTALLED is not None \
        else contextlib.nullcontext()


#: The guard of this process, if any.
INSTALLED: Guard | None = None
