"""What README.md and docs/ quote from the committed results, and how a quoted sentence
refuses rows that no longer show it.

Each study's ``report.py`` declares the parts of README.md and docs/ it generates
(``DOC_PARTS``: the name of a ``<!-- generated: NAME -->`` block, and a function of
:class:`Results` giving its text); :mod:`harness.report.docs` collects them. A part
that states a verdict first checks, with :func:`require`, that the rows still show it.

Reads CSVs and JSON only (no torch), like the report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness.manifest import RunManifest, read_manifest

if TYPE_CHECKING:
    import pandas as pd


class Unsupported(Exception):
    """A generated sentence whose premise the rows no longer show."""


@dataclass(frozen=True)
class Results:
    """The committed results the documents quote: the default run and the frameworks run."""

    folder: Path

    def csv(self, name: str, sub: str = "") -> pd.DataFrame:
        import pandas as pd

        return pd.read_csv(self.folder / sub / f"{name}.csv")

    def manifest(self, sub: str = "") -> RunManifest:
        return read_manifest(self.folder / sub)


#: A generated part: its text, from the results it quotes.
DocPart = Callable[[Results], str]


def require(holds: bool, sentence: str, rows: str) -> None:
    if not holds:
        raise Unsupported(f"the rows no longer show {sentence!r} ({rows}); reword the hand-"
                          f"written text around it or look into the run")


def share(rows: pd.DataFrame, mask: pd.Series) -> str:
    """``all 81`` or ``3 of 81``: how many of ``rows`` ``mask`` holds for."""
    return f"all {len(rows)}" if mask.all() else f"{int(mask.sum())} of {len(rows)}"
