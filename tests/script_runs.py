"""``grad-check run`` inside pytest: the check in a forked child, its ranks forked from it.

A user's command runs as fresh interpreters (harness/grad_check/script/processes.py), each paying
seconds to import torch and its framework. Here the check runs in a child forked from
the test process that first imports the frameworks its commands use, and each rank whose
command is ``python script.py ...`` is forked from that child, becoming the script
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
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.grad_check.script import capture, guard
from harness.grad_check.script.processes import start_subprocess
from tests.launch import ForkedChild, exit_code_of

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "scripts"
#: The test's own scripts (tests/script_program.py).
PROGRAM = Path(__file__).resolve().parent / "script_program.py"
RUN_TIMEOUT_S = 300


def forked_python(command: list[str], environment: dict[str, str], log: Path):
    """The launcher's starter: ``python script ...`` forked from here, anything else
    started as the launcher starts it."""
    if Path(command[0]).name != Path(sys.executable).name or len(command) < 2:
        return start_subprocess(command, environment, log)
    pid = os.fork()
    if pid:
        return ForkedChild(pid, command)
    _become_the_script(command[1], command[2:], environment, log)


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
        capture.INSTALLED = None  # the parent's, if it had one, is not this rank's
        guard.INSTALLED = None
        guard.install_from_environment()
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
        if capture.INSTALLED is not None:
            capture.INSTALLED.write_summary()  # what atexit does in an interpreter
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
