"""``grad-check --frameworks NAME[,NAME] module:factory``: the user's own Setup through
real frameworks, with the frameworks study's code (:mod:`.measure`).

``NAME`` is a framework (``accelerate``, ``lightning``, ``transformers``,
``deepspeed``: its ``default``, exactly as shipped) or ``FRAMEWORK:SETTING`` for one of
the settings users change (``deepspeed:zero1``, ``transformers:max_grad_norm=0``).
The frameworks reduce over the default process group, so every case runs on all the
launched ranks (N = the launch's size), at each k of ``--accum-steps``. Each row is
compared with the plain big batch and with the big batch under the framework's own
recipe (its clip), as in the study; rank 0 prints the table and writes
``frameworks.csv`` atomically.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from harness.check.load import validated_setup
from harness.check.outcome import exit_code, rows_of
from harness.check.setup import Setup
from harness.check.table import aligned, number
from harness.config import DTYPES
from harness.errors import UsageError, launched_by_harness, record_error, refuse
from harness.frameworks.registry import DEFAULT, Framework, Setting
from harness.options import (
    check_out_folder,
    parse_float,
    parse_int_list,
    parse_name_list,
    parse_nproc,
)
from harness.studies.frameworks.schema import CHECK_COLUMNS

CSV_NAME = "frameworks.csv"
FRAMEWORK_NAMES = ("accelerate", "lightning", "transformers", "deepspeed")
HEADER = ("framework", "setting", "N", "k", "point", "verdict", "scale", "residual",
          "recipe", "recipe verdict", "fix")


def frameworks() -> dict[str, Framework]:
    """The adapters, imported only when asked for (they import nothing heavy themselves)."""
    from harness.frameworks import FRAMEWORKS

    return FRAMEWORKS


def selections(text: str) -> list[tuple[Framework, Setting]]:
    """``accelerate,deepspeed:zero1`` -> the frameworks and settings it names; a missing
    framework, an unknown name or setting is bad input."""
    known = frameworks()
    chosen = []
    for item in parse_name_list(text, "--frameworks"):
        name, _, setting_name = item.partition(":")
        framework = known.get(name)
        if framework is None:
            raise UsageError(f"--frameworks {item}: no framework {name!r}; allowed: "
                             f"{', '.join(FRAMEWORK_NAMES)}, each optionally :SETTING")
        names = [setting.name for setting in framework.settings]
        if (setting_name or DEFAULT) not in names:
            raise UsageError(f"--frameworks {item}: {name} has no setting {setting_name!r}; "
                             f"allowed: {', '.join(f'{name}:{s}' for s in names)}")
        if reason := framework.missing():
            raise UsageError(f"--frameworks {item}: {reason}")
        chosen.append((framework, framework.setting(setting_name or DEFAULT)))
    return chosen


def main(args: argparse.Namespace, argv: Sequence[str], leader: bool, prog: str) -> int:
    """Every check of the input first (before any rank starts with ``--nproc``), then the
    run on every rank."""
    from harness.launch import Launch, under_torchrun

    try:
        chosen = selections(args.frameworks)
        accum_steps = parse_int_list(args.accum_steps, "--accum-steps")
        out = Path(args.out)
        check_out_folder(out)
        timeout = parse_float(args.timeout, "--timeout")
        if args.nproc is not None:
            world_size = parse_nproc(args.nproc)
        elif under_torchrun():
            world_size = Launch.from_environment().world_size
        else:
            raise UsageError(f"{prog} --frameworks needs --nproc N or torchrun to start its "
                             "ranks; e.g. --nproc 2")
        if args.world_sizes and args.world_sizes != str(world_size):
            raise UsageError(f"--world-sizes {args.world_sizes} with --frameworks: the "
                             f"frameworks train on every launched rank; allowed: "
                             f"{world_size} (or leave it out)")
        # Each setup's model, batches and one piece are checked here, before any rank starts.
        setups = [(target, validated_setup(target, [(world_size, k) for k in accum_steps],
                                           args.drop_last, DTYPES[args.dtype]))
                  for target in args.targets]
        if args.nproc is not None:
            from harness.launcher import launch_ranks

            code = launch_ranks(world_size, list(argv), prog, module="harness.check",
                                name_rank_of_bad_input=False)
            # The launcher judges the rows the ranks wrote, as grad-check's own does.
            return code or exit_code(rows_of(out / CSV_NAME), args.fail_on, prog)
    except UsageError as error:
        return refuse(error, 0 if leader else 1, prog)
    return _run(chosen, setups, accum_steps, args, out, timeout, prog)


def _run(chosen: list[tuple[Framework, Setting]], setups: list[tuple[str, Setup]],
         accum_steps: Sequence[int], args: argparse.Namespace, out: Path, timeout: float,
         prog: str) -> int:
    import torch.distributed as dist

    from harness.frameworks.measure import measure
    from harness.results import write_csv_atomic

    # The frameworks here train on the CPU over gloo, whatever the machine holds.
    if not dist.is_initialized():  # tests initialise it themselves, through a FileStore
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank = dist.get_rank()
    rows: list[dict[str, Any]] = []
    try:
        for _, setup in setups:
            for framework, setting in chosen:
                for k in accum_steps:
                    measured = measure(framework, setting, setup, k, DTYPES[args.dtype])
                    rows += [{"setup": setup.name, **row} for row in measured or []]
    except Exception as error:
        if launched_by_harness():  # the launcher prints the line once
            record_error(rank, f"{type(error).__name__}: {error}")
            return 1
        raise
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_csv_atomic(out / CSV_NAME, rows, CHECK_COLUMNS)
        if not args.quiet:
            for _, setup in setups:
                print(f"\n{setup.name}:\n" + render([r for r in rows
                                                     if r["setup"] == setup.name]))
            print(f"{prog}: {len(rows)} rows -> {out / CSV_NAME}")
        if not launched_by_harness():  # else the launcher judges the CSV
            return exit_code(rows, args.fail_on, prog)
    return 0


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    verdict = row["verdict"] if row["status"] == "ok" else f"error: {row['error']}"
    recipe = "" if row["recipe"] == "none" else row["recipe_verdict"]
    return (f"{row['framework']} {row['framework_version']}", row["setting"],
            str(row["world_size"]), str(row["accum_steps"]), row["point"], verdict,
            number(row["scale"]), number(row["residual"]), row["recipe"], recipe,
            row["fix"])


def render(rows: Sequence[dict[str, Any]]) -> str:
    """Aligned columns, one line per case and point; each case's configuration under it."""
    text = aligned([HEADER, *(_cells(row) for row in rows)])
    configs = dict.fromkeys(f"  {row['framework']} {row['setting']} k={row['accum_steps']}: "
                            f"{row['code']}" for row in rows if row["code"])
    return "\n".join([*text, "configuration as passed:", *configs])
