"""Where a trainer runs: this interpreter, or the Python of an environment of its own.

Most trainers share one environment (the ``[trainers]`` extra). One that cannot (its
pins conflict with another's: LitGPT 0.5.13 wants huggingface-hub < 1.4, transformers
5.23 >= 1.31) runs from the interpreter its ``python_variable`` names, with the project
on its path: ``grad-check run``, the assets and the version are all read there, so every
number of its rows comes from the environment it ran in.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from harness.grad_check.script.processes import TORCHRUN_VARIABLES
from harness.studies.trainers.trainers import Setting, Trainer

#: The project's root: another interpreter imports the harness from it.
ROOT = Path(__file__).resolve().parents[3]
#: The project's example programs, which some trainers run: in a clone (or an editable
#: install), beside the package.
SCRIPTS = ROOT / "examples" / "scripts"
#: What a trainer's launcher must not inherit from the study's own rank: torchrun's
#: variables (it starts afresh), and the rank's thread count (a trainer picks its own).
RANK_VARIABLES = (*TORCHRUN_VARIABLES, "OMP_NUM_THREADS")


def interpreter(trainer: Trainer) -> str:
    """The Python the trainer runs with: its own environment's where it names one."""
    return os.environ.get(trainer.python_variable, "") if trainer.python_variable \
        else sys.executable


def filled(trainer: Trainer, setting: Setting, assets: Path) -> list[str]:
    """The trainer's command at ``setting``, its files and interpreter filled in; the
    split's placeholders (``{batch}``, ``{nproc}``, ...) left for ``grad-check run``."""
    return [part.replace("{assets}", str(assets)).replace("{scripts}", str(SCRIPTS))
            .replace("{python}", interpreter(trainer)) for part in trainer.argv(setting)]


def environment(trainer: Trainer) -> dict[str, str]:
    """The environment of a trainer's processes: this one's, without the study's own
    rank variables, with the project importable and the trainer's own settings."""
    env = {name: value for name, value in os.environ.items() if name not in RANK_VARIABLES}
    path = os.pathsep.join(part for part in (str(ROOT), env.get("PYTHONPATH", "")) if part)
    # An environment of the trainer's own, as if activated: its programs (`yolo`) first.
    programs = os.pathsep.join(part for part in (
        str(Path(interpreter(trainer)).parent) if trainer.python_variable else "",
        env.get("PATH", "")) if part)
    return {**env, "PYTHONPATH": path, "PATH": programs, **trainer.env}


@functools.cache
def installed_version(python: str, distribution: str) -> str | None:
    """``distribution``'s version as ``python`` has it installed, or None."""
    if not python:
        return None
    try:
        ended = subprocess.run(
            [python, "-c", "import importlib.metadata, sys\ntry:\n    print(importlib."
             f"metadata.version({distribution!r}))\nexcept importlib.metadata."
             "PackageNotFoundError:\n    sys.exit(1)"], capture_output=True, text=True,
            check=False)
    except OSError:  # no such interpreter
        return None
    return ended.stdout.strip() if ended.returncode == 0 else None


@functools.cache
def site_packages(python: str, distribution: str) -> Path | None:
    """The folder ``python``'s environment installs ``distribution`` in, or None."""
    ended = subprocess.run(
        [python, "-c", "import importlib.metadata\nprint(importlib.metadata.distribution("
         f"{distribution!r}).locate_file(''))"], capture_output=True, text=True, check=False)
    return Path(ended.stdout.strip()) if ended.returncode == 0 else None


def write_assets(trainer: Trainer, folder: Path) -> Path:
    """The trainer's assets, written by its own interpreter (harness/studies/trainers/
    assets.py), into ``folder``; ``folder`` itself for a trainer that reads none."""
    if trainer.assets is None:
        return folder
    subprocess.run([interpreter(trainer), "-m", "harness.studies.trainers.assets",
                    trainer.assets, str(folder)], env=environment(trainer), check=True,
                   capture_output=True)
    return folder
