"""``grad-check run`` inside pytest: the check in a forked child, its ranks forked from it.

A user's command runs as fresh interpreters (harness/grad_check/script/processes.py), each paying
seconds to import torch and its framework. Here the check runs in a child forked from
the test process that first imports the frameworks its commands use, and each rank whose
command is ``python script.py ...`` is forked, from a process that child forked before
grad-check hosts its rendezvous store (:class:`RankForker`), becoming the script
as an interpreter would: the same environment (torchrun's variables, the capture's),
stdout and stderr into the rank's log, the guard and the capture installed as the
startup hook installs them (startup/sitecustomize.py), the script (or ``-m module``: a
launcher such as torchrun, whose workers are then fresh interpreters) run as
``__main__``, an uncaught exception through ``sys.excepthook``, the capture's summary
written as at exit. A command of another program starts as the user's would. The tests
whose subject is the interpreter's own start (the startup hook) run commands for real.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import pickle
import runpy
import select
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.grad_check.script import guard, installed
from harness.grad_check.script.processes import start_subprocess
from tests.launch import ForkedChild, exit_code_of

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "scripts"
#: The test's own scripts (tests/script_program.py).
PROGRAM = Path(__file__).resolve().parent / "script_program.py"
RUN_TIMEOUT_S = 300


def forked_python(command: list[str], environment: dict[str, str], log: Path):
    """The launcher's starter: ``python script ...`` forked (by this process's
    :class:`RankForker`), anything else started as the launcher starts it."""
    if Path(command[0]).name != Path(sys.executable).name or len(command) < 2:
        return start_subprocess(command, environment, log)
    return rank_forker().start(command, environment, log)


_FORKERS: dict[int, RankForker] = {}


def rank_forker() -> RankForker:
    """This process's rank forker, made before grad-check starts, or at its first rank
    (the reference's run, which hosts no store at N = 1)."""
    if os.getpid() not in _FORKERS:
        _FORKERS[os.getpid()] = RankForker()
    return _FORKERS[os.getpid()]


class RankForker:
    """A process forked from the check's before grad-check hosts a store, that forks every
    rank.

    grad-check hosts the ranks' rendezvous store, whose server runs in a thread of its own
    (``pt_tcpstore_uv``). A rank forked from grad-check's process while that thread held a
    lock inherits the lock held by no one: every rank of a split hung before its first
    forward pass, now and then (4x2 of the four-ranks test, in 2 of 5 runs of the whole
    suite on 2 cores). This process holds what the check's had imported by then, hosts no
    store and starts no thread: it forks each rank on request, reaps it and reports its
    exit code."""

    def __init__(self) -> None:
        serving = [name for name in thread_names() if name.startswith("pt_tcpstore")]
        assert not serving, f"a rank forker must start before a store serves: {serving}"
        request_read, self._requests = os.pipe()
        self._replies, reply_write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._requests)
            os.close(self._replies)
            _fork_on_request(request_read, reply_write)
        os.close(request_read)
        os.close(reply_write)
        self._unread = b""
        self._started: list[int] = []
        self.exits: dict[int, int] = {}

    def start(self, command: list[str], environment: dict[str, str], log: Path) -> ForkedRank:
        message = pickle.dumps((command, environment, str(log)))
        _write_all(self._requests, len(message).to_bytes(8, "big") + message)
        while not self._started:
            self._read(block=True)
        return ForkedRank(self, self._started.pop(0), command)

    def exit_code(self, pid: int) -> int | None:
        self._read(block=False)
        return self.exits.get(pid)

    def _read(self, block: bool) -> None:
        if not select.select([self._replies], [], [], None if block else 0)[0]:
            return
        chunk = os.read(self._replies, 1 << 16)
        if not chunk:
            raise RuntimeError("the rank forker ended")
        *lines, self._unread = (self._unread + chunk).split(b"\n")
        for line in lines:
            what, pid, *code = line.decode().split()
            if what == "started":
                self._started.append(int(pid))
            else:
                self.exits[int(pid)] = int(code[0])


def thread_names() -> list[str]:
    return [Path(f"/proc/self/task/{task}/comm").read_text().strip()
            for task in os.listdir("/proc/self/task")]


class ForkedRank(ForkedChild):
    """A rank forked by a :class:`RankForker`: its exit code as the forker reaped it."""

    def __init__(self, forker: RankForker, pid: int, args: list[str]) -> None:
        super().__init__(pid, args)
        self._forker = forker

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._forker.exit_code(self.pid)
        return self.returncode


def _fork_on_request(requests: int, replies: int) -> None:
    """The forker's loop: fork each rank asked for, report it and its exit; end with the
    check's process (its end of the pipe closed). Never returns."""
    children: set[int] = set()
    unread = b""
    try:
        while True:
            if select.select([requests], [], [], 0.02)[0]:
                chunk = os.read(requests, 1 << 16)
                if not chunk:
                    break
                unread += chunk
                while len(unread) >= 8 and len(unread) >= 8 + (
                        size := int.from_bytes(unread[:8], "big")):
                    command, environment, log = pickle.loads(unread[8:8 + size])
                    unread = unread[8 + size:]
                    pid = os.fork()
                    if pid == 0:
                        os.close(requests)
                        os.close(replies)
                        _become_the_script(command[1], command[2:], environment, Path(log))
                    children.add(pid)
                    _write_all(replies, f"started {pid}\n".encode())
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    code = os.waitstatus_to_exitcode(status)
                    _write_all(replies, f"exited {pid} {code}\n".encode())
    except BaseException:  # noqa: BLE001 -- a signal or the check gone: nothing to report to
        pass
    os._exit(0)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _become_the_script(script: str, args: list[str], environment: dict[str, str],
                       log: Path) -> None:
    """In the forked rank: run ``script args`` as the interpreter would; never returns."""
    code = 1
    try:
        os.setsid()  # a session of its own, as start_new_session gives the launcher's ranks
        handle = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd in (1, 2):
            os.dup2(handle, fd)
        os.close(handle)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(environment)
        import torch

        # OpenMP read its variable when this process's parent loaded torch.
        torch.set_num_threads(int(environment.get("OMP_NUM_THREADS", "1")))
        installed.CAPTURE = None  # the parent's, if it had one, is not this rank's
        guard.INSTALLED = None
        installed.install_from_environment()
        if script == "-m":
            sys.argv = [args[0], *args[1:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path[0] = str(Path(script).resolve().parent)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = exit_code_of(done)
    except BaseException:  # noqa: BLE001 -- as the interpreter: the hook, exit code 1
        sys.excepthook(*sys.exc_info())
    finally:
        if installed.CAPTURE is not None:
            installed.CAPTURE.write_summary()  # what atexit does in an interpreter
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


@dataclass(frozen=True)
class CheckRun:
    """What ``grad-check run`` gave: its exit code, its console, its rows (None: no CSV)."""

    code: int
    stdout: str
    stderr: str
    rows: pd.DataFrame | None

    def row(self, split: str, step: int = 0, point: str = "grad") -> pd.Series:
        rows = self.rows
        found = rows[(rows["split"] == split) & (rows["step"] == step) & (rows["point"] == point)]
        assert len(found) == 1, f"no single row {split} step {step} {point}:\n{rows}"
        return found.iloc[0]


def run_checks(calls: list[tuple[list[str], Path]], modules: tuple[str, ...] = (),
               fresh: bool = False) -> list[CheckRun]:
    """``check.py run argv --out out`` for each ``(argv, out)``, one after the other in one
    child that first imports ``modules`` (a framework: once for all the calls); each
    ``argv`` is ``[options..., "--", command...]``. ``fresh``: the ranks are started as
    the user's are, fresh interpreters loading the capture through the startup hook."""
    import torch._dynamo  # noqa: F401 -- what DDP imports on first use: once, not per rank

    argvs = []
    for argv, out in calls:
        cut = argv.index("--") if "--" in argv else len(argv)
        argvs.append([*argv[:cut], "--out", str(out), *argv[cut:]])
        console(out).mkdir(parents=True, exist_ok=True)
    child = mp.get_context("fork").Process(
        target=_checks_in_child,
        args=(argvs, [console(out) for _, out in calls], modules,
              start_subprocess if fresh else forked_python))
    child.start()
    child.join(RUN_TIMEOUT_S * len(calls))
    if child.is_alive():
        child.kill()
        child.join()
        raise AssertionError(f"check.py run {argvs} did not end in time")
    assert child.exitcode == 0, f"the checks' child failed: {child.exitcode}"
    return [done_of(out) for _, out in calls]


def run_check(argv: list[str], out: Path, modules: tuple[str, ...] = (),
              fresh: bool = False) -> CheckRun:
    return run_checks([(argv, out)], modules, fresh)[0]


def console(out: Path) -> Path:
    return out.parent / f"{out.name}-console"


def done_of(out: Path) -> CheckRun:
    logs, csv = console(out), out / "script.csv"
    return CheckRun(int((logs / "code").read_text()), (logs / "stdout").read_text(),
                    (logs / "stderr").read_text(), pd.read_csv(csv) if csv.exists() else None)


def _checks_in_child(argvs: list[list[str]], logs: list[Path], modules: tuple[str, ...],
                     starter) -> None:
    failed = False
    try:
        for module in modules:
            importlib.import_module(module)
        from harness.grad_check.script.grad_check_run import main

        if starter is forked_python:
            rank_forker()  # now, before grad-check hosts a store
        for argv, folder in zip(argvs, logs, strict=True):
            code = _check_with_console(main, argv, folder, starter)
            (folder / "code").write_text(str(code))
    except BaseException:  # noqa: BLE001 -- the test fails with the traceback
        traceback.print_exc()
        failed = True
    finally:
        os._exit(1 if failed else 0)


def _check_with_console(main, argv: list[str], folder: Path, starter) -> int:
    """``main(argv)`` with this process's stdout and stderr in ``folder``."""
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            handle = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(handle, fd)
            os.close(handle)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        try:
            return main(argv, starter=starter)
        except BaseException:  # noqa: BLE001 -- in the console the test reads
            traceback.print_exc()
            return -1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def python(script: Path, *args: str) -> list[str]:
    """``python script args`` as a user would write it, with this interpreter."""
    return [sys.executable, str(script), *args]
