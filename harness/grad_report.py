"""The command line of ``scripts/report.py`` (``grad-report``): regenerate REPORT.md from a
results folder, with the studies' catalogue (the report itself imports no study)."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from pathlib import Path

from harness.errors import UsageError, refuse
from harness.options import CommandParser

PROG = "report.py"


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Write REPORT.md and figures/*.png into a results folder of scripts/study.py,
            from its run.json and CSVs. The run's own REPORT.md is written the same way
            at the end of a study run (unless --no-report); use this to regenerate it,
            e.g. after editing the report code or on results copied from another machine.
            A folder that is not a finished run stops with one line and exit code 2,
            before anything is written."""),
        epilog=textwrap.dedent("""\
            examples:
              python scripts/report.py results/
              python scripts/report.py /scratch/run-42      # any --out folder of study.py
            """),
    )
    parser.add_argument("folder", nargs="?", default="results", metavar="FOLDER",
                        help="results folder holding run.json and the study CSVs "
                             "(default: results)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from harness.report import write_report
    from harness.studies import catalogue

    try:
        target = write_report(Path(build_parser().parse_args(argv).folder), catalogue())
    except UsageError as error:
        return refuse(error, rank=0, prog=PROG)
    print(f"{PROG}: wrote {target}")
    return 0
