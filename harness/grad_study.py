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
from dataclasses import replace

from harness.config import MATRICES, STRATEGIES, RunConfig, add_dtype_flag, add_timeout_flag
from harness.errors import UsageError, launched_by_harness, refuse
from harness.failure import report_failure
from harness.launcher import launch_ranks, say_if_oversubscribed
from harness.options import (
    CommandParser,
    StudyOptions,
    check_out_folder,
    parse_float,
    parse_int,
    parse_int_list,
    parse_name_list,
    parse_nproc,
    parse_out,
)
from harness.out_lock import out_lock
from harness.placement import (
    BACKENDS,
    DEVICES,
    Launch,
    choose_placement,
    leader_from_environment,
)

PROG = "study.py"


def _studies():
    from harness.studies import STUDIES

    return STUDIES


def build_parser() -> argparse.ArgumentParser:
    studies = _studies()
    parser = _new_parser(studies)
    _add_run_flags(parser)
    for study in studies.values():
        _add_study_flags(parser, study.name, study.Options)
    return parser


def _new_parser(studies: dict) -> argparse.ArgumentParser:
    """The parser with its description and every study's example."""
    examples = "\n".join(f"  # {cls.name}: {cls.summary}\n  {cls.example}\n"
                         for cls in studies.values())
    return CommandParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Measure how gradients are reduced across devices and accumulated across
            iterations, and write one tidy CSV per study (plus REPORT.md) to --out.
            Launch it with --nproc N (it starts N ranks itself) or with torchrun: one
            launch of N ranks measures every world size 1..N on process subgroups."""),
        epilog="examples:\n" + examples + textwrap.dedent("""\
              # everything, on 4 CPU processes (the default run committed under results/)
              python scripts/study.py --nproc 4
              torchrun --standalone --nproc_per_node=4 scripts/study.py      # the same
            """),
    )


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The run-wide flags (the study's own come from their options dataclasses)."""
    parser.add_argument("--nproc", metavar="N", default=None,
                        help="start N ranks on this machine (as torchrun --standalone does, the "
                             "ranks forked from one process that imports torch once) after "
                             "checking every flag; a failed rank becomes one line. Leave it "
                             "out under torchrun or Slurm")
    parser.add_argument("--list", action="store_true",
                        help="list the studies, one line each, and exit")
    parser.add_argument("--studies", metavar="NAME[,NAME]", default=None,
                        help="studies to run, in this order (default: "
                             f"{','.join(default_studies())})")
    parser.add_argument("--world-sizes", metavar="K[,K]", default=None,
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
    add_dtype_flag(parser, "floating-point type")
    parser.add_argument("--out", default="results", metavar="DIR",
                        help="folder for the CSVs, run.json and REPORT.md (default: results)")
    parser.add_argument("--seed", default="0", metavar="INT",
                        help="seed of every batch and initial weight, 0..2^32-1 (default: 0)")
    parser.add_argument("--matrix", default="default", metavar="|".join(MATRICES),
                        help="size of every study's matrix: default = the committed run's; "
                             "full = every combination (default: default)")
    add_timeout_flag(parser, "a collective inside a case")
    parser.add_argument("--resume", action="store_true",
                        help="finish an interrupted run in --out, reusing its finished cases")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar, no summary tables")
    parser.add_argument("--no-report", dest="report", action="store_false",
                        help="skip REPORT.md and its plots")


def _shown_default(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _add_study_flags(parser: argparse.ArgumentParser, study: str,
                     options: type[StudyOptions]) -> None:
    """One group per study with settings of its own; the defaults are the dataclass's."""
    flags = options.flags()
    if not flags:
        return
    group = parser.add_argument_group(f"{study} study")
    for field in flags:
        meta = field.metadata
        group.add_argument(meta["flag"], dest=f"{study}.{field.name}", default=None,
                           metavar=meta["metavar"],
                           help=f"{meta['help']} (default: {_shown_default(field.default)})")


def study_options_from_args(args: argparse.Namespace, studies: Sequence[str]
                            ) -> dict[str, StudyOptions]:
    """Each selected study's Options, from the flags given (defaults elsewhere).

    A flag of a study that is not selected is refused rather than silently ignored.
    """
    every = _studies()
    for name, study in every.items():
        for field in study.Options.flags():
            if name not in studies and getattr(args, f"{name}.{field.name}") is not None:
                raise UsageError(f"{field.metadata['flag']} belongs to the {name} study, which "
                                 f"--studies does not select; add {name} to --studies or drop "
                                 "the flag")
    options = {}
    for name in studies:
        study = every[name]
        values = {}
        for field in study.Options.flags():
            text = getattr(args, f"{name}.{field.name}")
            if text is not None:
                parse = field.metadata["parse"]
                values[field.name] = parse(text, field.metadata["flag"]) if parse else text
        options[name] = study.Options(**values)
    return options


def default_studies() -> tuple[str, ...]:
    """The studies of a run that names none: those meant for it that this installation can
    run (a study whose optional extra is missing is left out; ``--list`` says why)."""
    return tuple(name for name, study in _studies().items()
                 if study.in_default_run and study().unavailable() is None)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    studies = (default_studies() if args.studies is None
               else parse_name_list(args.studies, "--studies"))
    config = RunConfig(
        studies=studies,
        known_studies=tuple(_studies()),
        world_sizes=(parse_int_list(args.world_sizes, "--world-sizes")
                     if args.world_sizes is not None else ()),
        strategies=parse_name_list(args.strategies, "--strategies"),
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        out=parse_out(args.out),
        seed=parse_int(args.seed, "--seed"),
        matrix=args.matrix,
        timeout=parse_float(args.timeout, "--timeout"),
        resume=args.resume,
        quiet=args.quiet,
        report=args.report,
        studies_named=args.studies is not None,
    )
    check_out_folder(config.out)
    return replace(config, study_options=study_options_from_args(args, config.studies))


def failure_line(error: Exception) -> str:
    """A rank's line for an error outside any case: a file it could not write (a full
    disk) said with its path and the way on, else the error's type and text."""
    from harness.results import WriteError

    if isinstance(error, WriteError):
        return (f"{error.line()}; once there is room, --resume finishes the run in the same "
                "--out")
    return f"{type(error).__name__}: {error}"


def list_studies() -> str:
    studies = _studies()
    width = max(len(name) for name in studies)
    lines = []
    for name, cls in studies.items():
        reason = cls().unavailable()
        lines.append(f"{name:<{width}}  {cls.summary}" + (f" [{reason}]" if reason else ""))
    return "\n".join(lines)


def _launch(config: RunConfig, nproc_flag: str, argv: list[str]) -> int:
    """--nproc: make every check a rank would make, before any rank exists (a bad flag is
    one line here, not N), then start the ranks."""
    nproc = parse_nproc(nproc_flag)
    planned = Launch.planned(nproc)
    config.resolved_world_sizes(planned)
    choose_placement(config.backend, config.device, planned)
    say_if_oversubscribed(nproc, PROG)
    # The launcher holds --out for the run; its ranks, forked after, do not (harness/runner.py
    # holds it where nothing else does: under torchrun, rank 0).
    with out_lock(config.out, "grad-study"):
        return launch_ranks(nproc, argv, PROG, timeout=config.timeout)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    leader = leader_from_environment()
    try:
        args = build_parser().parse_args(argv)
        if args.list:
            if leader:
                print(list_studies())
            return 0
        config = config_from_args(args)
        if args.nproc is not None:
            return _launch(config, args.nproc, argv)
        launch = Launch.from_environment()
        world_sizes = config.resolved_world_sizes(launch)
        placement = choose_placement(config.backend, config.device, launch)
        if launch.local_rank == 0 and not launched_by_harness():  # --nproc said it already
            say_if_oversubscribed(launch.local_world_size, PROG)
    except UsageError as error:
        return refuse(error, 0 if leader else 1, PROG)
    from harness.runner import Runner

    studies = [_studies()[name](config.options_of(name)) for name in config.studies]
    try:
        return Runner(config, launch, placement, world_sizes, studies).run()
    except Exception as error:
        # Whoever launched the rank prints the first line a rank reported, once: --nproc
        # as its last line, torchrun in its summary (harness/failure.py). A case's failure
        # was reported where it happened, naming the case.
        if not getattr(error, "reported", False):
            line = failure_line(error)
            report_failure(launch.rank, line)
            if not launched_by_harness():
                print(f"{PROG}: error: rank {launch.rank} failed: {line}", file=sys.stderr,
                      flush=True)
        if launched_by_harness():
            return 1
        raise
