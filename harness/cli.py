"""The command line of ``scripts/study.py``.

Parsing and every check of the input happen before any process group, folder
or file exists, on every rank alike: bad input stops all ranks the same way,
rank 0 alone prints one line, and the exit code is 2.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from harness.config import DTYPES, MATRICES, STRATEGIES, RunConfig, parse_int_list, parse_name_list
from harness.errors import UsageError
from harness.launch import BACKENDS, DEVICES, Launch, choose_placement, leader_from_environment

PROG = "study.py"


class _Parser(argparse.ArgumentParser):
    """argparse, but errors raise UsageError (one line, exit 2) and only rank 0 prints."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)

    def _print_message(self, message: str, file=None) -> None:
        if leader_from_environment():
            super()._print_message(message, file)


def _studies():
    from harness.studies import STUDIES

    return STUDIES


def build_parser() -> argparse.ArgumentParser:
    studies = _studies()
    examples = "\n".join(f"  # {cls.name}: {cls.summary}\n  {cls.example}\n"
                         for cls in studies.values())
    parser = _Parser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Measure how gradients are reduced across devices and accumulated across
            iterations, and write one tidy CSV per study (plus REPORT.md) to --out.
            Launch it with torchrun: one launch of N ranks measures every world size
            1..N on process subgroups."""),
        epilog="examples:\n" + examples + textwrap.dedent("""\
              # everything, on 4 CPU processes (the default run committed under results/)
              torchrun --standalone --nproc_per_node=4 scripts/study.py
            """),
    )
    parser.add_argument("--list", action="store_true",
                        help="list the studies, one line each, and exit")
    parser.add_argument("--studies", metavar="NAME[,NAME]", default=",".join(studies),
                        help="studies to run, in this order (default: all: %(default)s)")
    parser.add_argument("--world-sizes", metavar="K[,K]", default="",
                        help="world sizes to measure, each on ranks 0..K-1 of this launch "
                             "(default: 1..N for N launched ranks), e.g. 1,2,3")
    parser.add_argument("--strategies", metavar="NAME[,NAME]", default=",".join(STRATEGIES),
                        help="strategies to measure; each study runs those it supports: "
                             + "; ".join(f"{k} = {v}" for k, v in STRATEGIES.items())
                             + " (default: all)")
    parser.add_argument("--backend", default="auto", metavar="|".join(BACKENDS),
                        help="collective backend; auto = nccl when every rank has its own GPU, "
                             "gloo otherwise (default: auto)")
    parser.add_argument("--device", default="auto", metavar="|".join(DEVICES),
                        help="device of models and batches; auto = cuda when present "
                             "(default: auto)")
    parser.add_argument("--dtype", default="float64", metavar="|".join(DTYPES),
                        help="floating-point type; float64 makes verdicts exact to ~1e-12 "
                             "(default: float64)")
    parser.add_argument("--out", default="results", metavar="DIR",
                        help="folder for the CSVs, run.json and REPORT.md (default: results)")
    parser.add_argument("--seed", default="0", metavar="INT",
                        help="seed of every batch and initial weight (default: 0)")
    parser.add_argument("--shard-size", default="4", metavar="INT",
                        help="samples per device in the reduction study (default: 4)")
    parser.add_argument("--accum-steps", default="1,2,4,8", metavar="K[,K]",
                        help="accumulation steps of the accumulation study (default: 1,2,4,8)")
    parser.add_argument("--matrix", default="default", metavar="|".join(MATRICES),
                        help="accumulation matrix: default varies one group of axes at a time; "
                             "full measures every combination (default: default)")
    parser.add_argument("--epochs", default="5", metavar="INT",
                        help="epochs of the training study (default: 5)")
    parser.add_argument("--timeout", default="300", metavar="SECONDS",
                        help="how long a collective inside a case may wait before the run "
                             "fails instead of hanging (default: 300)")
    parser.add_argument("--resume", action="store_true",
                        help="finish an interrupted run in --out, reusing its finished cases")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar, no summary tables")
    parser.add_argument("--no-report", dest="report", action="store_false",
                        help="skip REPORT.md and its plots")
    return parser


def _number(text: str, flag: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UsageError(f"{flag} {text!r} is not {what}") from None


def config_from_args(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        studies=parse_name_list(args.studies),
        known_studies=tuple(_studies()),
        world_sizes=parse_int_list(args.world_sizes, "--world-sizes") if args.world_sizes else (),
        strategies=parse_name_list(args.strategies),
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        out=Path(args.out),
        seed=int(_number(args.seed, "--seed", int)),
        shard_size=int(_number(args.shard_size, "--shard-size", int)),
        accum_steps=parse_int_list(args.accum_steps, "--accum-steps"),
        matrix=args.matrix,
        epochs=int(_number(args.epochs, "--epochs", int)),
        timeout=float(_number(args.timeout, "--timeout", float)),
        resume=args.resume,
        quiet=args.quiet,
        report=args.report,
    )


def list_studies() -> str:
    studies = _studies()
    width = max(len(name) for name in studies)
    return "\n".join(f"{name:<{width}}  {cls.summary}" for name, cls in studies.items())


def main(argv: Sequence[str] | None = None) -> int:
    leader = leader_from_environment()
    try:
        args = build_parser().parse_args(argv)
        if args.list:
            if leader:
                print(list_studies())
            return 0
        config = config_from_args(args)
        launch = Launch.from_environment()
        world_sizes = config.resolved_world_sizes(launch)
        placement = choose_placement(config.backend, config.device, launch)
    except UsageError as error:
        if leader:
            print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    from harness.runner import Runner

    studies = [_studies()[name]() for name in config.studies]
    return Runner(config, launch, placement, world_sizes, studies).run()
