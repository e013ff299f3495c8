"""Reading a results folder, and refusing a malformed one before anything is written.

The report describes one run: the studies ``run.json`` lists. A CSV in the
folder that the manifest does not list comes from another run (an older one in
the same ``--out``) and is named in the report but not summarized, so that no
number from another run is presented under this run's header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harness.columns import TRAILING_COLUMNS, names
from harness.manifest import ManifestError, RunManifest
from harness.results import MANIFEST
from harness.tolerances import RELATIVE_TOLERANCE

if TYPE_CHECKING:
    import pandas as pd

    from harness.report.catalogue import ReportedStudy

#: Columns every study's CSV has (docs/results.md), that the report relies on.
COMMON_COLUMNS = ("study", "case_id", "status")


class ReportError(ManifestError):
    """The folder cannot be reported on: the message names the file and what is wrong."""


@dataclass
class RunResults:
    """One run's manifest and the CSVs of its studies."""

    out: Path
    manifest: RunManifest
    #: CSV name -> its rows, for every CSV of the studies of the run that have a report section.
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    #: Study -> number of rows, for studies of the run without a report section (yet).
    unsummarized: dict[str, int] = field(default_factory=dict)
    #: CSVs in the folder that the run did not write.
    foreign_csvs: list[str] = field(default_factory=list)

    @property
    def dtype(self) -> str:
        return self.manifest.dtype

    @property
    def summarized(self) -> list[str]:
        """The studies of the run that have a report section, in run order."""
        return [s for s in self.manifest.studies if s not in self.unsummarized]

    def csv_names(self, study: str) -> tuple[str, ...]:
        return self.manifest.csv_names(study)


def load_results(out: Path, manifest: RunManifest, reported: Mapping[str, ReportedStudy]
                 ) -> RunResults:
    """The run in ``out`` (``manifest`` from :func:`read_manifest`), the CSVs of the studies
    in ``reported`` (those with a section) read for it; ReportError if malformed."""
    results = RunResults(out=out, manifest=manifest)
    for study in manifest.studies:
        summarized = study in reported
        read_by = _read_by(reported[study]) if summarized else {}
        for name in manifest.csv_names(study):
            if summarized and name not in read_by:
                raise ReportError(f"{out / name}: the {study} study writes "
                                  f"{', '.join(read_by)}, not this CSV; rerun the study")
            frame = _read_csv(out / name, COMMON_COLUMNS + read_by.get(name, ()))
            if summarized:
                results.frames[name] = frame
            else:
                results.unsummarized[study] = results.unsummarized.get(study, 0) + len(frame)
    listed = {name for study in manifest.studies for name in manifest.csv_names(study)}
    results.foreign_csvs = sorted(p.name for p in out.glob("*.csv") if p.name not in listed)
    _check_dtype(results.dtype)
    return results


def _read_by(study: ReportedStudy) -> dict[str, tuple[str, ...]]:
    """The columns the report reads of each CSV of ``study``: its schema's."""
    return {table.csv: names(table.columns) for table in study.tables}


def _context_columns() -> tuple[str, ...]:
    """The run-context columns every CSV the runner writes ends with (``backend``, ...):
    kept where present, for sections that say where the run computed."""
    return names(TRAILING_COLUMNS)


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
    # Only the schema's columns (and the run's context): a section cannot read what its
    # study does not write, and every row selection copies less.
    context = [c for c in _context_columns() if c in frame.columns]
    return frame[list(dict.fromkeys((*required, *context)))]


def _check_dtype(dtype: str) -> None:
    if dtype not in RELATIVE_TOLERANCE:
        raise ReportError(f"{MANIFEST}: dtype {dtype!r} is unknown; allowed: "
                          + ", ".join(RELATIVE_TOLERANCE))


def tolerance(dtype: str) -> float:
    """The relative tolerance the study judged its verdicts with, for the run's dtype."""
    return RELATIVE_TOLERANCE[dtype]
