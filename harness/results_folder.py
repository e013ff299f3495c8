"""One results folder of scripts/study.py as ``grad-compare`` reads it (grad_compare.py).

:class:`ResultsFolder` holds the folder's run.json and reads, on demand, the rows of a
study's CSVs, refusing with a :class:`UsageError` one line long what is not a results
folder (a CSV missing, unreadable, without case_id, or with a row of the wrong width).
Reading a folder is apart from judging two of them: compare.py holds the rules, this
module only what the folders say.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.context import CONTEXT_COLUMNS
from harness.errors import UsageError
from harness.manifest import RunManifest, read_manifest

#: run.json keys describing the run rather than what it measured: shown, never judged.
RUN_FACTS = ("started", "wall_time_s", "command")


@dataclass
class ResultsFolder:
    """A results folder: its run.json and, on demand, the rows of a study's CSV."""

    path: Path
    manifest: RunManifest

    @classmethod
    def load(cls, text: str) -> ResultsFolder:
        path = Path(text)
        return cls(path, read_manifest(path))

    @property
    def studies(self) -> list[str]:
        return list(self.manifest.studies)

    @property
    def dtype(self) -> str:
        dtype = self.manifest.value("dtype")
        if not isinstance(dtype, str):
            raise UsageError(f"{self.path / 'run.json'}: has no dtype; allowed: the run.json "
                             "of scripts/study.py, which names the run's dtype")
        return dtype

    def settings(self) -> dict[str, Any]:
        """Every setting of the run (``settings``, or ``config`` in older runs), flattened."""
        settings = self.manifest.settings or self.manifest.config
        return dict(_flattened(settings if isinstance(settings, dict) else {}))

    def facts(self) -> dict[str, Any]:
        """The run's context and when and how it ran."""
        return {key: self.manifest.value(key, "") for key in (*CONTEXT_COLUMNS, *RUN_FACTS)}

    def rows(self, study: str) -> tuple[list[str], list[dict[str, str]]]:
        """Columns and rows (text cells, as written) of ``study``'s CSVs: every column some
        CSV has, and the rows of each CSV in turn, each with its own CSV's columns."""
        columns: dict[str, None] = {}
        rows: list[dict[str, str]] = []
        for name in self.manifest.csv_names(study):
            table_columns, table_rows = _read_table(self.path / name, study)
            columns.update(dict.fromkeys(table_columns))
            rows += table_rows
        return list(columns), rows


def _read_table(path: Path, study: str) -> tuple[list[str], list[dict[str, str]]]:
    try:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
    except FileNotFoundError:
        raise UsageError(f"{path}: missing, although run.json lists {study}") from None
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise UsageError(f"{path}: not a readable CSV ({error})") from None
    _check_table(path, columns, rows)
    return columns, rows


def _check_table(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    if "case_id" not in columns:
        raise UsageError(f"{path}: has no case_id column; allowed: a CSV of scripts/study.py")
    for number, row in enumerate(rows, start=2):
        # DictReader files surplus cells under None and fills missing ones with None.
        if None in row or None in row.values():
            raise UsageError(f"{path}: line {number} has {len(columns)} columns in its header "
                             "but not in this row; not a readable CSV")


def _flattened(settings: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in settings.items():
        if isinstance(value, dict):
            yield from _flattened(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
