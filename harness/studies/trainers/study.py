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
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness.adapters.registry import installed_version
from harness.context import RunContext
from harness.errors import UsageError
from harness.options import StudyOptions, option, parse_name_list
from harness.studies.base import Case, Study
from harness.studies.trainers.environment import (
    ROOT,
    environment,
    interpreter,
    site_packages,
    write_assets,
)
from harness.studies.trainers.environment import installed_version as environment_version
from harness.studies.trainers.schema import COLUMNS
from harness.studies.trainers.trainers import DEFAULT, TRAINERS, Cause, Setting, Trainer
from harness.verdicts import Equivalence, Status

INSTALL_HINT = "pip install torch==2.13.0 -e '.[trainers]'"
#: One trainer run may take this long before grad-check stops it (seconds).
RUN_TIMEOUT = 300
#: The project's example programs, which some trainers run: in a clone (or an editable
#: install), beside the package.
SCRIPTS = ROOT / "examples" / "scripts"


def version(trainer: Trainer) -> str | None:
    """The trainer's installed version where it runs, or None where it is not installed."""
    if trainer.python_variable:
        return environment_version(interpreter(trainer), trainer.distribution)
    if importlib.util.find_spec(trainer.module) is None:
        return None
    return installed_version(trainer.distribution)


def missing(trainer: Trainer) -> str | None:
    """Why ``trainer`` cannot run here (not installed where it runs, or the example
    programs it runs are not beside the package), or None."""
    if trainer.python_variable and not interpreter(trainer):
        return (f"unavailable: {trainer.python_variable} is not set: name the Python of an "
                f"environment of {trainer.distribution}'s own (pip install torch==2.13.0 -e "
                f"'.[{trainer.distribution}]'; it cannot share one with the frameworks)")
    if version(trainer) is None and trainer.python_variable:
        return (f"unavailable: {trainer.distribution} is not installed in "
                f"{interpreter(trainer)} ({trainer.python_variable}); pip install "
                f"torch==2.13.0 -e '.[{trainer.distribution}]' there")
    if version(trainer) is None:
        return f"unavailable: {trainer.distribution} is not installed; {INSTALL_HINT}"
    if any("{scripts}" in part for part in trainer.command) and not SCRIPTS.is_dir():
        return f"unavailable: no {SCRIPTS}: run the study from a clone of the project"
    return None


def grad_check_argv(trainer: Trainer, setting: Setting, assets: Path, out: Path) -> list[str]:
    """``grad-check run`` on the trainer's command at ``setting``, its files filled in, in
    the trainer's interpreter."""
    python = interpreter(trainer)
    command = [part.replace("{assets}", str(assets)).replace("{scripts}", str(SCRIPTS))
               .replace("{python}", python) for part in trainer.argv(setting)]
    return [python, "-m", "harness.grad_check", "run", "--quiet", "--steps", "1",
            "--global-batch", str(trainer.global_batch), "--splits", ",".join(trainer.splits),
            "--timeout", str(RUN_TIMEOUT), "--out", str(out), "--", *command]


def run_grad_check(trainer: Trainer, setting: Setting, folder: Path
                   ) -> tuple[pd.DataFrame, str]:
    """The gradient rows ``grad-check run`` wrote for the trainer at ``setting`` (none
    where it wrote no CSV), and its last line on stderr (its one-line error, if any)."""
    assets = write_assets(trainer, folder / "assets")
    out = folder / "check"
    ended = subprocess.run(grad_check_argv(trainer, setting, assets, out), cwd=folder,
                           env=environment(trainer), capture_output=True, text=True,
                           check=False)
    lines = ended.stderr.strip().splitlines()
    csv = out / "script.csv"
    rows = pd.read_csv(csv, keep_default_na=False) if csv.exists() else pd.DataFrame()
    return (rows[rows["point"] == "grad"] if not rows.empty else rows,
            portable(lines[-1]) if lines else f"grad-check exited with {ended.returncode}")


def located(trainer: Trainer, cause: Cause) -> str:
    """Where ``cause`` is in the trainer's source, as installed where it runs."""
    if not trainer.python_variable:
        return cause.source.located()
    return cause.source.located(site_packages(interpreter(trainer), trainer.distribution))


def portable(line: str) -> str:
    """``grad-check run``'s one-line error as every machine and run writes it: without its
    prefix, the temporary folder of its logs, the folder packages are installed in, which
    rank said it first (the trainers' ranks fail alike: which one is first is a race), and
    how far a run that does not repeat itself strayed (a random number)."""
    line = line.removeprefix("grad-check run: ").removeprefix("error: ")
    line = re.sub(r"(^|: )rank \d+: ", r"\1", line)
    # How far two runs of a trainer that does not repeat itself fell apart is itself random.
    line = re.sub(r"differed \([^ ]+ relative, beyond", "differed (beyond", line)
    line = re.sub(r" \(its output: [^)]*\)", "", line)
    return re.sub(r"[^\s(]*/(site|dist)-packages/", "", line)


#: ``--trainer-settings``: every setting compared, or each trainer as shipped alone.
SETTINGS = ("all", DEFAULT)


#: ``--trainers``' word for every trainer.
EVERY = "all"


@dataclass(frozen=True)
class TrainersOptions(StudyOptions):
    trainers: tuple[str, ...] = field(default=(EVERY,), metadata=option(
        "--trainers", "NAME[,NAME]", "trainers the trainers study runs: all, or of "
        + ", ".join(TRAINERS), parse=parse_name_list))
    settings: str = field(default="all", metadata=option(
        "--trainer-settings", "{all,default}", "the trainers study's settings: 'all', every "
        "one compared; 'default', each trainer as shipped alone (the quick form)"))

    def __post_init__(self) -> None:
        unknown = [name for name in self.trainers if name not in TRAINERS]
        if self.trainers != (EVERY,) and (unknown or not self.trainers):
            raise UsageError(f"--trainers {','.join(self.trainers)!r}: "
                             f"{', '.join(unknown) or 'none named'}; allowed: all, or "
                             f"comma-separated names of {', '.join(TRAINERS)}")
        if self.settings not in SETTINGS:
            raise UsageError(f"--trainer-settings {self.settings!r}; allowed: "
                             f"{', '.join(SETTINGS)}")

    @property
    def chosen(self) -> list[Trainer]:
        """The trainers named, in the study's order."""
        return [trainer for key, trainer in TRAINERS.items()
                if self.trainers == (EVERY,) or key in self.trainers]


class TrainersStudy(Study):
    name = "trainers"
    summary = ("torchtune, TRL and the other trainers people install, each run by its own "
               "command line through grad-check run at several splits of one global batch: "
               "as shipped, is the first step the big batch's, and if not, why?")
    example = "python scripts/study.py --nproc 1 --studies trainers"
    columns = COLUMNS
    Options = TrainersOptions
    #: Minutes of trainer runs, and trainers the base install lacks.
    in_default_run = False

    def unavailable(self) -> str | None:
        if all(missing(trainer) for trainer in TRAINERS.values()):
            return f"none of the trainers is installed; {INSTALL_HINT}"
        return None

    def cases(self, run: RunContext) -> list[Case]:
        # collective with one participant: on rank 0, one after another (each binds ports).
        every = self.options.settings == "all"
        return [Case.of(self.name, participants=1, collective=True, trainer=trainer.key,
                        setting=setting.name, cost=10.0)
                for trainer in self.options.chosen
                for setting in (trainer.settings if every and not missing(trainer) else
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
    return {"trainer": trainer.name, "trainer_version": version(trainer) or "",
            "setting": setting.name,
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
            "source": located(trainer, cause) if cause else "",
            "fix": cause.fix if cause else measured["fix"],
            "status": f"error: {portable(error)}" if error else measured["status"]}


def failed_row(trainer: Trainer, setting: Setting, status: str) -> dict[str, Any]:
    """The row of a case that measured nothing: why, in its status, and the cause where the
    error names one the study knows."""
    cause = trainer.cause_of(status)
    return {**_common(trainer, setting), "split": "", "world_size": math.nan,
            "accum_steps": math.nan, "micro_batch": math.nan, "verdict": "",
            "scale": math.nan, "residual": math.nan, "precision": "",
            "cause": cause.text if cause else "",
            "source": located(trainer, cause) if cause else "",
            "fix": cause.fix if cause else "", "status": status}


__all__ = ["Status", "TrainersStudy"]
