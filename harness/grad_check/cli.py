"""The command line of ``scripts/check.py`` and ``grad-check``.

As in ``study.py``: every check of the input happens before any process group,
folder or file exists (with ``--nproc``, before any rank starts); bad input is one
line naming the bad value and what is allowed, exit code 2, nothing written.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence

from harness.check.load import validated_setups
from harness.check.outcome import DEFAULT_FAIL_ON, FAIL_ON, Judging, exit_code, finish, rows_of
from harness.check.setup import Setup
from harness.check.step import check_step_device
from harness.config import add_dtype_flag, add_timeout_flag
from harness.errors import (
    UsageError,
    interrupted,
    launched_by_harness,
    record_error,
    refuse,
)
from harness.grad_check.check_config import CHECK_STRATEGIES, CSV_NAME, CheckConfig
from harness.grad_check.console import notices
from harness.grad_check.schema import case_label
from harness.options import (
    CommandParser,
    check_out_folder,
    parse_float,
    parse_int_list,
    parse_name_list,
    parse_nproc,
    parse_out,
)
from harness.placement import (
    Launch,
    Placement,
    choose_placement,
    leader_from_environment,
    under_torchrun,
)

PROG = "check.py"


DESCRIPTION = textwrap.dedent("""\
    Does your multi-rank / accumulated training step equal one big-batch step?
    TARGET names a function returning a harness.check.Setup (model, batches, loss,
    optimizer). Every strategy x world size N x micro-steps k is compared with one
    process stepping once on the whole global batch: param.grad before
    optimizer.step() and the parameters after it.""")
EPILOG = textwrap.dedent("""\
    examples:
      python scripts/check.py --nproc 2 examples.mlp:make_setup
      torchrun --standalone --nproc_per_node=2 scripts/check.py \\
          examples.digits_cnn:make_setup --accum-steps 1,4
      python scripts/check.py --nproc 2 examples.tiny_lm:make_setup --strategies ddp
    """)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                     description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("targets", metavar="TARGET", nargs="+",
                        help="module.path:factory, e.g. examples.mlp:make_setup (imported "
                             "from the current folder or the Python path); several are "
                             "checked one after the other in the same launch")
    parser.add_argument("--nproc", metavar="N", default=None,
                        help="start N ranks on this machine after checking every flag, as "
                             "study.py --nproc does; leave it out under torchrun")
    parser.add_argument("--accum-steps", metavar="K[,K]", default="1,2",
                        help="micro-steps per optimizer step to check (default: 1,2)")
    parser.add_argument("--strategies", metavar="NAME[,NAME]", default=",".join(CHECK_STRATEGIES),
                        help="; ".join(f"{k} = {v}" for k, v in CHECK_STRATEGIES.items())
                             + " (default: all)")
    parser.add_argument("--world-sizes", metavar="N[,N]", default=None,
                        help="world sizes, each on ranks 0..N-1 of this launch (default: 1..N "
                             "for N launched ranks)")
    add_dtype_flag(parser, "model and batch type")
    parser.add_argument("--out", default="check-results", metavar="DIR",
                        help=f"folder for {CSV_NAME} (default: check-results)")
    parser.add_argument("--drop-last", action="store_true",
                        help="drop the samples of a global batch that do not split evenly "
                             "into N x k pieces (default: refuse such a batch)")
    parser.add_argument("--frameworks", metavar="NAME[,NAME]", default=None,
                        help="train the setup through real frameworks instead of the "
                             "strategies, on every launched rank: accelerate, lightning, "
                             "transformers, deepspeed (each as shipped), or NAME:SETTING "
                             "for a setting users change (deepspeed:zero1, "
                             "transformers:max_grad_norm=0); needs '.[frameworks]'; writes "
                             "frameworks.csv")
    add_timeout_flag(parser, "a collective")
    parser.add_argument("--fail-on", default=DEFAULT_FAIL_ON, choices=tuple(FAIL_ON),
                        help="exit code 1 when a case errors (always) or a row's verdict is "
                             "'differs' (differs), 'differs' or 'scaled' (scaled), or only "
                             f"on errors (error); default: {DEFAULT_FAIL_ON}")
    parser.add_argument("--quiet", action="store_true", help="no table on the console")
    return parser


def config_from_args(args: argparse.Namespace) -> CheckConfig:
    config = CheckConfig(
        targets=tuple(args.targets),
        accum_steps=parse_int_list(args.accum_steps, "--accum-steps"),
        strategies=parse_name_list(args.strategies, "--strategies"),
        world_sizes=(parse_int_list(args.world_sizes, "--world-sizes")
                     if args.world_sizes is not None else ()),
        dtype=args.dtype,
        out=parse_out(args.out),
        drop_last=args.drop_last,
        quiet=args.quiet,
        timeout=parse_float(args.timeout, "--timeout"),
        fail_on=args.fail_on,
    )
    check_out_folder(config.out)
    return config


def _splits(config: CheckConfig, world_sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(n, k) for n in world_sizes for k in config.accum_steps]


def _launch_from_environment() -> Launch:
    if not under_torchrun():
        raise UsageError("check.py needs --nproc N or torchrun to start its ranks; run e.g. "
                         "'python scripts/check.py --nproc 2 examples.mlp:make_setup'")
    return Launch.from_environment()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # grad-check run -- COMMAND: a script of the user's own
        from harness.grad_check.script.grad_check_run import main as run_main

        return run_main(argv[1:])
    leader = leader_from_environment()
    try:
        args = build_parser().parse_args(argv)
        if args.frameworks is not None:
            from harness.grad_check.frameworks_check import main as frameworks_main

            return frameworks_main(args, argv, leader, PROG)
        config = config_from_args(args)
        if args.nproc is not None:
            return _launch(config, args.nproc, argv)
        launch = _launch_from_environment()
        world_sizes = config.resolved_world_sizes(launch.world_size)
        placement = choose_placement("auto", "auto", launch)
        # The launcher has checked the batches and one piece: a rank it started does not
        # again; under torchrun the ranks check the batches (their reference checks the
        # loss and the optimizer as it uses them).
        setups = validated_setups(config.targets, _splits(config, world_sizes),
                                  config.drop_last, config.torch_dtype,
                                  batches_too=not launched_by_harness(), piece_too=False,
                                  say=notices(leader and not config.quiet
                                              and not launched_by_harness(), PROG))
    except UsageError as error:
        return refuse(error, 0 if leader else 1, PROG)
    except KeyboardInterrupt:
        return interrupted(PROG, leader)
    return _run(config, setups, launch, placement, world_sizes)


def _launch(config: CheckConfig, nproc_flag: str, argv: list[str]) -> int:
    """Check the setups here, once, then start the ranks; the exit code from the rows the
    ranks wrote (see outcome.py)."""
    started_in = os.getcwd()  # the ranks start here, whatever folder a factory moves to
    nproc = parse_nproc(nproc_flag)
    planned = Launch.planned(nproc)
    world_sizes = config.resolved_world_sizes(nproc)
    placement = choose_placement("auto", "auto", planned)
    for target, setup in validated_setups(config.targets, _splits(config, world_sizes),
                                          config.drop_last, config.torch_dtype,
                                          say=notices(not config.quiet, PROG)):
        check_step_device(setup, target, placement.device)
    from harness.launcher import launch_ranks

    if not config.quiet:
        print(f"{PROG}: starting {nproc} rank(s)", flush=True)
    code = launch_ranks(nproc, argv, PROG, module="harness.grad_check",
                        name_rank_of_bad_input=False, timeout=config.timeout,
                        cwd=started_in)
    if code != 0:
        return code
    return exit_code(rows_of(config.out / CSV_NAME), config.fail_on, PROG, case_label)


def _run(config: CheckConfig, setups: list[tuple[str, Setup]], launch: Launch,
         placement: Placement, world_sizes: tuple[int, ...]) -> int:
    import torch.distributed as dist

    from harness.grad_check.matrix import CheckRun

    run = CheckRun(config, setups, launch, placement, world_sizes)
    if launch.is_leader and not config.quiet:
        names = ", ".join(f"{setup.name} ({target})" for target, setup in setups)
        print(f"{PROG}: {names} on {launch.world_size} rank(s), "
              f"{placement.description} dtype={config.dtype}; world sizes "
              f"{','.join(map(str, world_sizes))}, accum steps "
              f"{','.join(map(str, config.accum_steps))}, strategies "
              f"{','.join(config.strategies)}", flush=True)
    try:
        run.run()
    except UsageError as error:
        if dist.is_initialized():
            dist.destroy_process_group()
        return refuse(error, launch.rank, PROG)
    except KeyboardInterrupt:
        return interrupted(PROG, launch.is_leader)
    except Exception as error:
        if launched_by_harness():  # the launcher prints the line once
            record_error(launch.rank, f"{type(error).__name__}: {error}")
            return 1
        raise
    if not launch.is_leader:
        return 0
    from harness.check.table import render
    from harness.grad_check.schema import CELLS, COLUMN_NAMES

    shown = None if config.quiet else "\n".join(
        f"\n{setup.name}:\n" + render([row for row in run.rows if row["setup"] == setup.name],
                                        setup.steps, CELLS) for _, setup in setups)
    return finish(run.rows, config.out / CSV_NAME, COLUMN_NAMES,
                  Judging(config.fail_on, PROG, case_label), shown, written=True,
                  judged_elsewhere=launched_by_harness())  # there, the launcher judges it
