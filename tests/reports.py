"""The committed results folders' reports, rendered afresh once per test session.

In a fresh interpreter, which must not import torch to render one: a report is
read from CSVs alone (tests/test_verdict_columns.py). Once per session, shared by
every test and xdist worker that reads it: drawing the figures is seconds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from tests.distributed import shared_folder

ROOT = Path(__file__).resolve().parent.parent
RENDER = """\
import json, sys
from harness.report import write_report
from harness.studies import STUDY_PACKAGES, catalogue, report_section
assert all(report_section(name) is not None for name in STUDY_PACKAGES)
write_report(sys.argv[1], catalogue())
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


@dataclass(frozen=True)
class Rendered:
    #: A copy of the committed folder, its REPORT.md and figures rendered from its CSVs.
    folder: Path
    #: The torch modules the rendering interpreter had imported by its end.
    torch_modules: list[str]
    stderr: str


def committed_report(tmp_path_factory, name: str) -> Rendered:
    """The report of ``name`` (``results``, ``results/frameworks``), rendered from a copy of
    its CSVs and run.json (not its REPORT.md, figures or nested folders)."""
    shared = shared_folder(tmp_path_factory)
    key = "committed-" + name.replace("/", "-")
    copy, summary = shared / key, shared / f"{key}.json"
    with FileLock(str(shared / f"{key}.lock")):
        if not summary.exists():
            shutil.copytree(ROOT / name, copy, ignore=shutil.ignore_patterns(
                "figures", "REPORT.md", "frameworks", "trainers"))
            done = subprocess.run([sys.executable, "-c", RENDER, str(copy)], capture_output=True,
                                  text=True, cwd=ROOT)
            assert done.returncode == 0, done.stderr
            summary.write_text(json.dumps({"torch_modules": json.loads(done.stdout),
                                           "stderr": done.stderr}))
    rendered = json.loads(summary.read_text())
    return Rendered(copy, rendered["torch_modules"], rendered["stderr"])
