"""Launch scripts/study.py under a real torchrun, as a user would.

The command a user types (``python scripts/study.py ...``, ``python -m
torch.distributed.run ...``) runs in a process forked from the test process
rather than a fresh interpreter: the script, its flags, its output and its exit
code are the same, without paying ``import torch`` (seconds of CPU) for each
launcher. The ranks a launcher starts are what a user's get: fresh interpreters under
torchrun; under ``--nproc``, forks of a fork server that has imported torch and the
harness (one per test process here, rather than one per launcher).
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: How long a torchrun agent gets to stop its ranks after SIGTERM.
AGENT_STOP_S = 30


def _command(launcher_args: tuple[str, ...], nproc: int, args: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args,
            f"--nproc_per_node={nproc}", str(ROOT / "scripts" / "study.py"), *args]


def _environment(env: dict | None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}


class ForkedChild:
    """A child forked from this process, as a ``subprocess.Popen`` of it: ``args``, ``pid``,
    ``poll``, ``wait``, ``terminate``, ``kill`` and ``returncode``."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)


class ForkedPython(ForkedChild):
    """``python <argv>`` (a script, ``-m module`` or ``-c code``) in a child forked from this
    process; stdout and stderr go to the given files."""

    def __init__(self, command: list[str], env: dict[str, str], stdout: Path,
                 stderr: Path, cwd: Path = ROOT) -> None:
        _start_the_fork_server()
        pid = os.fork()
        if pid == 0:
            _run_python_here(command[1:], env, stdout, stderr, cwd)
        super().__init__(pid, command)


def _run_python_here(argv: list[str], env: dict[str, str], stdout: Path, stderr: Path,
                     cwd: Path) -> None:
    """In the forked child: become ``python argv``, then exit with its code (never returns)."""
    code = 1
    try:
        for fd, path in ((1, stdout), (2, stderr)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        # The test process's streams are pytest's captures; the child writes to its own files.
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # read from TMPDIR again, as a fresh interpreter does
        _use_the_parents_fork_server()
        os.chdir(cwd)
        sys.argv = list(argv[2:] if argv[0] in ("-m", "-c") else argv)
        if argv[0] == "-m":
            sys.argv.insert(0, argv[1])
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            _run_code_as_main(argv[1])
        else:
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as done:
        code = exit_code_of(done)
    except BaseException:  # noqa: BLE001 -- as the interpreter would: traceback, exit code 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip the test process's exit handlers (pytest's, xdist's): they belong to the parent.
        os._exit(code)


def _run_code_as_main(code: str) -> None:
    """``python -c code``: the code runs in a ``__main__`` of its own without a file (as a
    notebook's or stdin's does), which no other process can import."""
    sys.argv.insert(0, "-c")
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(code, "<string>", "exec"), main.__dict__)


def _start_the_fork_server() -> None:
    """This test process's fork server, started once, for every ``--nproc`` launcher forked
    from it: each would otherwise start one of its own, which imports torch afresh.

    The launcher gives each rank its own environment, working folder and streams
    (harness/ranks.py: ``Surroundings``), so a rank forked from this server is the rank
    the launcher's own server would have forked.
    """
    from multiprocessing import forkserver

    from harness.grad_check.api import PRELOADED as CHECK_API_PRELOADED
    from harness.launcher import PRELOADED
    from harness.ranks import DIES_WITH_LAUNCHER, fork_server_environment

    forkserver.set_forkserver_preload([DIES_WITH_LAUNCHER, *PRELOADED, *CHECK_API_PRELOADED])
    with fork_server_environment():  # as the launcher's own server starts (harness/ranks.py)
        forkserver.ensure_running()


def _use_the_parents_fork_server() -> None:
    """In the forked launcher: the server is the test process's child, not this one's
    (``ensure_running`` would wait for it); it runs as long as the test process does."""
    from multiprocessing import forkserver, resource_tracker

    forkserver._forkserver.ensure_running = resource_tracker.ensure_running


def exit_code_of(done: SystemExit) -> int:
    """What the interpreter makes of ``sys.exit(x)``: None is 0, a message is printed and 1."""
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)
    return 1


def run_python(command: list[str], timeout: float = 240, env: dict | None = None,
               cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``command`` (``[sys.executable, ...]``) run to completion as :class:`ForkedPython`,
    in ``cwd`` (the repository root); its exit code and output, as ``subprocess.run``
    gives them."""
    with tempfile.TemporaryDirectory() as logs:
        out, err = Path(logs) / "stdout", Path(logs) / "stderr"
        process = ForkedPython(command, _environment(env), out, err, cwd)
        try:
            process.wait(timeout)
        finally:
            process.kill()
        return subprocess.CompletedProcess(command, process.returncode, out.read_text(),
                                           err.read_text())


def torchrun(*args: str, nproc: int = 2, timeout: float = 240, env: dict | None = None,
             launcher_args: tuple[str, ...] = ("--standalone",)) -> subprocess.CompletedProcess:
    """``torchrun <launcher_args> --nproc_per_node=nproc scripts/study.py <args>``."""
    return run_python(_command(launcher_args, nproc, args), timeout, env)


def free_port() -> int:
    """A TCP port nobody holds right now (the kernel's pick; a launch binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def torchrun_nodes(*args: str, nnodes: int = 2, nproc: int = 2, timeout: float = 240,
                   env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """``nnodes`` torchrun agents on this machine, each as if on a node of its own.

    They meet as a multi-node launch does: ``--nnodes`` and a c10d rendezvous, here
    on localhost at a free port. Returns each agent's result, agent 0 first.
    """
    port = free_port()
    rendezvous = (f"--nnodes={nnodes}", "--rdzv_backend=c10d",
                  f"--rdzv_endpoint=localhost:{port}", f"--rdzv_id=test-{port}")
    # Agent 0 hosts the rendezvous store. Left to guess, every agent here would
    # see its own host in "localhost" and race to host it.
    hosts = ["--rdzv_conf=is_host=" + ("true" if node == 0 else "false")
             for node in range(nnodes)]
    with tempfile.TemporaryDirectory() as logs:
        agents = [_start_agent(_command((*rendezvous, host), nproc, args), env,
                               Path(logs) / f"agent{node}")
                  for node, host in enumerate(hosts)]
        _wait_all([process for process, _ in agents], timeout)
        return [subprocess.CompletedProcess(process.args, process.returncode,
                                            (log / "stdout").read_text(),
                                            (log / "stderr").read_text())
                for process, log in agents]


def _start_agent(command: list[str], env: dict | None,
                 log: Path) -> tuple[ForkedPython, Path]:
    # Output goes to files, not pipes: reading one agent's pipe while another's
    # fills up would deadlock.
    log.mkdir()
    return ForkedPython(command, _environment(env), log / "stdout", log / "stderr"), log


def _wait_all(processes: list[ForkedPython], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        _stop([process for process in processes if process.poll() is None])


def _stop(agents: list[ForkedPython]) -> None:
    # SIGTERM first: torchrun then stops its ranks (each in a session of its own,
    # out of reach of a signal to the agent's group) before it exits.
    for agent in agents:
        agent.terminate()
    for agent in agents:
        try:
            agent.wait(timeout=AGENT_STOP_S)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
