"""The check from Python, for a regression test in your own CI.

    from harness.grad_check import assert_matches

    def test_my_step_equals_the_big_batch_step():
        assert_matches("my_pkg.my_module:make_setup", world_sizes=(1, 2), accum_steps=(1, 4))

:func:`check` returns the rows of ``check.csv`` as a DataFrame; :func:`assert_matches`
raises ``AssertionError`` with the console table of the rows that do not match.

``setup`` is what the ranks build the setup from, so it must reach processes of their
own: ``"module.path:function"`` (imported as ``grad-check`` imports it), a function
returning a :class:`Setup`, or a :class:`Setup`; functions a rank cannot import (those
of a notebook or ``python -c``, lambdas, nested functions) are sent by value
(harness/grad_check/sending.py). ``local`` runs in the calling process, on no process group
(one the caller has is left alone); ``ddp`` and ``fsdp`` start ``max(world_sizes)`` ranks
themselves, which meet through a file in a temporary folder (gloo on CPU, nccl where
every rank has a GPU), and are stopped as soon as one of them fails. The ranks are
forked from a server process started at the first such call, and each imports the
script that called it as ``multiprocessing`` does: a script (not a test) calling
:func:`check` with ``ddp`` or ``fsdp`` keeps its top-level code under ``if __name__ ==
"__main__":`` (refused otherwise, before anything runs).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from harness.check.load import check_batches, check_model, check_scheduler, load_setup
from harness.check.setup import Setup
from harness.check.step import check_step_device
from harness.check.table import render
from harness.errors import USAGE_EXIT, UsageError, error_file
from harness.grad_check.check_config import CHECK_STRATEGIES, CheckConfig
from harness.grad_check.matrix import CheckRun
from harness.grad_check.schema import CELLS, COLUMN_NAMES
from harness.grad_check.sending import received, refuse_unguarded_caller, sent
from harness.placement import Launch, choose_placement
from harness.ranks import Failure, describe_exit, describe_hang, run_ranks
from harness.strategies import STRATEGIES
from harness.verdicts import Equivalence, Status

#: What ``setup`` may be: see the module's docstring.
SetupSource = str | Callable[[], Setup] | Setup
#: Modules the rank server imports once, before the first ranks are forked from it: every
#: later launch starts ranks that have them already (torch's DDP imports torch._dynamo on
#: first use, seconds on a small machine).
PRELOADED = ["harness.grad_check.api", "torch._dynamo"]
ROWS_FILE = "rows.pkl"
#: Marks a rank's error line as bad input rather than a failure of the rank.
BAD_INPUT = "bad input: "


def check(setup: SetupSource, *, world_sizes: Sequence[int] = (1, 2),
          accum_steps: Sequence[int] = (1, 2),
          strategies: Sequence[str] = tuple(CHECK_STRATEGIES), dtype: str = "float64",
          drop_last: bool = False, timeout: float = 300.0) -> pd.DataFrame:
    """Every strategy x world size x micro-steps against the big-batch step: the rows
    ``grad-check`` writes to check.csv, same columns, same order.

    Bad input raises :class:`harness.errors.UsageError` (a ValueError) before anything
    runs; a rank that fails raises RuntimeError naming the rank and its error.
    """
    started_in = os.getcwd()  # where the ranks start, whatever folder a factory moves to
    config = CheckConfig(targets=(_target(setup),), accum_steps=tuple(accum_steps),
                         strategies=tuple(strategies), world_sizes=tuple(world_sizes),
                         dtype=dtype, drop_last=drop_last, quiet=True, timeout=timeout)
    sizes = config.resolved_world_sizes(max(config.world_sizes))
    launched = [s for s in config.strategies if STRATEGIES[s].collective]
    in_process = tuple(s for s in config.strategies if not STRATEGIES[s].collective)
    if launched:  # before the user's code runs here, as it would again in every rank
        refuse_unguarded_caller(",".join(launched))
    target, resolved = resolve(setup)
    check_batches(resolved, target, [(n, k) for n in sizes for k in config.accum_steps],
                  drop_last)
    model = resolved.make_model()
    check_model(model, target)
    check_scheduler(resolved, [p for p in model.parameters() if p.requires_grad], target)
    check_step_device(resolved, target,
                      choose_placement("auto", "auto", Launch.planned(max(sizes))).device)
    # Sendable or refused before the local cases spend their time.
    data = sent(setup, target) if launched else b""
    rows = []
    if in_process:
        rows += _in_this_process(replace(config, strategies=in_process), target, resolved,
                                 sizes)
    if launched:
        rows += _on_ranks(data, replace(config, strategies=tuple(launched)), sizes,
                          started_in)
    order = {strategy: i for i, strategy in enumerate(config.strategies)}
    rows.sort(key=lambda row: order[row["strategy"]])  # stable: each part is in order
    return pd.DataFrame(rows, columns=list(COLUMN_NAMES))


def assert_matches(setup: SetupSource, **options: Any) -> pd.DataFrame:
    """:func:`check`, raising ``AssertionError`` unless every row matches the big-batch
    step (skipped rows aside); the message is the console table of the other rows."""
    rows = check(setup, **options)
    failing = rows[(rows["verdict"] != Equivalence.MATCHES)
                   & ~rows["status"].str.startswith(Status.SKIPPED)]
    if len(failing):
        name = rows["setup"].iloc[0]
        table = render(failing.to_dict("records"), int(rows["step"].max()) + 1, CELLS)
        raise AssertionError(f"{name}: {len(failing)} of {len(rows)} rows do not match the "
                             f"big-batch step:\n{table}")
    return rows


# ------------------------------------------------------------------ the setup
def _target(source: SetupSource) -> str:
    """How rows and messages name ``source``: ``module:function``."""
    if isinstance(source, str):
        return source
    named = source.make_model if isinstance(source, Setup) else source
    module = getattr(named, "__module__", None) or "?"
    return f"{module}:{getattr(named, '__qualname__', type(named).__name__)}"


def resolve(source: SetupSource) -> tuple[str, Setup]:
    """The Setup behind ``source``, named (after its factory) if unnamed."""
    target = _target(source)
    if isinstance(source, str):
        return target, load_setup(source)
    if isinstance(source, Setup):
        return target, source if source.name else replace(source, name=target.split(":")[1])
    if not callable(source):
        raise UsageError(f"setup {source!r} is a {type(source).__name__}; allowed: "
                         "'module.path:function', a function returning a harness.check.Setup, "
                         "or a Setup")
    try:
        made = source()
    except Exception as error:  # noqa: BLE001 -- the user's factory failing is bad input
        raise UsageError(f"{target}: calling it failed: {type(error).__name__}: {error}"
                         ) from None
    if not isinstance(made, Setup):
        raise UsageError(f"{target} returned a {type(made).__name__}; allowed: a function "
                         "returning a harness.check.Setup")
    return target, made if made.name else replace(made, name=target.split(":")[1])


# ------------------------------------------------------------------ running
class RowsRun(CheckRun):
    """The matrix of one setup, its rows handed back instead of written to check.csv."""

    def __init__(self, config: CheckConfig, target: str, setup: Setup, launch: Launch,
                 world_sizes: tuple[int, ...], process_group: bool) -> None:
        super().__init__(config, [(target, setup)], launch,
                         choose_placement("auto", "auto", launch), world_sizes)
        self.process_group = process_group

    def init_distributed(self) -> dict:
        # `local` communicates nothing: it runs on no process group at all.
        return super().init_distributed() if self.process_group else {}


def _single_launch() -> Launch:
    return Launch(rank=0, world_size=1, local_rank=0, local_world_size=1,
                  hostname=socket.gethostname(), slurm_job_id="")


def _in_this_process(config: CheckConfig, target: str, setup: Setup,
                     sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    return RowsRun(config, target, setup, _single_launch(), sizes,
                   process_group=False).measured_rows()


def _on_ranks(data: bytes, config: CheckConfig, sizes: tuple[int, ...],
              started_in: str) -> list[dict[str, Any]]:
    """Start max(sizes) ranks in ``started_in`` on the setup ``data`` (:func:`sent`), wait
    for all of them, and return rank 0's rows."""
    nproc = max(sizes)
    # Forked from a server process that holds nothing of the caller's (no CUDA context,
    # no process group, no OpenMP threads), which a plain fork of the caller could hold.
    with tempfile.TemporaryDirectory(prefix="grad-check-") as folder:
        failure = run_ranks(nproc, _rank_main,
                            lambda rank: (rank, nproc, folder, data, config, sizes),
                            Path(folder), PRELOADED, config.timeout, started_in)
        if failure is not None:
            raise _failure(failure, Path(folder), config.timeout)
        with open(Path(folder) / ROWS_FILE, "rb") as rows:
            return pickle.load(rows)


def _failure(failure: Failure, folder: Path, timeout: float) -> Exception:
    if failure.hung:
        return RuntimeError(f"grad-check {describe_hang(failure, timeout)}")
    if failure.exitcode == USAGE_EXIT and failure.line.startswith(BAD_INPUT):
        return UsageError(failure.line.removeprefix(BAD_INPUT))
    if not failure.line and not _started(folder, failure.rank):
        return RuntimeError(f"grad-check rank {failure.rank} failed before it started: "
                            f"{describe_exit(failure.exitcode)}, while multiprocessing "
                            f"prepared it{_importing_the_script()}")
    return RuntimeError(f"grad-check rank {failure.rank} failed: "
                        f"{failure.line or describe_exit(failure.exitcode)}")


def _started(folder: Path, rank: int) -> bool:
    """Whether rank ``rank`` came as far as :func:`_rank_main`, which says why it fails."""
    return (folder / f"rank{rank}.started").exists()


def _importing_the_script() -> str:
    """What multiprocessing runs of the caller's in a rank before the rank starts."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    return (f" (it imports the calling script, {script}, again: its output above says why)"
            if script else "")


def _rank_main(rank: int, nproc: int, folder: str, data: bytes, config: CheckConfig,
               sizes: tuple[int, ...]) -> None:
    """One rank: join the others through a file in ``folder``, run the matrix on the setup
    ``data`` holds, and leave rank 0's rows (or this rank's error line) there."""
    (Path(folder) / f"rank{rank}.started").touch()
    torch.set_num_threads(1)  # ranks share the machine's cores, as torchrun's default
    try:
        source = received(data)  # here, so that a setup a rank cannot rebuild says why
        launch = Launch(rank=rank, world_size=nproc, local_rank=rank, local_world_size=nproc,
                        hostname=socket.gethostname(), slurm_job_id="")
        placement = choose_placement("auto", "auto", launch)
        if placement.device.type == "cuda":
            torch.cuda.set_device(placement.device)
        dist.init_process_group(placement.backend,
                                store=dist.FileStore(str(Path(folder) / "store"), nproc),
                                rank=rank, world_size=nproc,
                                timeout=timedelta(seconds=config.timeout))
        target, setup = resolve(source)
        rows = RowsRun(config, target, setup, launch, sizes, process_group=True).measured_rows()
        if rank == 0:
            with open(Path(folder) / ROWS_FILE, "wb") as out:
                pickle.dump(rows, out)
        code = 0
    except UsageError as error:
        code = _leave(folder, rank, BAD_INPUT + str(error), USAGE_EXIT)
    except BaseException as error:  # noqa: BLE001 -- reported to the caller, who raises it
        code = _leave(folder, rank, f"{type(error).__name__}: {error}", 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


def _leave(folder: str, rank: int, line: str, code: int) -> int:
    error_file(folder, rank).write_text(line.splitlines()[0] if line else "")
    return code
