"""``grad-check run [options] -- COMMAND...``: the command line of the script mode.

As everywhere in the harness: every check of the input happens before the command first
runs; bad input is one line naming the bad value and what is allowed, exit code 2, and
no ``script.csv``. What only a run can show about the input (the command refuses its
arguments, never steps an optimizer, is not deterministic) is found on the reference's
runs, before any other split runs, and said the same way.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.check.outcome import DEFAULT_FAIL_ON, FAIL_ON, exit_code
from harness.check.table import (
    N_AND_K,
    POINT,
    STEP,
    VERDICT_CELLS,
    Cell,
    fix_cell,
    worst_cell,
)
from harness.check.table import render as table_render
from harness.config import add_timeout_flag
from harness.errors import INTERRUPTED_EXIT, UsageError, refuse
from harness.grad_check.script.config import CSV_NAME, DEFAULT_STEPS, ScriptConfig
from harness.grad_check.script.schema import COLUMN_NAMES, case_label
from harness.grad_check.script.splits import PLACEHOLDERS, parse_split, parse_splits
from harness.options import CommandParser, check_out_folder, parse_float, parse_int

PROG = "check.py run"
DEFAULT_SPLITS = "1x1,1x2,2x1,2x2"

DESCRIPTION = textwrap.dedent("""\
    Does your own training script take the same optimizer step however one global batch
    of G samples is split into N ranks x k micro-steps? COMMAND (after --) runs once per
    split, unchanged: a startup hook captures the gradients each optimizer.step()
    receives and the parameters after it, for the first --steps steps. N > 1 runs N
    processes with torchrun's environment (plain DDP, Accelerate, Lightning, the
    Trainer and DeepSpeed all see a distributed run); N = 1 runs one plain process.
    Each split is compared with the reference split (run twice: it must repeat itself).

    placeholders, substituted in COMMAND at each split:
    """) + "\n".join(f"  {{{name}}}".ljust(18) + meaning for name, meaning in PLACEHOLDERS.items())
EPILOG = textwrap.dedent("""\
    examples:
      python scripts/check.py run --global-batch 16 -- \\
          python examples/scripts/ddp_loop.py --batch-size {batch} --grad-accum {accum}
      grad-check run --global-batch 32 --splits 1x1,1x4,2x2,4x1 --steps 3 -- \\
          python train.py --per-device-batch {batch} --accum {accum} --devices {nproc}
      grad-check run --global-batch 64 --reference 2x1 --splits 2x1,2x4 --out ci/ -- ...

    A split whose step fed other samples than the reference's is named as such
    (status 'different samples'), not judged. Rows: script.csv in --out, and a table.
    Exit code: 0; 1 when a split errors or a row fails --fail-on; 2 for bad input;
    130 after Ctrl-C, 143 after SIGTERM (the running ranks stopped first).
    """)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog=PROG, usage=f"{PROG} [options] -- COMMAND...",
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--global-batch", metavar="G", required=True,
                        help="samples per optimizer step, the same at every split; each "
                             "split's N*k must divide it (b = G / (N*k))")
    parser.add_argument("--splits", metavar="NxK[,NxK]", default=DEFAULT_SPLITS,
                        help="the splits to compare with the reference, N ranks x k "
                             f"micro-steps, e.g. 1x1,1x4,2x2,4x1 (default: {DEFAULT_SPLITS}); "
                             "N at most the GPUs of this machine where it has any (one per "
                             "rank); more ranks than CPU cores share them")
    parser.add_argument("--reference", metavar="NxK", default="1x1",
                        help="the split every other is compared with, run twice (default: "
                             "1x1, one process taking the whole global batch; name another "
                             "where G does not fit one process)")
    parser.add_argument("--steps", metavar="S", default=str(DEFAULT_STEPS),
                        help="optimizer steps captured and compared per split, from the "
                             f"script's first (default: {DEFAULT_STEPS}); after step S the "
                             "script is stopped on every rank")
    parser.add_argument("--keep-going", action="store_true",
                        help="let the script run to its end after step S (its own teardown, "
                             "checkpoints, evaluation) instead of stopping it")
    parser.add_argument("--out", default="check-results", metavar="DIR",
                        help=f"folder for {CSV_NAME} (default: check-results)")
    parser.add_argument("--fail-on", default=DEFAULT_FAIL_ON, choices=tuple(FAIL_ON),
                        help="exit code 1 when a split errors or a step fed other samples "
                             "(always) or a row's verdict is 'differs' (differs), 'differs' "
                             "or 'scaled' (scaled), or only on those (error); default: "
                             f"{DEFAULT_FAIL_ON}")
    add_timeout_flag(parser, "one run of the command")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress lines and no table on the console")
    return parser


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the options, the command after the first ``--``)."""
    if "--" not in argv:
        if any(flag in argv for flag in ("-h", "--help")):
            return argv, []
        raise UsageError("no -- before the command; allowed: check.py run [options] -- "
                         "COMMAND..., e.g. -- python train.py --batch-size {batch}")
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def config_from_args(args: argparse.Namespace, command: list[str]) -> ScriptConfig:
    import torch

    from harness.grad_check.script import slurm

    config = ScriptConfig(command=tuple(command),
                          global_batch=parse_int(args.global_batch, "--global-batch"),
                          splits=parse_splits(args.splits),
                          reference=parse_split(args.reference, "--reference"),
                          steps=parse_int(args.steps, "--steps"), keep_going=args.keep_going,
                          out=Path(args.out), fail_on=args.fail_on,
                          timeout=parse_float(args.timeout, "--timeout"), quiet=args.quiet,
                          gpus=torch.cuda.device_count() * slurm.nodes())
    check_out_folder(config.out)
    return config


def main(argv: Sequence[str] | None = None, starter=None) -> int:
    """``check.py run ...``; ``starter``: how a rank is started (harness/grad_check/script/
    launch.py; a test's may fork instead of starting an interpreter)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        options, command = split_command(argv)
        config = config_from_args(build_parser().parse_args(options), command)
    except UsageError as error:
        return refuse(error, 0, PROG)
    return run(config, starter)


def run(config: ScriptConfig, starter=None) -> int:
    from harness.failure import STOPPED_EXIT
    from harness.grad_check.script.matrix import ReferenceFailed, ScriptCheck
    from harness.grad_check.script.processes import CommandLauncher, start_subprocess
    from harness.grad_check.script.slurm import srun_starter
    from harness.launcher import Stopped, say_if_oversubscribed, stopped_by_sigterm
    from harness.results import write_csv_atomic

    if not config.gpus and srun_starter() is None:
        say_if_oversubscribed(config.most_ranks, PROG)

    launch = CommandLauncher(steps=config.steps, keep_going=config.keep_going,
                             timeout=config.timeout,
                             starter=starter or srun_starter() or start_subprocess,
                             global_batch=config.global_batch)
    say = (lambda line: None) if config.quiet else (
        lambda line: print(f"{PROG}: {line}", flush=True))
    try:
        with stopped_by_sigterm():
            rows = ScriptCheck(config, launch, say).rows()
    except UsageError as error:
        return refuse(error, 0, PROG)
    except ReferenceFailed as failure:
        print(f"{PROG}: error: {failure}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT
    except Stopped:
        print(f"{PROG}: stopped by SIGTERM", file=sys.stderr, flush=True)
        return STOPPED_EXIT
    path = config.out / CSV_NAME
    write_csv_atomic(path, rows, COLUMN_NAMES)
    if not config.quiet:
        print(render(rows), flush=True)
        print(f"{PROG}: {len(rows)} rows -> {path}", flush=True)
    return exit_code(rows, config.fail_on, PROG, case_label)


#: The console table: which split, then the check's own columns.
CELLS = (Cell("split", lambda row: str(row["split"])), *N_AND_K,
         Cell("b", lambda row: str(row["micro_batch"])), STEP, POINT, *VERDICT_CELLS,
         Cell("worst tensors", worst_cell), Cell("fix", fix_cell))


def render(rows: list[dict[str, Any]]) -> str:
    """The console table: a line per split x step x point."""
    return table_render(rows, steps=2, cells=CELLS)
