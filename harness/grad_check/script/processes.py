"""One run of the user's command at one split: N ranks with torchrun's variables, or the
command's own launcher once.

Where grad-check starts the ranks (the default for a plain command), N = 1 is the command
as one plain process (``--torchrun-env``: with torchrun's variables too, RANK=0,
WORLD_SIZE=1), and for N > 1 the launcher hosts the rendezvous store as ``torchrun
--standalone`` would (harness/launcher.py: a TCPStore on loopback,
``TORCHELASTIC_USE_AGENT_STORE``), and gives rank r what torchrun's agent gives its
workers (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID, ...): plain
``init_process_group()``, Accelerate, Lightning, the Trainer and DeepSpeed all see a
distributed run on one node. Where the command starts its ranks itself (a launcher at its
head: harness/grad_check/script/launchers.py) it runs once, without torchrun's
variables. Every process gets the startup hook (startup/sitecustomize.py) on its
PYTHONPATH, the split's folder, and what its guard needs (guard.py): grad-check's pid
to watch, N, the split.

Each process grad-check starts runs in a session of its own (its DataLoader workers with
it) and writes its output to ``rank<R>.log`` (``launcher.log``) in the run's log folder;
where Python raised, the capture writes the rank's one line, with the failing file:line,
to ``rank<R>.txt`` (harness/errors.py's convention). When one rank fails the others are
stopped, as torchrun does, and the run's failure is the rank that failed first for a
reason of its own (failures.py); a run past ``--timeout`` names the rank that made no
progress. After the run every process that registered itself in the split's folder and
still runs is killed (a launcher's workers, in sessions of their own, outlive their
launcher's SIGKILL), and every process of the split watches grad-check itself, so that
none outlives it however it ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from harness.grad_check.script.failures import (
    SplitFailure,
    fatal,
    first_failure,
    hang,
    launched_failure,
    left_early,
    missing_ranks,
)
from harness.grad_check.script.pids import alive, grad_check_process, marked
from harness.grad_check.script.splits import Split
from harness.grad_check.script.wire import (
    PROCESSES,
    SETTINGS_VARIABLES,
    ProcessEntry,
    RankSettings,
)
from harness.launcher import rank_environment, rendezvous_store
from harness.ranks import SETTLE_S, STOP_GRACE_S

__all__ = ["STARTUP", "CommandLauncher", "SplitFailure", "SplitRun", "first_failure",
           "start_subprocess"]

#: The startup hook's folder: first on every rank's PYTHONPATH.
STARTUP = Path(__file__).resolve().parent / "startup"
#: What torchrun's agent sets for its workers (torch/distributed/elastic/agent): removed
#: from what a run inherits, so that N = 1 is a plain process even when this one runs
#: under a launcher, and set anew for N > 1.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
                      "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
#: Seconds between looks at the running ranks.
POLL_S = 0.02
#: The log of the command's own launcher, where it starts the ranks itself.
LAUNCHER_LOG = "launcher.log"


class Process(Protocol):
    """What the launcher needs of a started rank (a ``subprocess.Popen`` has it): its
    ``pid``, also its process group's id (it leads a session of its own), and ``poll``."""

    pid: int

    def poll(self) -> int | None: ...


#: Starts one rank: (command, environment, log file) -> the running process.
Starter = Callable[[list[str], dict[str, str], Path], Process]


def start_subprocess(command: list[str], environment: dict[str, str], log: Path) -> Process:
    """The rank as a fresh process: a session of its own (stopping it stops its children,
    and Ctrl-C at the terminal reaches the launcher alone), stdout and stderr to ``log``."""
    with log.open("wb") as output:
        return subprocess.Popen(command, env=environment, stdout=output,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


@dataclass(frozen=True)
class SplitRun:
    """One run of the command at one split: where its capture is, how it ended."""

    split: Split
    command: tuple[str, ...]
    folder: Path
    seconds: float
    failure: SplitFailure | None
    #: Where its processes' output is (``rank<R>.log``, ``launcher.log``).
    logs: Path | None = None


@dataclass(frozen=True)
class CommandLauncher:
    """How every run of one ``grad-check run`` is started."""

    steps: int
    keep_going: bool
    timeout: float
    starter: Starter = start_subprocess
    #: False: the command alone, without the capture (the benchmark's bare runs).
    capture: bool = True
    #: G, so that each rank's capture knows the split's micro-batch (its samples' axis).
    global_batch: int | None = None
    #: The launcher at the command's head, which starts the split's ranks itself (its
    #: name, e.g. ``torchrun``); None: grad-check starts them.
    launcher: str | None = None
    #: N = 1 gets torchrun's variables too (RANK=0, WORLD_SIZE=1, a store to meet at).
    torchrun_env: bool = False

    def run_split(self, split: Split, command: Sequence[str], folder: Path,
            logs: Path | None = None, variables: dict[str, str] | None = None,
            against: Path | None = None) -> SplitRun:
        """Run ``command`` at ``split``, its capture into ``folder``, its output into
        ``logs`` (default: ``folder``); ``variables``: what its processes get besides
        (launchers.adapted's); ``against``: the reference's capture it is compared with
        (None: this is the reference, its capture written: points.py)."""
        folder.mkdir(parents=True, exist_ok=True)
        # b: each capture cuts samples along its axis; against: what each rank compares
        # its shards with.
        micro_batch = split.micro_batch(self.global_batch) if self.global_batch else None
        settings = self.settings(folder, split.world_size, split.label, micro_batch, against)
        logs = logs or folder
        logs.mkdir(parents=True, exist_ok=True)
        n = split.world_size
        # The store lives as long as the run: the ranks meet through it.
        store = None
        if self.launcher is None and (n > 1 or self.torchrun_env):
            store = rendezvous_store(n)
        run_id = uuid.uuid4().hex
        start, started_at = time.monotonic(), time.time()
        processes: list[Process] = []
        failure = None
        try:
            if self.launcher is not None:
                processes.append(self.starter(
                    list(command), self.environment(None, n, 0, folder, run_id, split.label,
                                                    variables, settings), logs / LAUNCHER_LOG))
            for rank in range(n if self.launcher is None else 0):
                environment = self.environment(rank, n, store.port if store else 0, folder,
                                               run_id, split.label, variables, settings)
                processes.append(self.starter(list(command), environment,
                                              logs / f"rank{rank}.log"))
            failure = self.watch(processes, folder, logs, n, start + self.timeout, started_at)
        finally:
            stop(processes)
            if self.capture:
                sweep(folder)
        if failure is None and self.launcher is not None and self.capture:
            failure = missing_ranks(folder, n, self.launcher, split.label)
        if failure is not None and n == 1 and self.launcher is None and not self.torchrun_env:
            failure = needs_torchrun_hint(failure)
        return SplitRun(split, tuple(command), folder, time.monotonic() - start, failure, logs)

    def environment(self, rank: int | None, world_size: int, port: int, folder: Path,
                    run_id: str, split: str = "",
                    variables: dict[str, str] | None = None,
                    settings: RankSettings | None = None) -> dict[str, str]:
        """What process ``rank`` gets (None: the command's own launcher, which gets no
        torchrun variables: it gives its workers theirs); ``settings``: what the split's
        processes are told (default: the split's without b or a reference)."""
        inherited = {name: value for name, value in os.environ.items()
                     if name not in TORCHRUN_VARIABLES and name not in SETTINGS_VARIABLES}
        if self.capture:
            told = settings or self.settings(folder, world_size, split)
            inherited.update(told.environment())
        inherited.update(variables or {})
        if rank is not None and (world_size > 1 or self.torchrun_env):
            inherited.update(rank_environment(str(folder), world_size, port))
            inherited.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                "ROLE_RANK": str(rank), "ROLE_NAME": "default",
                "ROLE_WORLD_SIZE": str(world_size), "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")})
        # The user's own path as they gave it: the harness's packages (examples, tests)
        # must not shadow theirs, so only the startup hook's folder is added.
        paths = [part for part in os.environ.get("PYTHONPATH", "").split(os.pathsep) if part]
        if self.capture:
            paths.insert(0, str(STARTUP))
        if paths:
            inherited["PYTHONPATH"] = os.pathsep.join(paths)
        else:
            inherited.pop("PYTHONPATH", None)
        return inherited

    def settings(self, folder: Path, world_size: int, split: str,
                 micro_batch: int | None = None, against: Path | None = None) -> RankSettings:
        """What every process of the split is told (wire.py)."""
        pid, pid_start, pgid = grad_check_process()
        return RankSettings(folder, self.steps, self.keep_going, self.timeout, pid, pid_start,
                            pgid, world_size, split, micro_batch, against, self.launcher)

    def watch(self, processes: list[Process], folder: Path, logs: Path, nproc: int,
              deadline: float, started_at: float) -> SplitFailure | None:
        """Wait for every process; the first failure (the others then stopped), or None."""
        ended: dict[int, float] = {}
        settle_until = None
        while True:
            codes = [process.poll() for process in processes]
            for rank, code in enumerate(codes):
                if code is not None and rank not in ended:
                    ended[rank] = time.time()
            if (found := fatal(folder)) is not None:
                return found
            if all(code is not None for code in codes):
                break
            # A rank that ended with 0 before its steps were captured has left the others
            # waiting for it (to join, or in a collective): a failure, settled alike.
            failed = any(code not in (None, 0) for code in codes) or (
                self.launcher is None and bool(left_early(codes, folder)))
            if failed and settle_until is None:
                settle_until = time.monotonic() + SETTLE_S
            if (settle_until is not None and time.monotonic() > settle_until) or \
                    time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        codes = [process.poll() for process in processes]
        if (found := fatal(folder)) is not None:
            return found
        if all(code == 0 for code in codes):
            return None
        if all(code in (None, 0) for code in codes) and (  # nobody failed: the deadline
                self.launcher is not None or not left_early(codes, folder)):
            return hang(folder, nproc, self.timeout, started_at)
        if self.launcher is not None:
            return launched_failure(folder, logs / LAUNCHER_LOG, nproc, codes[0],
                                    self.launcher)
        return first_failure(codes, ended, folder, logs)


#: How a process says it needs torchrun's variables: init_process_group's env:// ("environment
#: variable RANK expected, but not set"), a script's own os.environ["RANK"], DeepSpeed's
#: init_distributed, which without them looks for MPI instead (the Trainer's --deepspeed).
_NEEDS_TORCHRUN = re.compile(r"environment variable (RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT|"
                             r"LOCAL_RANK) expected|KeyError: '(RANK|WORLD_SIZE|LOCAL_RANK|"
                             r"LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT)'|"
                             r"No module named 'mpi4py'")


def needs_torchrun_hint(failure: SplitFailure) -> SplitFailure:
    """A plain process at N = 1 that wanted torchrun's variables: the flag that gives them."""
    if not _NEEDS_TORCHRUN.search(failure.line):
        return failure
    return replace(failure, line=f"{failure.line}; N = 1 runs one plain process: "
                                 "--torchrun-env gives it torchrun's variables")


def stop(processes: Sequence[Process]) -> None:
    """Every rank's session ended (its leftover children with it): SIGTERM, then SIGKILL
    after a grace period for those still running."""
    for process in processes:
        _signal_session(process, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for process in processes:
        _signal_session(process, signal.SIGKILL)
        while process.poll() is None:
            time.sleep(POLL_S)


def sweep(folder: Path) -> None:
    """Every process of the run that still runs, killed: those that registered themselves
    in ``folder`` (guard.py), with the process group each leads (what a launcher's SIGKILL
    left of its workers, in sessions of their own), then any other process whose
    environment names ``folder`` as its split's (:func:`marked`: a daemon the script
    started with ``setsid``, which is no Python process and in no group grad-check
    knows)."""
    _sweep_registered(folder)
    for pid in marked(folder):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _sweep_registered(folder: Path) -> None:
    for path in sorted((folder / PROCESSES).glob("[0-9]*")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            entry = ProcessEntry.from_json(path.read_text())
            pid, group = entry.pid, entry.pgid
            if pid == os.getpid() or not alive(pid, entry.start):
                continue
            if group == pid and group != os.getpgrp():
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _signal_session(process: Process, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, number)
