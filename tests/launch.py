"""Launch scripts/study.py under a real torchrun, as a user would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: How long a torchrun agent gets to stop its ranks after SIGTERM.
AGENT_STOP_S = 30


def _command(launcher_args: tuple[str, ...], nproc: int, args: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args,
            f"--nproc_per_node={nproc}", str(ROOT / "scripts" / "study.py"), *args]


def _environment(env: dict | None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}


def torchrun(*args: str, nproc: int = 2, timeout: float = 240, env: dict | None = None,
             launcher_args: tuple[str, ...] = ("--standalone",)) -> subprocess.CompletedProcess:
    """``torchrun <launcher_args> --nproc_per_node=nproc scripts/study.py <args>``."""
    return subprocess.run(_command(launcher_args, nproc, args), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=_environment(env))


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
                 log: Path) -> tuple[subprocess.Popen, Path]:
    # Output goes to files, not pipes: reading one agent's pipe while another's
    # fills up would deadlock.
    log.mkdir()
    with open(log / "stdout", "w") as stdout, open(log / "stderr", "w") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, cwd=ROOT,
                                   env=_environment(env))
    return process, log


def _wait_all(processes: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        _stop([process for process in processes if process.poll() is None])


def _stop(agents: list[subprocess.Popen]) -> None:
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
