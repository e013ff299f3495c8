"""What a cause is: a stable id, what it reads, when it applies, and what it says.

A cause names why a judged row differs from the big batch's step. Each is declared once,
in a module of its own in this package (``CAUSE = Cause(...)``), as each collective of
nccl-tests is a file of its own filling the driver's struct; the judge's order is the one
ordered list in ``__init__.py``. A row's ``cause`` cell is its cause's ``id`` (stable:
what a study or a user's CI matches, never the prose of its ``fix``); a row no cause
explains has none.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from harness.check.causes.evidence import Evidence

#: What an id is written as: lower-case words joined by '-'.
_ID = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


@dataclass(frozen=True)
class Cause:
    """One cause of a difference from the big batch's step."""

    #: Its name in a row's ``cause`` column: stable, declared here once.
    id: str
    #: What it says happened, in a line (docs/architecture.md lists every cause by it).
    summary: str
    #: Whether it explains the row the evidence describes.
    applies: Callable[[Evidence], bool]
    #: The row's ``fix``: what to change, with the numbers the evidence holds.
    fix: Callable[[Evidence], str]
    #: The fields of a rank's step record it reads (harness/grad_check/script/wire.py
    #: ``StepRecord``), where it reads a script's run: what the capture must record for it.
    reads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _ID.fullmatch(self.id):
            raise ValueError(f"cause id {self.id!r}: allowed: lower-case words joined by '-'")


@dataclass(frozen=True)
class Note:
    """What a script's step shows beside a pure scale's fix (the clip that hid it, the
    Trainer's loss contract): said after the cause's fix, never instead of it."""

    id: str
    applies: Callable[[Evidence], bool]
    text: Callable[[Evidence], str]
    reads: tuple[str, ...] = ()


@dataclass(frozen=True)
class Explanation:
    """A row's cause: its id and its fix ("" and "" where none explains the row)."""

    cause: str = ""
    fix: str = ""


#: A row no cause explains.
UNEXPLAINED = Explanation()
