"""Run code on several ranks inside pytest, without torchrun and without ports.

Ranks are forked from the test process (cheap: torch is already imported) and
meet through a ``FileStore`` in the test's own temporary folder, so tests that
run in parallel under pytest-xdist never collide. The test process keeps
torch single-threaded (see conftest.py), which is what makes forking safe.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from filelock import FileLock

from harness import errors

RANK_TIMEOUT_S = 120


@contextlib.contextmanager
def returning_within(seconds: float):
    """Raise TimeoutError inside where the code has not returned after ``seconds``: a test
    of a hang must not hang itself (SIGALRM: in the main thread only)."""
    def expire(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _as_forked_rank(rank: int, world_size: int, env: dict[str, str]) -> None:
    """The environment of a rank that torchrun would have started."""
    # No launcher here stops rank 0 when another rank exits, which is all that the
    # quiet ranks' delay on bad input guards against (torchrun's is tested for itself).
    errors.QUIET_RANK_EXIT_DELAY_S = 0.0
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple,
            env: dict[str, str], queue: Any) -> None:
    _as_forked_rank(rank, world_size, env)
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=RANK_TIMEOUT_S))
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 -- reported to the test, which fails with it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _before_forking(argv: list[str] | None = None) -> None:
    """Import here what every rank would import for itself: once, not once per rank.

    DDP imports ``torch._dynamo`` on first use (~2 s of CPU), and every rank of the
    command line loads the studies' registry (each study's module). For a command line
    ``argv``, also what the ranks of the studies it selects each import on first use:
    ``torch.distributed.optim`` for ``hooks``' ZeroRedundancyOptimizer (it compiles
    TorchScript as it loads). Done on the first launch that needs it rather than with
    this module, so that a run of quick tests never pays it.
    """
    import torch._dynamo  # noqa: F401

    from harness.studies import STUDIES

    if argv is not None and "hooks" in _selected_studies(argv, STUDIES):
        import torch.distributed.optim  # noqa: F401


def _selected_studies(argv: list[str], studies) -> list[str]:
    """The studies ``--studies`` names in ``argv`` (every study when it is absent)."""
    for flag, value in zip(argv, [*argv[1:], ""], strict=True):
        if flag == "--studies":
            return value.split(",")
        if flag.startswith("--studies="):
            return flag.split("=", 1)[1].split(",")
    return list(studies)


def run_ranks(world_size: int, fn: Callable, *args: Any, store_dir: Path,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; their results."""
    _before_forking()
    context = mp.get_context("fork")
    queue = context.Queue()
    # A fresh file per run: a store file left by an earlier run would hand these
    # ranks that run's addresses.
    store_path = str(store_dir / f"store-{uuid.uuid4().hex}")
    processes = [context.Process(target=_worker, daemon=True,
                                 args=(r, world_size, store_path, fn, args, env or {}, queue))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    failures = []
    try:
        for _ in processes:
            rank, ok, value = queue.get(timeout=RANK_TIMEOUT_S)
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
    finally:
        for process in processes:
            # A rank left waiting for a failed one would wait for its whole timeout.
            process.join(RANK_TIMEOUT_S if not failures else 5)
            if process.is_alive():
                process.kill()
                process.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def run_cli(world_size: int, argv: list[str], store_dir: Path,
            env: dict[str, str] | None = None, main: Callable[[list[str]], int] | None = None,
            output: Path | None = None) -> list[int]:
    """``scripts/study.py argv`` on ``world_size`` ranks; each rank's exit code.

    ``main``: another command's ``main`` (``harness.grad_check.cli.main``: ``scripts/check.py``).
    ``output``: a folder that gets the ranks' stdout and stderr, appended to files
    ``stdout`` and ``stderr`` as a launcher's console would show them.
    """
    if main is None:
        _before_forking(argv)
    return run_ranks(world_size, _cli, argv, main, output, store_dir=store_dir, env=env)


def _cli(rank: int, world_size: int, argv: list[str], main: Callable | None,
         output: Path | None) -> int:
    if main is None:
        from harness.grad_study import main
    if output is not None:
        sys.stdout.flush()
        _append_to(1, output / "stdout")
        _append_to(2, output / "stderr")
    return main(argv)


def run_cli_importing(modules: list[str], world_size: int, argv: list[str], store_dir: Path,
                      env: dict[str, str] | None = None, timeout_s: float = 600,
                      main: Callable[[list[str]], int] | None = None,
                      output: Path | None = None) -> list[int]:
    """:func:`run_cli` from a child that first imports ``modules`` (with ``env`` set);
    ``main`` and ``output`` as there.

    The ranks fork from that child: modules that take seconds to import (the
    training frameworks) are imported once instead of once per rank, and this
    process, which goes on to run other tests, imports none of them. The child stays
    for the next launch that imports the same modules with the same ``env`` (the
    training frameworks take ~4 s of CPU to import), until this process ends: each
    launch's ranks fork from it as they would from a fresh one, since the child itself
    runs nothing but the launches.
    """
    key = (tuple(modules), tuple(sorted((env or {}).items())))
    importer = _IMPORTERS.get(key)
    if importer is None or not importer.is_alive():
        importer = _IMPORTERS[key] = _Importer(list(modules), env or {})
    ok, value = importer.run((world_size, argv, store_dir, env or {}, main, output), timeout_s)
    if not ok:
        raise AssertionError(value)
    return value


class _Importer:
    """A child of this process that imports ``modules`` (with ``env`` set), then runs each
    launch it is sent (:func:`run_cli`: its ranks fork from the child).

    Forked with ``os.fork``, not as a ``multiprocessing`` child: it belongs to the tests'
    machinery, not to the code under test, which may check that it left no child behind
    (``multiprocessing.active_children()``); and multiprocessing would join it at exit.
    """

    def __init__(self, modules: list[str], env: dict[str, str]) -> None:
        self.connection, child_end = mp.get_context("fork").Pipe()
        if not _IMPORTERS:
            atexit.register(_stop_importers)
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                # Its copies of the ends this process holds: a child keeps running until
                # every copy of the other end of its pipe is closed.
                for end in [self.connection, *(i.connection for i in _IMPORTERS.values())]:
                    end.close()
                _import_then_run_clis(modules, env, child_end)
                code = 0
            finally:
                # Never back into pytest: this process is a copy of a test process.
                os._exit(code)
        child_end.close()
        self.returncode: int | None = None

    def is_alive(self) -> bool:
        if self.returncode is None and os.waitpid(self.pid, os.WNOHANG)[0]:
            self.returncode = -1
        return self.returncode is None

    def run(self, launch: tuple, timeout_s: float) -> tuple[bool, Any]:
        try:
            self.connection.send(launch)
            if self.connection.poll(timeout_s):
                return self.connection.recv()
        except (EOFError, OSError) as error:
            self.stop()
            return False, f"the child that imported the modules ended: {error!r}"
        self.stop()
        return False, f"no result from the launch after {timeout_s:g} s"

    def stop(self) -> None:
        """Close the pipe (the child then ends); kill the child if it has not within 5 s."""
        self.connection.close()
        deadline = time.monotonic() + 5
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.is_alive():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.returncode = -signal.SIGKILL


#: The children of :func:`run_cli_importing`, by modules and environment.
_IMPORTERS: dict[tuple, _Importer] = {}


def _stop_importers() -> None:
    for importer in _IMPORTERS.values():
        importer.connection.close()
    for importer in _IMPORTERS.values():
        if importer.is_alive():
            importer.stop()


def _import_then_run_clis(modules: list[str], env: dict[str, str], connection: Any) -> None:
    parent = os.getppid()
    try:
        os.environ.update(env)
        for module in modules:
            importlib.import_module(module)
        failed = None
    except BaseException:  # noqa: BLE001 -- reported to the test, which fails with it
        failed = traceback.format_exc()
    while True:
        try:
            # A process forked from the test process meanwhile holds a copy of its end:
            # its ending shows as a new parent.
            while not connection.poll(1.0):
                if os.getppid() != parent:
                    return
            world_size, argv, store_dir, env, main, output = connection.recv()
        except EOFError:  # the test process has closed its end
            return
        if failed is not None:
            connection.send((False, failed))
            continue
        try:
            connection.send((True, run_cli(world_size, argv, store_dir, env, main, output)))
        except BaseException:  # noqa: BLE001 -- reported to the test, which fails with it
            connection.send((False, traceback.format_exc()))


def _exiting_cli(rank: int, world_size: int, store_path: str, argv: list[str],
                 env: dict[str, str], stderr: Path | None) -> None:
    """A rank that behaves like a torchrun worker: ``main``'s result is its exit code."""
    if stderr is not None:
        _append_to(2, stderr)
    _as_forked_rank(rank, world_size, env)
    code = 1
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=RANK_TIMEOUT_S))
        from harness.grad_study import main

        code = main(argv)
    except BaseException:  # noqa: BLE001 -- a failing worker prints and exits non-zero
        traceback.print_exc()
    finally:
        os._exit(code)


def _append_to(fd: int, path: Path) -> None:
    """Send this process's stdout (``fd`` 1) or stderr (2), Python's and the C library's, to
    the end of ``path``."""
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(handle, fd)
    os.close(handle)
    # Lives as long as the rank.
    stream = open(fd, "w", buffering=1, closefd=False)  # noqa: SIM115
    if fd == 1:
        sys.stdout = stream
    else:
        sys.stderr = stream


def launch(world_size: int, argv: list[str], store_dir: Path, env: dict[str, str] | None = None,
           wait_s: float = 90, grace_s: float = 10,
           stderr: Path | None = None) -> list[int | None]:
    """Run the CLI on forked ranks that may fail, hang or die; each rank's exit code.

    Once one rank has exited, the others get ``grace_s`` to follow (as torchrun
    would stop them); a rank still running then is killed and reported as None.
    The ranks' stderr goes where the test's goes, or to the end of file ``stderr``.
    """
    _before_forking(argv)
    context = mp.get_context("fork")
    store_path = str(store_dir / f"store-{uuid.uuid4().hex}")
    processes = [context.Process(target=_exiting_cli, daemon=True,
                                 args=(r, world_size, store_path, argv, env or {}, stderr))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + wait_s
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        if any(not p.is_alive() for p in processes):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.05)
    codes: list[int | None] = []
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
            codes.append(None)
        else:
            codes.append(process.exitcode)
    return codes


def shared_folder(tmp_path_factory) -> Path:
    """A folder of this test session that every xdist worker sees.

    Each worker has a base temp folder of its own; their common parent belongs to
    this session alone. Without xdist, the base temp folder is the session's.
    """
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_cli_run(tmp_path_factory, name: str, world_size: int, argv: list[str]) -> Path:
    """The ``--out`` folder of ``scripts/study.py argv`` on ``world_size`` forked ranks,
    run once per test session: the first test (on any worker) to ask runs it, behind a
    lock; later ones read the same folder and must not change it."""
    shared = shared_folder(tmp_path_factory)
    out = shared / f"run-{name}"
    with FileLock(str(shared / f"run-{name}.lock")):
        if not (out / "run.json").exists():
            codes = run_cli(world_size, [*argv, "--out", str(out)], store_dir=shared)
            assert codes == [0] * world_size, f"the shared run {name!r} failed: {codes}"
    return out


#: ``reduction``, ``seed001`` and ``seed004`` as results/ ran them: the same 4 ranks, every
#: world size 1..4 and strategy. tests/test_reduction_study.py reads the first two against
#: first principles, tests/test_compare.py the last two against results/.
COMMITTED_LAYOUT_RUN = ("reduction-seed001-seed004", 4,
                        ["--studies", "reduction,seed001,seed004", "--quiet", "--no-report"])


def committed_layout_run(tmp_path_factory) -> Path:
    """The ``--out`` folder of :data:`COMMITTED_LAYOUT_RUN`, run once per test session."""
    return shared_cli_run(tmp_path_factory, *COMMITTED_LAYOUT_RUN)
