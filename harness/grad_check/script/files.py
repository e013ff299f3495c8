"""Where a run's capture lies on disk: each rank's summary (written whole under a temporary
name, then renamed) and, in the reference's first run, one tensor file per optimizer,
step and point."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def summary_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.pt"


def partial_file(folder: Path, rank: int) -> Path:
    """What a rank captured up to its last finished step, until its summary replaces it."""
    return folder / f"rank{rank}.partial.pt"


def tensors_file(folder: Path, optimizer: int, step: int, point: str) -> Path:
    """The stem of one optimizer's tensor file (harness/check/shards.py, written by the
    reference's ranks): ``initial`` (its parameters before its step 0), or a step's
    ``grad`` or ``params``."""
    stem = "initial" if point == "initial" else f"step{step}.{point}"
    return folder / f"optimizer{optimizer}.{stem}"


def save_atomically(value: Any, path: Path) -> None:
    """``torch.save`` under a temporary name, then renamed: a reader never sees half."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(value, temporary)
    os.replace(temporary, path)
