"""Reading a results folder, and refusing a malformed one before anything is written.

The report describes one run: the studies ``run.json`` lists. A CSV in the
folder that the manifest does not list comes from another run (an older one in
the same ``--out``) and is named in the report but not summarized, so that no
number from another run is presented under this run's header.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.errors import UsageError
from harness.results import MANIFEST

if TYPE_CHECKING:
    import pandas as pd

    from harness.report.section import Section

#: harness/tolerances.py's RELATIVE_TOLERANCE by dtype name: the report draws it (figures,
#: captions) without importing torch, which that module's keys need; a test keeps them equal.
TOLERANCES = {"float64": 1e-9, "float32": 1e-4}
#: Columns every study's CSV has (docs/results.md), that the report relies on.
COMMON_COLUMNS = ("study", "case_id", "status")


class ReportError(UsageError):
    """The folder cannot be reported on: the message names the file and what is wrong."""


@dataclass
class RunResults:
    """One run's manifest and the CSVs of its studies."""

    out: Path
    manifest: dict[str, Any]
    #: Study -> its rows, for every study of the run that has a report section.
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    #: Study -> number of rows, for studies of the run without a report section (yet).
    unsummarized: dict[str, int] = field(default_factory=dict)
    #: CSVs in the folder that the run did not write.
    foreign_csvs: list[str] = field(default_factory=list)

    @property
    def dtype(self) -> str:
        return str(self.manifest.get("dtype", "float64"))

    def csv_name(self, study: str) -> str:
        return csv_name(self.manifest, study)


def csv_name(manifest: dict[str, Any], study: str) -> str:
    """The CSV the manifest names for ``study`` (``<study>.csv`` when it names none)."""
    entry = manifest["studies"].get(study)
    name = entry.get("csv") if isinstance(entry, dict) else None
    return name if isinstance(name, str) and name else f"{study}.csv"


def load_results(out: Path, manifest: dict[str, Any], sections: Mapping[str, Section]
                 ) -> RunResults:
    """The run in ``out`` (``manifest`` from :func:`read_manifest`); ReportError if malformed."""
    results = RunResults(out=out, manifest=manifest)
    studies = manifest["studies"]
    for study in studies:
        section = sections.get(study)
        required = COMMON_COLUMNS + (_read_by(section) if section else ())
        frame = _read_csv(out / csv_name(manifest, study), required)
        if section:
            results.frames[study] = frame
        else:
            results.unsummarized[study] = len(frame)
    listed = {csv_name(manifest, study) for study in studies}
    results.foreign_csvs = sorted(p.name for p in out.glob("*.csv") if p.name not in listed)
    _check_dtype(results.dtype)
    return results


def _read_by(section: Section) -> tuple[str, ...]:
    """The columns ``section`` reads: those it names, else its study's whole schema."""
    from harness.studies import study_columns
    from harness.studies.schema import names

    return section.columns or names(study_columns(section.study))


def read_manifest(out: Path) -> dict[str, Any]:
    """``out/run.json``, checked; ReportError when ``out`` is not the folder of a finished run."""
    if not out.exists():
        raise ReportError(f"{str(out)!r} does not exist; give the --out folder of a study run")
    if not out.is_dir():
        raise ReportError(f"{str(out)!r} is not a folder; give the --out folder of a study run")
    path = out / MANIFEST
    if not path.exists():
        what = "is empty" if not any(out.iterdir()) else f"has no {MANIFEST}"
        raise ReportError(f"{str(out)!r} {what}; a finished run of scripts/study.py writes "
                          f"{MANIFEST} next to its CSVs")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ReportError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("studies"), dict):
        raise ReportError(f"{path}: has no 'studies' object naming the run's studies and CSVs")
    if not manifest["studies"]:
        raise ReportError(f"{path}: lists no studies")
    return manifest


def _read_csv(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    import pandas as pd

    if not path.exists():
        raise ReportError(f"{path}: missing, although {MANIFEST} lists it")
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise ReportError(f"{path}: empty file; expected a header and one row per case") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as error:
        first_line = str(error).strip().splitlines()[0]
        raise ReportError(f"{path}: not a readable CSV ({first_line})") from None
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise ReportError(f"{path}: missing column(s) {', '.join(missing)} that the report reads")
    # Only the declared columns: a section cannot read what it did not declare, and every
    # row selection copies less.
    return frame[list(dict.fromkeys(required))]


def _check_dtype(dtype: str) -> None:
    if dtype not in TOLERANCES:
        raise ReportError(f"{MANIFEST}: dtype {dtype!r} is unknown; allowed: "
                          + ", ".join(TOLERANCES))


def tolerance(dtype: str) -> float:
    """The relative tolerance the study judged its verdicts with, for the run's dtype."""
    return TOLERANCES[dtype]
