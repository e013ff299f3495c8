"""One run of the user's command on N ranks, each a real process with torchrun's variables.

N = 1 is the command as one plain process. For N > 1 the launcher hosts the rendezvous
store as ``torchrun --standalone`` would (harness/launcher.py: a TCPStore on loopback,
``TORCHELASTIC_USE_AGENT_STORE``), and gives rank r what torchrun's agent gives its
workers (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID, ...): plain
``init_process_group()``, Accelerate, Lightning, the Trainer and DeepSpeed all see a
distributed run on one node. Every process gets the capture's startup hook
(startup/sitecustomize.py) on its PYTHONPATH and the capture's folder.

Each rank runs in a session of its own (its DataLoader workers with it), writes its
output to ``rank<R>.log`` in the run's folder and, where Python raised, its one error
line to ``rank<R>.txt`` (harness/errors.py's convention, written by the capture). When
one rank fails the others are stopped, as torchrun does, and the run's failure is the
rank whose line came first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness.errors import USAGE_EXIT, error_file
from harness.grad_check.script import capture
from harness.grad_check.script.points import REFERENCE_VARIABLE
from harness.grad_check.script.splits import Split
from harness.launcher import rank_environment, rendezvous_store
from harness.ranks import SETTLE_S, STOP_GRACE_S, describe_exit, error_line

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
class Failure:
    """The rank that failed first (None: the run as a whole, stopped at the timeout), its
    exit code and its line."""

    rank: int | None
    exitcode: int | None
    line: str

    @property
    def refused(self) -> bool:
        """The command refused its input (exit code 2: an argparse error, the capture's
        refusal of a setup it cannot read)."""
        return self.exitcode == USAGE_EXIT

    def __str__(self) -> str:
        return self.line if self.rank is None else f"rank {self.rank}: {self.line}"


@dataclass(frozen=True)
class Run:
    """One run of the command at one split: where its capture is, how it ended."""

    split: Split
    command: tuple[str, ...]
    folder: Path
    seconds: float
    failure: Failure | None


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

    def run(self, split: Split, command: Sequence[str], folder: Path,
            against: Path | None = None) -> Run:
        """Run ``command`` on ``split.world_size`` ranks, its capture into ``folder``,
        compared with the reference's capture in ``against`` (None: this is the reference,
        its capture written: harness/grad_check/script/points.py)."""
        folder.mkdir(parents=True, exist_ok=True)
        n = split.world_size
        # The store lives as long as the run: the ranks meet through it.
        store = None
        if n > 1:
            store = rendezvous_store(n)
        run_id = uuid.uuid4().hex
        start = time.monotonic()
        processes: list[Process] = []
        try:
            for rank in range(n):
                environment = self.environment(rank, n, store.port if store else 0, folder,
                                               run_id)
                if self.capture and self.global_batch:
                    environment[capture.MICRO_BATCH_VARIABLE] = str(
                        split.micro_batch(self.global_batch))
                if self.capture and against is not None:
                    environment[REFERENCE_VARIABLE] = str(against)
                processes.append(self.starter(list(command), environment,
                                              folder / f"rank{rank}.log"))
            failure = self.watch(processes, folder, start + self.timeout)
        finally:
            stop(processes)
        return Run(split, tuple(command), folder, time.monotonic() - start, failure)

    def environment(self, rank: int, world_size: int, port: int, folder: Path,
                    run_id: str) -> dict[str, str]:
        inherited = {name: value for name, value in os.environ.items()
                     if name not in TORCHRUN_VARIABLES}
        if world_size > 1:
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
            inherited.update({capture.FOLDER_VARIABLE: str(folder),
                              capture.STEPS_VARIABLE: str(self.steps),
                              capture.KEEP_GOING_VARIABLE: "1" if self.keep_going else "0",
                              capture.TIMEOUT_VARIABLE: str(self.timeout)})
        if paths:
            inherited["PYTHONPATH"] = os.pathsep.join(paths)
        else:
            inherited.pop("PYTHONPATH", None)
        return inherited

    def watch(self, processes: list[Process], folder: Path, deadline: float) -> Failure | None:
        """Wait for every rank; the first failure (the others stopped), or None."""
        ended: dict[int, float] = {}
        settle_until = None
        while True:
            codes = [process.poll() for process in processes]
            for rank, code in enumerate(codes):
                if code is not None and rank not in ended:
                    ended[rank] = time.monotonic()
            if all(code is not None for code in codes):
                break
            failed = any(code not in (None, 0) for code in codes)
            if failed and settle_until is None:
                settle_until = time.monotonic() + SETTLE_S
            if (settle_until is not None and time.monotonic() > settle_until) or \
                    time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        codes = [process.poll() for process in processes]
        if all(code == 0 for code in codes):
            return None
        if all(code in (None, 0) for code in codes):  # nobody failed: the deadline passed
            return Failure(None, None, f"timed out after {self.timeout:g} s (--timeout), still "
                                    "running: a rank waits for another, for input, or trains "
                                    "longer than --steps needs")
        return first_failure(codes, ended, folder)


def first_failure(codes: list[int | None], ended: dict[int, float], folder: Path) -> Failure:
    """The failure that came first: the oldest error line, else the rank seen to end first
    with a code other than 0 (the others then failed for want of it)."""
    def failed_at(rank: int) -> tuple[int, float]:
        with contextlib.suppress(OSError):
            return (0, error_file(folder, rank).stat().st_mtime)
        return (1, ended.get(rank, float("inf")))

    candidates = [rank for rank, code in enumerate(codes)
                  if code not in (None, 0) or error_file(folder, rank).is_file()]
    rank = min(candidates, key=failed_at)
    return Failure(rank, codes[rank], error_line(folder, rank) or log_line(folder, rank,
                                                                             codes[rank]))


def log_line(folder: Path, rank: int, code: int | None) -> str:
    """A rank that wrote no error line: the last line of its output, where it exited by
    itself (an argparse error, a message before ``sys.exit``), else how it ended."""
    if code is not None and code > 0:
        with contextlib.suppress(OSError):
            lines = (folder / f"rank{rank}.log").read_text(errors="replace").splitlines()
            last = next((line.strip() for line in reversed(lines) if line.strip()), "")
            if last:
                return last
    return describe_exit(code) if code is not None else "stopped"


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


def _signal_session(process: Process, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, number)
