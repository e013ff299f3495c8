"""The trainers study: do the trainers people install take the big-batch step, as shipped?

Each trainer's own command-line program (harness/studies/trainers/trainers.py) runs
through ``grad-check run``, unchanged, on tiny models and data the study writes offline
(harness/studies/trainers/assets.py), at its splits of one global batch, once as shipped
and once per setting compared. ``grad-check run`` measures and judges each split against
the command's own big-batch step at 1x1; the study keeps its gradient rows, and, where one
differs and ``grad-check run``'s explanation names a cause the study knows, gives that
cause in the trainer's terms with the line of the trainer's installed source that makes
it. A run that fails is a row whose status is its error, not an omission.

Every case starts the trainer's own launcher, which binds its own ports: the cases run
one after another on rank 0 (``--nproc 1`` is enough).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from harness.adapters.registry import installed_version
from harness.context import RunContext
from harness.studies.base import Case, Study
from harness.studies.trainers.assets import WRITERS
from harness.studies.trainers.schema import COLUMNS
from harness.studies.trainers.trainers import TRAINERS, Setting, Trainer
from harness.verdicts import Equivalence, Status

INSTALL_HINT = "pip install torch==2.13.0 -e '.[trainers]'"
#: torchrun's variables of the study's own rank: a trainer's launcher must start afresh.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                  "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                  "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS")
#: One trainer run may take this long before grad-check stops it (seconds).
RUN_TIMEOUT = 300


#: The project's example programs, which some trainers run: in a clone (or an editable
#: install), beside the package.
SCRIPTS = Path(__file__).resolve().parents[3] / "examples" / "scripts"


def missing(trainer: Trainer) -> str | None:
    """Why ``trainer`` cannot run here (its package is not installed, or the example
    programs it runs are not beside the package), or None."""
    if importlib.util.find_spec(trainer.module) is None:
        return f"unavailable: {trainer.distribution} is not installed; {INSTALL_HINT}"
    if any("{scripts}" in part for part in trainer.command) and not SCRIPTS.is_dir():
        return f"unavailable: no {SCRIPTS}: run the study from a clone of the project"
    return None


def grad_check_argv(trainer: Trainer, setting: Setting, assets: Path, out: Path) -> list[str]:
    """``grad-check run`` on the trainer's command at ``setting``, its files filled in."""
    command = [part.replace("{assets}", str(assets)).replace("{scripts}", str(SCRIPTS))
               for part in trainer.argv(setting)]
    return [sys.executable, "-m", "harness.grad_check", "run", "--quiet", "--steps", "1",
            "--global-batch", str(trainer.global_batch), "--splits", ",".join(trainer.splits),
            "--timeout", str(RUN_TIMEOUT), "--out", str(out), "--", *command]


def run_grad_check(trainer: Trainer, setting: Setting, folder: Path
                   ) -> tuple[pd.DataFrame, str]:
    """The gradient rows ``grad-check run`` wrote for the trainer at ``setting`` (none
    where it wrote no CSV), and its last line on stderr (its one-line error, if any)."""
    assets = WRITERS[trainer.assets](folder / "assets") if trainer.assets else folder
    out = folder / "check"
    env = {name: value for name, value in os.environ.items() if name not in RANK_VARIABLES}
    ended = subprocess.run(grad_check_argv(trainer, setting, assets, out), cwd=folder,
                           env={**env, **trainer.env}, capture_output=True, text=True,
                           check=False)
    lines = ended.stderr.strip().splitlines()
    csv = out / "script.csv"
    rows = pd.read_csv(csv, keep_default_na=False) if csv.exists() else pd.DataFrame()
    return (rows[rows["point"] == "grad"] if not rows.empty else rows,
            portable(lines[-1]) if lines else f"grad-check exited with {ended.returncode}")


def portable(line: str) -> str:
    """``grad-check run``'s one-line error as every machine writes it: without its prefix,
    the temporary folder of its logs, and the folder packages are installed in."""
    line = line.removeprefix("grad-check run: ").removeprefix("error: ")
    line = re.sub(r" \(its output: [^)]*\)", "", line)
    return re.sub(r"[^\s(]*/(site|dist)-packages/", "", line)


class TrainersStudy(Study):
    name = "trainers"
    summary = ("torchtune, TRL and the other trainers people install, each run by its own "
               "command line through grad-check run at several splits of one global batch: "
               "as shipped, is the first step the big batch's, and if not, why?")
    example = "python scripts/study.py --nproc 1 --studies trainers"
    columns = COLUMNS
    #: Minutes of trainer runs, and trainers the base install lacks.
    in_default_run = False

    def unavailable(self) -> str | None:
        if all(missing(trainer) for trainer in TRAINERS.values()):
            return f"none of the trainers is installed; {INSTALL_HINT}"
        return None

    def cases(self, run: RunContext) -> list[Case]:
        # collective with one participant: on rank 0, one after another (each binds ports).
        return [Case.of(self.name, participants=1, collective=True, trainer=trainer.name,
                        setting=setting.name, cost=10.0)
                for trainer in TRAINERS.values()
                for setting in (trainer.settings if not missing(trainer) else
                                trainer.settings[:1])]

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        trainer = TRAINERS[case["trainer"]]
        setting = trainer.setting(case["setting"])
        if reason := missing(trainer):
            return [failed_row(trainer, setting, reason)]
        with tempfile.TemporaryDirectory(prefix="grad-study-trainer-") as folder:
            rows, last_line = run_grad_check(trainer, setting, Path(folder))
        if rows.empty:
            return [failed_row(trainer, setting, f"error: {last_line}")]
        return [split_row(trainer, setting, row) for row in rows.to_dict("records")]

    def summary_table(self, frame: pd.DataFrame) -> str:
        return frame[["trainer", "setting", "split", "verdict", "residual", "status"]
                     ].to_string(index=False)


def _common(trainer: Trainer, setting: Setting) -> dict[str, Any]:
    return {"trainer": trainer.name, "trainer_version": installed_version(trainer.distribution)
            if not missing(trainer) else "", "setting": setting.name,
            "global_batch": trainer.global_batch, "cpu_args": " ".join(trainer.cpu_args),
            "command": " ".join(trainer.argv(setting))}


def split_row(trainer: Trainer, setting: Setting, measured: dict[str, Any]) -> dict[str, Any]:
    """One split's row: ``grad-check run``'s measurement, and the cause where its own
    explanation (or the run's error) names one the study knows."""
    error = measured["error"]
    cause = trainer.cause_of(error or measured["fix"]) \
        if error or measured["verdict"] != Equivalence.MATCHES else None
    return {**_common(trainer, setting),
            **{name: measured[name] for name in ("split", "world_size", "accum_steps",
                                                  "micro_batch", "verdict", "scale",
                                                  "residual", "precision")},
            "cause": cause.text if cause else "",
            "source": cause.source.located() if cause else "",
            "fix": cause.fix if cause else measured["fix"],
            "status": f"error: {error}" if error else measured["status"]}


def failed_row(trainer: Trainer, setting: Setting, status: str) -> dict[str, Any]:
    """The row of a case that measured nothing: why, in its status, and the cause where the
    error names one the study knows."""
    cause = trainer.cause_of(status)
    return {**_common(trainer, setting), "split": "", "world_size": math.nan,
            "accum_steps": math.nan, "micro_batch": math.nan, "verdict": "",
            "scale": math.nan, "residual": math.nan, "precision": "",
            "cause": cause.text if cause else "",
            "source": cause.source.located() if cause else "",
            "fix": cause.fix if cause else "", "status": status}


__all__ = ["Status", "TrainersStudy"]
