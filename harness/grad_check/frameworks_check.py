"""``grad-check --frameworks NAME[,NAME] module:factory``: the check's second front-end.

The user's own Setup is trained through real frameworks (the adapters of
harness/adapters/) instead of the strategies, and judged by the check's engine
(:mod:`harness.adapters.measure`): the same references, fit, precision, tolerances,
verdicts and fixes as the Setup matrix, the same exit codes (harness/check/outcome.py)
and console table (harness/check/table.py).

``NAME`` is a framework (``accelerate``, ``lightning``, ``transformers``,
``deepspeed``: its ``default``, exactly as shipped) or ``FRAMEWORK:SETTING`` for one of
the settings users change (``deepspeed:zero1``, ``transformers:max_grad_norm=0``). The
frameworks reduce over the default process group, so every case runs on all the
launched ranks (N = the launch's size), at each k of ``--accum-steps``. A Setup field a
framework has no place for (DeepSpeed's engine has no hook for ``before_step``) is
refused by name before any rank starts. Rank 0 prints the table and writes
``frameworks.csv`` atomically.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from harness.adapters.columns import NAMES, case_label, judged_verdict
from harness.adapters.registry import DEFAULT, Framework, FrameworkSetting
from harness.check import batches
from harness.check.load import validated_setups
from harness.check.outcome import Judging, exit_code, finish, rows_of
from harness.check.setup import Setup
from harness.check.table import N_AND_K, POINT, STEP, VERDICT_CELLS, Cell, fix_cell, render
from harness.config import DTYPES
from harness.errors import UsageError, launched_by_harness, record_error, refuse
from harness.grad_check.console import notices
from harness.options import (
    check_out_folder,
    parse_float,
    parse_int_list,
    parse_name_list,
    parse_nproc,
    parse_out,
)
from harness.placement import Launch, under_torchrun

CSV_NAME = "frameworks.csv"
#: frameworks.csv: the setup's name, then a framework's row.
COLUMN_NAMES = ("setup", *NAMES)
#: The console table: which framework and setting, then the check's verdict columns.
CELLS = (Cell("framework", lambda row: f"{row['framework']} {row['framework_version']}"),
         Cell("setting", lambda row: str(row["setting"])), *N_AND_K, STEP, POINT,
         *VERDICT_CELLS, Cell("recipe", lambda row: str(row["recipe"])),
         Cell("recipe verdict", lambda row: "" if row["recipe"] in ("none", "")
              else str(row["recipe_verdict"])),
         Cell("fix", fix_cell))


@dataclass(frozen=True)
class FrameworksRun:
    """What one ``--frameworks`` run trains: each setup through each framework and
    setting, at each k, on every launched rank."""

    setups: list[tuple[str, Setup]]
    chosen: list[tuple[Framework, FrameworkSetting]]
    accum_steps: tuple[int, ...]
    out: Path
    dtype: str
    timeout: float
    fail_on: str
    quiet: bool


def frameworks() -> dict[str, Framework]:
    """The adapters, imported only when asked for (they import nothing heavy themselves)."""
    from harness.adapters import FRAMEWORKS

    return FRAMEWORKS


def selections(text: str) -> list[tuple[Framework, FrameworkSetting]]:
    """``accelerate,deepspeed:zero1`` -> the frameworks and settings it names; a missing
    framework, an unknown name or setting is bad input."""
    known = frameworks()
    chosen = []
    items = parse_name_list(text, "--frameworks")
    if not items:
        raise UsageError(f"--frameworks is empty; allowed: comma-separated names of "
                         f"{', '.join(known)}, each optionally :SETTING, e.g. accelerate")
    for item in items:
        name, _, setting_name = item.partition(":")
        framework = known.get(name)
        if framework is None:
            raise UsageError(f"--frameworks {item}: no framework {name!r}; allowed: "
                             f"{', '.join(known)}, each optionally :SETTING")
        names = [setting.name for setting in framework.settings]
        if (setting_name or DEFAULT) not in names:
            raise UsageError(f"--frameworks {item}: {name} has no setting {setting_name!r}; "
                             f"allowed: {', '.join(f'{name}:{s}' for s in names)}")
        if reason := framework.missing():
            raise UsageError(f"--frameworks {item}: {reason}")
        chosen.append((framework, framework.setting(setting_name or DEFAULT)))
    return chosen


def check_trainable(setup: Setup, target: str, chosen: list[tuple[Framework, FrameworkSetting]],
                    world_size: int, accum_steps: Sequence[int]) -> None:
    """Each framework must be able to run the setup's whole step, and its data loader
    feeds micro-batches of one size: every step's batch must give the same size."""
    for framework, _ in chosen:
        if reason := framework.refused(setup):
            raise UsageError(f"{target}: {reason}; allowed: the setup without it, or "
                             "--frameworks without this framework")
    for k in accum_steps:
        sizes = {batches.sample_count(setup.batch(step), f"batch({step})") // (world_size * k)
                 for step in range(setup.steps)}
        if len(sizes) > 1:
            raise UsageError(f"{target}: batch(i) gives micro-batches of {len(sizes)} sizes at "
                             f"N = {world_size}, k = {k} ({', '.join(map(str, sorted(sizes)))}); "
                             "allowed with --frameworks: global batches of one size")


def _world_size(args: argparse.Namespace, prog: str) -> int:
    if args.nproc is not None:
        return parse_nproc(args.nproc)
    if under_torchrun():
        return Launch.from_environment().world_size
    raise UsageError(f"{prog} --frameworks needs --nproc N or torchrun to start its ranks; "
                     "e.g. --nproc 2")


def main(args: argparse.Namespace, argv: Sequence[str], leader: bool, prog: str) -> int:
    """Every check of the input first (before any rank starts with ``--nproc``), then the
    run on every rank."""
    started_in = os.getcwd()  # the ranks start here, whatever folder a factory moves to
    try:
        chosen = selections(args.frameworks)
        accum_steps = parse_int_list(args.accum_steps, "--accum-steps")
        out = parse_out(args.out).absolute()  # before the user's code can change the folder
        check_out_folder(out)
        timeout = parse_float(args.timeout, "--timeout")
        world_size = _world_size(args, prog)
        if args.world_sizes is not None and args.world_sizes != str(world_size):
            raise UsageError(f"--world-sizes {args.world_sizes} with --frameworks: the "
                             f"frameworks train on every launched rank; allowed: "
                             f"{world_size} (or leave it out)")
        speaks = leader and not args.quiet and not launched_by_harness()
        # Each setup's model, batches and one piece are checked here, before any rank starts.
        setups = validated_setups(args.targets, [(world_size, k) for k in accum_steps],
                                  args.drop_last, DTYPES[args.dtype],
                                  say=notices(speaks, prog))
        for target, setup in setups:
            check_trainable(setup, target, chosen, world_size, accum_steps)
        if args.nproc is not None:
            from harness.launcher import launch_ranks

            code = launch_ranks(world_size, list(argv), prog, module="harness.grad_check",
                                name_rank_of_bad_input=False, timeout=timeout,
                                cwd=started_in)
            # The launcher judges the rows the ranks wrote, as grad-check's own does.
            return code or exit_code(rows_of(out / CSV_NAME), args.fail_on, prog,
                                     case_label, judged_verdict)
    except UsageError as error:
        return refuse(error, 0 if leader else 1, prog)
    return _run(FrameworksRun(setups, chosen, accum_steps, out, args.dtype, timeout,
                              args.fail_on, args.quiet), prog)


def _run(run: FrameworksRun, prog: str) -> int:
    import torch.distributed as dist

    # The frameworks here train on the CPU over gloo, whatever the machine holds.
    if not dist.is_initialized():  # tests initialise it themselves, through a FileStore
        dist.init_process_group("gloo", timeout=timedelta(seconds=run.timeout))
    rank = dist.get_rank()
    try:
        rows = _measured_rows(run)
    except Exception as error:
        if launched_by_harness():  # the launcher prints the line once
            record_error(rank, f"{type(error).__name__}: {error}")
            return 1
        raise
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    shown = None if run.quiet else "\n".join(
        f"\n{setup.name}:\n" + table([r for r in rows if r["setup"] == setup.name], setup.steps)
        for _, setup in run.setups)
    return finish(rows, run.out / CSV_NAME, COLUMN_NAMES,
                  Judging(run.fail_on, prog, case_label, judged_verdict), shown,
                  judged_elsewhere=launched_by_harness())  # there, the launcher judges it


def _measured_rows(run: FrameworksRun) -> list[dict[str, Any]]:
    from harness.adapters.measure import measure

    rows: list[dict[str, Any]] = []
    for _, setup in run.setups:
        for framework, setting in run.chosen:
            for k in run.accum_steps:
                measured = measure(framework, setting, setup, k, DTYPES[run.dtype])
                rows += [{"setup": setup.name, **row} for row in measured or []]
    return rows


def table(rows: Sequence[dict[str, Any]], steps: int = 1) -> str:
    """Aligned columns, one line per case, step and point; each case's configuration
    under them."""
    configs = dict.fromkeys(f"  {row['framework']} {row['setting']} k={row['accum_steps']}: "
                            f"{row['code']}" for row in rows if row["code"])
    return "\n".join([render(rows, steps, CELLS), "configuration as passed:", *configs])

