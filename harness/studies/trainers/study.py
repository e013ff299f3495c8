"""The trainers study: do the trainers people install take the big-batch step, as shipped?

Each trainer's own command-line program (harness/studies/trainers/trainers.py) runs
through ``grad-check run``, unchanged, on tiny models and data the study writes offline
(harness/studies/trainers/assets.py), at its splits of one global batch, once as shipped
and once per setting compared. ``grad-check run`` measures and judges each split against
the command's own big-batch step at 1x1; the study keeps its gradient rows, and, where one
differs and the cause ``grad-check run`` named (its id) is one the study knows of the
trainer, gives that cause in the trainer's terms with the line of the trainer's installed
source that makes it. A run that fails is a row whose status is its error, not an
omission, and its cause is the study's where ``failures.json``'s fields (the reference's
unusable id, the error's type and file) are a failure the study knows.

Every case starts the trainer's own launcher, which binds its own ports: the cases run
one after another on rank 0 (``--nproc 1`` is enough).
"""

from __future__ import annotations

import importlib.util
import math
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness.adapters.registry import distribution_version
from harness.context import RunContext
from harness.errors import UsageError
from harness.grad_check.script.failures import CheckFailures, RunFailure
from harness.grad_check.script.launchers import adapted, launcher_of, visible_gpus
from harness.grad_check.script.script_config import CSV_NAME, FAILURES_NAME
from harness.grad_check.script.splits import Split, substituted
from harness.options import StudyOptions, option, parse_name_list
from harness.studies.base import Case, Study
from harness.studies.trainers.environment import (
    SCRIPTS,
    environment,
    filled,
    interpreter,
    site_packages,
    write_assets,
)
from harness.studies.trainers.environment import installed_version as environment_version
from harness.studies.trainers.schema import COLUMNS
from harness.studies.trainers.trainers import (
    DEFAULT,
    NOT_INSTALLED,
    TRAINERS,
    TRAINERS_INSTALL,
    Cause,
    Setting,
    Trainer,
)
from harness.verdicts import Equivalence, Status

INSTALL_HINT = TRAINERS_INSTALL
#: One trainer run may take this long before grad-check stops it (seconds).
RUN_TIMEOUT = 300


def version(trainer: Trainer) -> str | None:
    """The trainer's installed version where it runs, or None where it is not installed."""
    if trainer.python_variable:
        return environment_version(interpreter(trainer), trainer.distribution)
    if importlib.util.find_spec(trainer.module) is None:
        return None
    return distribution_version(trainer.distribution)


def missing(trainer: Trainer) -> str | None:
    """Why ``trainer`` cannot run here (not installed where it runs, or the example
    programs it runs are not beside the package), or None."""
    if trainer.python_variable and not interpreter(trainer):
        return (f"{NOT_INSTALLED}: {trainer.python_variable} is not set: name the Python of "
                f"an environment of {trainer.distribution}'s own ({trainer.install}; it "
                "cannot share one with the frameworks)")
    if version(trainer) is None and trainer.python_variable:
        return (f"{NOT_INSTALLED}: {trainer.distribution} is not installed in "
                f"{interpreter(trainer)} ({trainer.python_variable}); {trainer.install} "
                "there")
    if version(trainer) is None:
        return f"{NOT_INSTALLED}: {trainer.distribution} is not installed; {trainer.install}"
    if any("{scripts}" in part for part in trainer.command) and not SCRIPTS.is_dir():
        return f"{NOT_INSTALLED}: no {SCRIPTS}: run the study from a clone of the project"
    return None


def grad_check_argv(trainer: Trainer, setting: Setting, assets: Path, out: Path) -> list[str]:
    """``grad-check run`` on the trainer's command at ``setting``, its files filled in, in
    the trainer's interpreter."""
    return [interpreter(trainer), "-m", "harness.grad_check", "run", "--quiet", "--steps", "1",
            "--global-batch", str(trainer.global_batch), "--splits", ",".join(trainer.splits),
            "--timeout", str(RUN_TIMEOUT), "--out", str(out), "--",
            *filled(trainer, setting, assets)]


@dataclass(frozen=True)
class Checked:
    """What one ``grad-check run`` of a trainer at a setting left: its gradient rows (none
    where it wrote no CSV), each with the command line it ran (:func:`recorded`); what
    failed, by its fields (``failures.json``); and its last line on stderr."""

    rows: pd.DataFrame
    failures: CheckFailures
    last_line: str

    def failure_of(self, split: str) -> RunFailure | None:
        """The last failed run of ``split``, where one failed."""
        return next((run for run in reversed(self.failures.runs) if run.split == split), None)


def run_grad_check(trainer: Trainer, setting: Setting, folder: Path) -> Checked:
    """``grad-check run`` on the trainer at ``setting``, in ``folder``: what it left."""
    assets = write_assets(trainer, folder / "assets")
    out = folder / "check"
    ended = subprocess.run(grad_check_argv(trainer, setting, assets, out), cwd=folder,
                           env=environment(trainer), capture_output=True, text=True,
                           check=False)
    lines = ended.stderr.strip().splitlines()
    return Checked(gradient_rows(trainer, out / CSV_NAME, assets), failures_in(out),
                   lines[-1] if lines else f"grad-check exited with {ended.returncode}")


def gradient_rows(trainer: Trainer, csv: Path, assets: Path) -> pd.DataFrame:
    """The gradient rows of ``csv`` (none where there is no such file), each command as
    :func:`recorded` writes it."""
    if not csv.exists():
        return pd.DataFrame()
    rows = pd.read_csv(csv, keep_default_na=False)
    rows = rows[rows["point"] == "grad"].copy()
    rows["command"] = [recorded(trainer, shlex.split(line), assets) for line in rows["command"]]
    return rows


def failures_in(out: Path) -> CheckFailures:
    """What failed in the check that wrote ``out`` (nothing, where it wrote no record)."""
    path = out / FAILURES_NAME
    return CheckFailures.from_json(path.read_text()) if path.exists() else CheckFailures()


def recorded(trainer: Trainer, command: list[str], assets: Path) -> str:
    """``command`` (as ``grad-check run`` ran it: the variables it added, then the command
    with its launcher's added arguments) as a shell types it, the variables the study
    gives the trainer first, and the machine's folders as placeholders: ``{assets}``,
    ``{scripts}``, ``{python}`` (docs/results.md)."""
    folders = {str(assets): "{assets}", str(SCRIPTS): "{scripts}"}
    if trainer.python_variable and interpreter(trainer):
        folders[interpreter(trainer)] = "{python}"
    own = [f"{name}={value}" for name, value in sorted(trainer.env.items())]
    line = shlex.join([*own, *command])
    for folder in sorted(folders, key=len, reverse=True):
        line = line.replace(folder, folders[folder])
    return line


def reference_command(trainer: Trainer, setting: Setting) -> str:
    """The command ``grad-check run`` runs first, the reference 1x1, as :func:`recorded`
    writes it: what a case that measured nothing ran, or would have."""
    one = Split(1, 1)
    # The folders' placeholders stand aside while the split's are filled in.
    folders = {f"{{{name}}}": f"@{name}@" for name in ("assets", "scripts", "python")}
    command = [_replaced(part, folders) for part in trainer.argv(setting)]
    command = substituted(command, one, trainer.global_batch)
    ran, variables = adapted(launcher_of(command), command, one, visible_gpus())
    line = recorded(trainer, [*(f"{name}={variables[name]}" for name in sorted(variables)),
                              *ran], Path("@assets@"))
    return _replaced(line, {mark: name for name, mark in folders.items()})


def _replaced(text: str, names: dict[str, str]) -> str:
    for name, value in names.items():
        text = text.replace(name, value)
    return text


def located(trainer: Trainer, cause: Cause) -> str:
    """Where ``cause`` is in the trainer's source, as installed where it runs."""
    if not trainer.python_variable:
        return cause.source.located()
    return cause.source.located(site_packages(interpreter(trainer), trainer.distribution))


def portable(line: str) -> str:
    """A line of ``grad-check run``'s as every machine writes it: the folder packages are
    installed in left out (a file of a package is named by its path inside it)."""
    return re.sub(r"[^\s(]*/(site|dist)-packages/", "", line)


def failed_line(run: RunFailure) -> str:
    """A failed run's line: its rank's error, by its fields, else the line it said."""
    return portable(run.error.line if run.error else run.line)


def unusable_line(checked: Checked) -> str:
    """Why a check measured nothing: the reference's unusable line as every run says it
    alike, else grad-check's last line (an error before any run: its prefix left out)."""
    if checked.failures.alike:
        return portable(checked.failures.alike)
    return portable(checked.last_line.removeprefix("grad-check run: ").removeprefix("error: "))


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
            checked = run_grad_check(trainer, setting, Path(folder))
        if checked.rows.empty:
            failures = checked.failures
            error = failures.runs[-1].error if failures.runs else None
            return [failed_row(trainer, setting, f"error: {unusable_line(checked)}",
                               trainer.cause_of_failure(failures.unusable, error))]
        return [split_row(trainer, setting, row, checked.failure_of(row["split"]))
                for row in checked.rows.to_dict("records")]

    def summary_table(self, frame: pd.DataFrame) -> str:
        from harness.studies.trainers.report import console_lines

        return console_lines(frame)


def _common(trainer: Trainer, setting: Setting, command: str) -> dict[str, Any]:
    return {"trainer": trainer.name, "trainer_version": version(trainer) or "",
            "setting": setting.name,
            "global_batch": trainer.global_batch, "cpu_args": " ".join(trainer.cpu_args),
            "command": command}


def _explained(trainer: Trainer, cause: Cause | None, fix: str) -> dict[str, str]:
    """A row's cause, its source line and its fix; without a cause, ``fix`` (what
    ``grad-check run`` advised) alone."""
    if cause is None:
        return {"cause": "", "source": "", "fix": fix}
    return {"cause": cause.text, "source": located(trainer, cause), "fix": cause.fix}


def split_row(trainer: Trainer, setting: Setting, measured: dict[str, Any],
              failure: RunFailure | None = None) -> dict[str, Any]:
    """One split's row: ``grad-check run``'s measurement, and the cause where the cause it
    named (or, where the split's run failed, its ``failure``) is one the study knows."""
    if measured["error"]:
        cause = trainer.cause_of_failure("", failure.error if failure else None)
    elif measured["verdict"] != Equivalence.MATCHES:
        cause = trainer.cause_of(measured["cause"])
    else:
        cause = None
    status = (f"error: {failed_line(failure) if failure else portable(measured['error'])}"
              if measured["error"] else measured["status"])
    return {**_common(trainer, setting, measured["command"]),
            **{name: measured[name] for name in ("split", "world_size", "accum_steps",
                                                  "micro_batch", "verdict", "scale",
                                                  "residual", "clip", "clip_factor",
                                                  "precision")},
            "check_cause": measured["cause"],
            **_explained(trainer, cause, measured["fix"]), "status": status}


def failed_row(trainer: Trainer, setting: Setting, status: str,
               cause: Cause | None = None) -> dict[str, Any]:
    """The row of a case that measured nothing: why, in its status, and its cause where the
    study knows it."""
    return {**_common(trainer, setting, reference_command(trainer, setting)), "split": "",
            "world_size": math.nan,
            "accum_steps": math.nan, "micro_batch": math.nan, "verdict": "",
            "scale": math.nan, "residual": math.nan, "clip": "", "clip_factor": math.nan,
            "precision": "", "check_cause": "",
            **_explained(trainer, cause, ""), "status": status}


__all__ = ["Status", "TrainersStudy"]
