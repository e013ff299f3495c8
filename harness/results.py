"""Writing results so that a crash never leaves a half-written file.

- CSVs and the run manifest are written to a temporary file in the same folder,
  flushed to disk, then renamed over the target: a reader sees the old file or
  the new one, never a torn one.
- While a run is in progress, every rank appends the cases it finished to its
  own journal (one JSON line per case, flushed and fsynced). ``--resume`` reads
  them back and skips those cases. The journals are removed when the run completes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness.errors import UsageError

JOURNAL_DIR = ".partial"
MANIFEST = "run.json"


class WriteError(OSError):
    """A result that could not be written (a full or read-only file system): its
    ``filename`` is the file meant, never the temporary one written first."""

    def line(self) -> str:
        """The one line a run that could not write ends with: the file and why, and that
        what was written before it stays whole (every file is replaced whole, or not)."""
        return (f"cannot write {self.filename}: {self.strerror}; every file written before "
                "is kept whole")


@contextlib.contextmanager
def naming(target: Path, temporary: Path | None = None) -> Iterator[None]:
    """An OSError inside is a :class:`WriteError` naming ``target`` where it names no file
    or the ``temporary`` one standing in for it (a write to an open file says only "No
    space left on device"), so that a run's last line says which file it was."""
    try:
        yield
    except WriteError:
        raise
    except OSError as error:
        named = error.filename if error.filename not in (None, str(temporary)) else target
        raise WriteError(error.errno, error.strerror or str(error), str(named)) from error


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success rename it over ``target``."""
    with naming(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                    dir=target.parent)
        os.close(fd)
    temp_path = Path(temp)
    try:
        with naming(target, temp_path):
            # mkstemp makes the file private (0600); results are shared like any file.
            temp_path.chmod(0o666 & ~_umask())
            yield temp_path
            with open(temp_path, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(temp_path, target)
    finally:
        temp_path.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(target: Path, text: str) -> None:
    with atomic_path(target) as temp:
        temp.write_text(text)


def write_csv_atomic(target: Path, rows: Sequence[dict], columns: Sequence[str]) -> None:
    """Write ``rows`` with exactly ``columns``, in that order; floats round-trip exactly."""
    import pandas as pd  # only rank 0 writes: keep pandas out of the other ranks' start-up

    missing = sorted({key for row in rows for key in columns if key not in row})
    extra = sorted({key for row in rows for key in row if key not in columns})
    if missing or extra:
        raise ValueError(f"{target.name}: rows do not match the schema "
                         f"(missing {missing}, undocumented {extra})")
    frame = pd.DataFrame(list(rows), columns=list(columns))
    with atomic_path(target) as temp:
        frame.to_csv(temp, index=False)


def _json_safe(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value


def _from_json(value: object) -> object:
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    return value


def _entry(line: str) -> object:
    """A journal line's JSON, None where it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _is_case(entry: object) -> bool:
    """Whether a journal line is one case's rows, as :meth:`Journal.append` writes it."""
    return (isinstance(entry, dict) and isinstance(entry.get("case_id"), str)
            and isinstance(entry.get("rows"), list)
            and all(isinstance(row, dict) for row in entry["rows"]))


class Journal:
    """Finished cases of one rank in the run in progress, one fsynced JSON line each."""

    def __init__(self, out: Path, fingerprint: str, rank: int = 0) -> None:
        self.path = out / JOURNAL_DIR / f"journal.rank{rank}.jsonl"
        self.fingerprint = fingerprint

    def load(self) -> dict[str, list[dict]]:
        """Rows of finished cases by case id, from a journal of the same configuration. A
        last line cut short (the run died writing it) is dropped: that case runs again.
        Anything else this class did not write is refused, naming the file."""
        if not self.path.exists():
            return {}
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as error:
            raise self.corrupted(f"bytes that are not UTF-8 at offset {error.start}") from None
        if not lines:
            return {}
        header = _entry(lines[0])
        if not isinstance(header, dict) or "fingerprint" not in header:
            raise self.corrupted("line 1 is not its header")
        if header["fingerprint"] != self.fingerprint:
            raise UsageError(
                f"--resume: the unfinished run in {str(self.path.parent.parent)!r} used a "
                "different configuration; rerun it with the same flags, or without --resume")
        rows: dict[str, list[dict]] = {}
        for number, line in enumerate(lines[1:], start=2):
            entry = _entry(line)
            if entry is None and number == len(lines):
                break  # the line being written when the run died: that case reruns
            if not _is_case(entry):
                raise self.corrupted(f"line {number} is not a finished case's rows")
            rows[entry["case_id"]] = [{k: _from_json(v) for k, v in row.items()}
                                      for row in entry["rows"]]
        return rows

    def corrupted(self, what: str) -> UsageError:
        """A journal this class did not write (or a disk that damaged it), refused."""
        return UsageError(f"--resume: the journal {str(self.path)!r} is corrupted ({what}); "
                          "allowed: delete it and resume (that rank's cases run again), or "
                          "run without --resume")

    def start(self, keep: dict[str, list[dict]]) -> None:
        """Begin a journal holding the header and the rows being kept from a resumed run."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.path) as temp, open(temp, "w") as handle:
            handle.write(json.dumps({"fingerprint": self.fingerprint}) + "\n")
            for case_id, rows in keep.items():
                handle.write(self._line(case_id, rows))
        self._handle = open(self.path, "a")  # noqa: SIM115 -- kept open for the run

    def append(self, case_id: str, rows: list[dict]) -> None:
        with naming(self.path):
            self._handle.write(self._line(case_id, rows))
            self._handle.flush()
            os.fsync(self._handle.fileno())

    def finish(self) -> None:
        """The run completed: its results are in the CSVs, the journal is no longer needed."""
        self._handle.close()
        self.path.unlink(missing_ok=True)

    def remove_folder(self) -> None:
        """Once every rank has finished: the journal folder, if nothing else is in it."""
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()

    @staticmethod
    def _line(case_id: str, rows: list[dict]) -> str:
        safe = [{k: _json_safe(v) for k, v in row.items()} for row in rows]
        return json.dumps({"case_id": case_id, "rows": safe}) + "\n"
