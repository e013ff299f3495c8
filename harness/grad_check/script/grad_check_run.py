"""``grad-check run [options] -- COMMAND...``: the command line of the script mode.

As everywhere in the harness: every check of the input happens before the command first
runs; bad input is one line naming the bad value and what is allowed, exit code 2, and
no ``script.csv`` (an ``--out`` another check is writing into is such input). What only
a run can show (the command refuses its arguments, never steps an optimizer, is not
deterministic) is found on the reference's runs, before any other split runs, and said
in one line with exit code 1, as every finding of a run is. However the check ends (a
reference found unusable, Ctrl-C, SIGTERM), the rows of every split and step that
finished are written, atomically.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.check.outcome import FAIL_ON, Judging, finish
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
from harness.grad_check.script.launchers import LAUNCHER_CHOICES, visible_gpus
from harness.grad_check.script.schema import COLUMN_NAMES, case_label
from harness.grad_check.script.script_config import (
    CSV_NAME,
    DEFAULT_FAIL_ON,
    DEFAULT_STEPS,
    FAILURES_NAME,
    LOGS,
    ScriptConfig,
)
from harness.grad_check.script.splits import PLACEHOLDERS, parse_split, parse_splits
from harness.options import (
    CommandParser,
    check_out_folder,
    parse_float,
    parse_int,
    parse_out,
)

DEFAULT_SPLITS = "1x1,1x2,2x1,2x2"
#: The names the script mode answers to, as the user typed the program.
PROGRAMS = ("grad-check", "check.py")


def program_name() -> str:
    """``grad-check run`` (installed) or ``check.py run`` (``python scripts/check.py``):
    what the user typed, else the installed name."""
    typed = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return f"{typed if typed in PROGRAMS else PROGRAMS[0]} run"


DESCRIPTION = textwrap.dedent("""\
    Does your own training script take the same optimizer step however one global batch
    of G samples is split into N ranks x k micro-steps? COMMAND (after --) runs once per
    split, unchanged: a startup hook captures the gradients each optimizer.step()
    receives and the parameters after it, for the first --steps steps. N > 1 runs N
    processes with torchrun's environment (plain DDP, Accelerate, Lightning, the
    Trainer and DeepSpeed all see a distributed run); N = 1 runs one plain process
    (--torchrun-env: with torchrun's variables too). A COMMAND that begins with a
    launcher (torchrun, python -m torch.distributed.run, accelerate launch, deepspeed,
    trl, tune run with torchrun's options before its recipe) runs once per split and
    starts the N ranks itself: give it {nproc}.
    Each split is compared with the reference split (run twice: it must repeat itself).

    placeholders, substituted in COMMAND at each split:
    """) + "\n".join(f"  {{{name}}}".ljust(18) + meaning
                     for name, meaning in PLACEHOLDERS.items()) + textwrap.dedent("""

    and integer arithmetic over them: {nproc*accum}, {global_batch*1024} (+ - * / //,
    parentheses; / must come out whole). {{ and }} are literal braces. With {batch} and
    {global_batch} in COMMAND, k > 1 needs no {accum}: the script derives it.""")
EPILOG = textwrap.dedent("""\
    examples:
      python scripts/check.py run --global-batch 16 -- \\
          python examples/scripts/ddp_loop.py --batch-size {batch} --grad-accum {accum}
      grad-check run --global-batch 32 --splits 1x1,1x4,2x2,4x1 --steps 3 -- \\
          python train.py --per-device-batch {batch} --accum {accum} --devices {nproc}
      grad-check run --global-batch 8 -- torchrun --standalone --nproc_per_node={nproc} \\
          train.py --batch_size={batch} --gradient_accumulation_steps={nproc*accum}
      grad-check run --global-batch 8 -- python train_gpt2.py --batch_size {batch} \\
          --sequence_length 64 --total_batch_size {global_batch*64}
      grad-check run --global-batch 64 --reference 2x1 --splits 2x1,2x4 --out ci/ -- ...

    A split whose step fed other samples than the reference's is judged by what it
    measured (differs, as a rule); its fix names the samples and their pattern (a batch
    or accumulation argument, a seed per rank, the sampler). Rows: script.csv in --out,
    and a table; every run's output: logs/ in --out. A split that fails names the rank
    that failed first (its line, with the failing file:line, or its exit code or
    signal); one that hangs, the rank that made no progress.
    Exit code: 0; 1 for what a run found: a split errors, a row fails --fail-on, or the
    reference gives nothing to compare with (it fails, refuses its arguments, never steps
    an optimizer, does not repeat itself); 2 for bad input found before the command first
    runs (a flag, a split, an --out another grad-check run is writing into); 130 after
    Ctrl-C, 143 after SIGTERM (the running ranks stopped first). However it ends, the
    rows of the splits and steps that finished are written. No process of a split
    outlives grad-check.
    """)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    prog = prog or program_name()
    parser = CommandParser(prog=prog, usage=f"{prog} [options] -- COMMAND...",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description=DESCRIPTION, epilog=EPILOG)
    _add_split_options(parser)
    _add_outcome_options(parser)
    _add_launch_options(parser)
    parser.add_argument("--quiet", action="store_true",
                        help="no progress lines and no table on the console")
    return parser


def _add_split_options(parser: argparse.ArgumentParser) -> None:
    """What is compared: the global batch, the splits and their reference, the steps."""
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
    parser.add_argument("--reference-once", action="store_true",
                        help="run the reference split once, not twice (unless it is among "
                             "--splits too): faster for a costly script, but one that does not "
                             "repeat itself is then not caught, and its randomness reads as a "
                             "difference of the splits (reference_noise is empty)")
    parser.add_argument("--keep-going", action="store_true",
                        help="let the script run to its end after step S (its own teardown, "
                             "checkpoints, evaluation) instead of stopping it")


def _add_outcome_options(parser: argparse.ArgumentParser) -> None:
    """Where the rows go, what fails the exit code, how long one run may take."""
    parser.add_argument("--out", default="check-results", metavar="DIR",
                        help=f"folder for {CSV_NAME} (default: check-results)")
    parser.add_argument("--fail-on", default=DEFAULT_FAIL_ON, choices=tuple(FAIL_ON),
                        help="exit code 1 when a split errors or compared nothing (always) "
                             "or a row's verdict is 'differs' or 'ranks differ' (differs), "
                             "those or 'scaled' (scaled), or only on those (error); default: "
                             f"{DEFAULT_FAIL_ON}: an unchanged script means no scale")
    add_timeout_flag(parser, "one run of the command")


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    """Who starts a split's ranks, and with which of torchrun's variables."""
    parser.add_argument("--launcher", default="auto", choices=LAUNCHER_CHOICES,
                        help="who starts a split's N ranks: grad-check (N processes of "
                             "COMMAND with torchrun's variables), command (COMMAND runs once "
                             "per split and starts them itself: a launcher, or a CLI that "
                             "spawns its workers; the capture reaches them through the "
                             "environment), or auto (default): command where COMMAND begins "
                             "with torchrun, python -m torch.distributed.run, accelerate "
                             "launch, deepspeed, trl, or tune run given torchrun's options "
                             "before its recipe (tune run RECIPE alone is one plain "
                             "process), else grad-check")
    parser.add_argument("--torchrun-env", action="store_true",
                        help="give N = 1 torchrun's variables too (RANK=0, LOCAL_RANK=0, "
                             "WORLD_SIZE=1, MASTER_ADDR/MASTER_PORT of a store grad-check "
                             "hosts, ...), as N > 1 gets them: for a script that needs them "
                             "even alone ('RANK expected')")


def split_command(argv: list[str], prog: str | None = None) -> tuple[list[str], list[str]]:
    """(the options, the command after the first ``--``)."""
    if "--" not in argv:
        if any(flag in argv for flag in ("-h", "--help")):
            return argv, []
        raise UsageError(f"no -- before the command; allowed: {prog or program_name()} "
                         "[options] -- COMMAND..., e.g. -- python train.py --batch-size "
                         "{batch}")
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def config_from_args(args: argparse.Namespace, command: list[str], gpus: int) -> ScriptConfig:
    """The check the flags ask for, on a machine of ``gpus`` GPUs (:func:`machine_gpus`):
    parsed, and checked by its own rules (ScriptConfig refuses what no machine could run)."""
    return ScriptConfig(command=tuple(command),
                          global_batch=parse_int(args.global_batch, "--global-batch"),
                          splits=parse_splits(args.splits),
                          reference=parse_split(args.reference, "--reference"),
                          steps=parse_int(args.steps, "--steps"), keep_going=args.keep_going,
                          reference_once=args.reference_once,
                          out=parse_out(args.out), fail_on=args.fail_on,
                          timeout=parse_float(args.timeout, "--timeout"), quiet=args.quiet,
                          launcher=args.launcher, torchrun_env=args.torchrun_env,
                          gpus=gpus)


def machine_gpus() -> int:
    """The GPUs a split's ranks may spread over: this node's (as the command's processes
    see them), times the nodes of the Slurm job it runs in."""
    from harness.grad_check.script import slurm

    return visible_gpus() * slurm.nodes()


def main(argv: Sequence[str] | None = None, starter=None) -> int:
    """``grad-check run ...``; ``starter``: how a rank is started (harness/grad_check/
    script/processes.py; a test's may fork instead of starting an interpreter)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = program_name()
    try:
        options, command = split_command(argv, prog)
        config = config_from_args(build_parser(prog).parse_args(options), command,
                                  machine_gpus())
        check_out_folder(config.out)
    except UsageError as error:
        return refuse(error, 0, prog)
    return run(config, starter, prog)


def run(config: ScriptConfig, starter=None, prog: str | None = None) -> int:
    """The check, its --out held for it alone (another check's is refused: bad input); a
    row it cannot write (a disk that filled during the check) ends it in one line, exit 1,
    ``script.csv`` keeping the splits written before."""
    from harness.out_lock import out_lock
    from harness.results import WriteError

    prog = prog or program_name()
    try:
        with out_lock(config.out):
            return checked(config, starter, prog)
    except UsageError as error:
        return refuse(error, 0, prog)
    except WriteError as error:
        print(f"{prog}: error: {error.line()}", file=sys.stderr, flush=True)
        return 1


def checked(config: ScriptConfig, starter, prog: str) -> int:
    from harness.grad_check.script.processes import CommandLauncher, start_subprocess
    from harness.grad_check.script.runs import Interrupted, ScriptCheck
    from harness.grad_check.script.slurm import srun_starter
    from harness.launcher import say_if_oversubscribed

    if not config.gpus and srun_starter() is None:
        say_if_oversubscribed(config.most_ranks, prog)
    launch = CommandLauncher(steps=config.steps, keep_going=config.keep_going,
                             timeout=config.timeout,
                             starter=starter or srun_starter() or start_subprocess,
                             launcher=config.launched_by, torchrun_env=config.torchrun_env,
                             global_batch=config.global_batch)
    say = (lambda line: None) if config.quiet else (
        lambda line: print(f"{prog}: {line}", flush=True))
    check = ScriptCheck(config, launch, say)
    try:
        return ended(config, check, prog)
    except Interrupted as interrupted:
        return ended_early(config, check.finished, prog, interrupted.line,
                           interrupted.exit_code)


def ended(config: ScriptConfig, check, prog: str) -> int:
    """The check run to its end, or to a reference found unusable (one line, exit code 1),
    or to Ctrl-C or SIGTERM caught outside a split's run (raised as Interrupted)."""
    from harness.failure import STOPPED_EXIT
    from harness.grad_check.script.failures import CheckFailures, ReferenceUnusable
    from harness.grad_check.script.runs import Interrupted
    from harness.launcher import Stopped, stopped_by_sigterm

    try:
        with stopped_by_sigterm():
            rows = check.rows()
    except ReferenceUnusable as unusable:
        write_failures(config, CheckFailures(unusable.reason, unusable.alike, str(unusable),
                                             tuple(check.failed)))
        return ended_early(config, check.finished, prog, f"error: {unusable}", 1)
    except KeyboardInterrupt:
        raise Interrupted(INTERRUPTED_EXIT, "interrupted") from None
    except Stopped:
        raise Interrupted(STOPPED_EXIT, "stopped by SIGTERM") from None
    write_failures(config, CheckFailures(runs=tuple(check.failed)))
    return finish(rows, config.out / CSV_NAME, COLUMN_NAMES,
                  Judging(config.fail_on, prog, case_label),
                  None if config.quiet else render(rows),
                  where_else=f"; every run's output in {config.out / LOGS}")


def ended_early(config: ScriptConfig, rows: list[dict[str, Any]], prog: str, line: str,
                code: int) -> int:
    """The rows of the splits and steps that finished, written; then ``line`` alone on
    stderr, and ``code``."""
    if rows:
        path = write_rows(config, rows)
        line += f" ({len(rows)} rows, every step that finished and where it stopped -> {path})"
    print(f"{prog}: {line}", file=sys.stderr, flush=True)
    return code


def write_failures(config: ScriptConfig, failures) -> None:
    """``failures.json`` in --out where anything failed (what a program reading the check
    reads, by fields); an earlier check's removed where nothing did."""
    from harness.results import write_text_atomic

    path = config.out / FAILURES_NAME
    if failures.unusable or failures.runs:
        write_text_atomic(path, failures.to_json())
    else:
        path.unlink(missing_ok=True)


def write_rows(config: ScriptConfig, rows: list[dict[str, Any]]) -> Path:
    from harness.results import write_csv_atomic

    path = config.out / CSV_NAME
    write_csv_atomic(path, rows, COLUMN_NAMES)
    return path


#: The console table: which split, then the check's own columns; the optimizer where the
#: script steps several, the clip where one ran.
OPTIMIZER = Cell("optimizer", lambda row: str(row["optimizer"]))
CLIP = Cell("clip", lambda row: str(row["clip"] or ""))
CELLS = (Cell("split", lambda row: str(row["split"])), *N_AND_K,
         Cell("b", lambda row: str(row["micro_batch"])), OPTIMIZER, STEP, POINT,
         *VERDICT_CELLS, CLIP, Cell("worst tensors", worst_cell), Cell("fix", fix_cell))
#: What a row's fix cell says where it would repeat the gradient's row above it.
SAME_FIX = "(as for the gradient)"


def render(rows: list[dict[str, Any]]) -> str:
    """The console table: a line per split x optimizer x step x point; a fix said once per
    split, optimizer and step."""
    optimizers = {row["optimizer"] for row in rows}
    clipped = any(row["clip"] for row in rows if isinstance(row["clip"], str))
    cells = [cell for cell in CELLS if (cell is not OPTIMIZER or len(optimizers) > 1)
             and (cell is not CLIP or clipped)]
    return table_render(said_once(rows), steps=2, cells=cells)


def said_once(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows, a fix equal to the one of the row above it (the gradient's, at the same
    split, optimizer and step) written as :data:`SAME_FIX`."""
    shown, above = [], None
    for row in rows:
        key = (row["split"], row["optimizer"], row["step"])
        if above is not None and above[0] == key and row["fix"] and row["fix"] == above[1]:
            row = {**row, "fix": SAME_FIX}
        shown.append(row)
        above = (key, rows[len(shown) - 1]["fix"])
    return shown
