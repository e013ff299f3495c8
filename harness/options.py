"""Settings as flags: the parsers and checks every flag uses, and a study's own options.

A study declares its settings as a frozen dataclass (a :class:`StudyOptions`)
whose fields carry :func:`option` metadata; the command line registers each
such field as a flag, parses its text with the field's parser, and builds the
dataclass, whose ``__post_init__`` refuses a bad value with one line naming the
flag, the value and what is allowed. Defaults live in the dataclass alone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.placement import leader_from_environment, under_torchrun

#: The longest ``--timeout``: a collective still waiting after a day is hung, not slow,
#: and far larger values overflow the timedelta handed to torch.distributed.
MAX_TIMEOUT_S = 86_400.0
#: The largest ``--seed``. Its strictest consumer is numpy's ``RandomState``, which seeds
#: PowerSGD in the hooks study and takes seeds below 2**32; torch generators take seeds
#: below 2**64, and harness.seeding mixes the seed with a case key well inside that.
MAX_SEED = 2**32 - 1
#: What a number on the command line is written as: ASCII digits alone. Python's int() and
#: float() also take other scripts' digits ('１２', '٣') and underscores ('1_0'), which no
#: user types on purpose and which would reach the rows as a value nobody wrote.
_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
                     r"|inf|infinity|nan)", re.IGNORECASE)


def strict_int(text: str) -> int:
    """``int(text)`` of ASCII digits with an optional sign (surrounding blanks allowed);
    ValueError for anything else, the empty text included."""
    if not _INTEGER.fullmatch(text.strip()):
        raise ValueError(text)
    return int(text)


def strict_float(text: str) -> float:
    """``float(text)`` of an ASCII decimal number (or inf, nan: their consumers refuse them
    by name); ValueError for anything else, the empty text included."""
    if not _NUMBER.fullmatch(text.strip()):
        raise ValueError(text)
    return float(text)


def _parse_list(text: str, flag: str, convert: Callable[[str], Any], noun: str,
                example: str) -> tuple:
    """Each comma-separated item through ``convert``; one line naming the bad item otherwise
    (an empty text too: a flag given is a flag meant, never its default)."""
    if not text.strip():
        raise UsageError(f"{flag} is empty; allowed: comma-separated {noun}s, e.g. {example}")
    values = []
    for item in (part.strip() for part in text.split(",")):
        try:
            values.append(convert(item))
        except ValueError:
            article = "an" if noun[0] in "aeiou" else "a"
            raise UsageError(f"{flag} {text!r}: {item!r} is not {article} {noun}; "
                             f"allowed: comma-separated {noun}s, e.g. {example}") from None
    return tuple(values)


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); a one-line error naming the flag and the bad item otherwise."""
    return _parse_list(text, flag, strict_int, "integer", "1,2,4")


def parse_float_list(text: str, flag: str) -> tuple[float, ...]:
    """'0.1,1' -> (0.1, 1.0); a one-line error naming the flag and the bad item otherwise."""
    return _parse_list(text, flag, strict_float, "number", "0.01,0.1,1")


def parse_name_list(text: str, flag: str) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'); '' -> (); an empty item ('a,,b', 'a,') is refused."""
    if not text.strip():
        return ()
    items = tuple(item.strip() for item in text.split(","))
    if "" in items:
        raise UsageError(f"{flag} {text!r} has an empty item; allowed: comma-separated "
                         "names without spaces between commas, e.g. a,b")
    return items


def parse_int(text: str, flag: str) -> int:
    try:
        return strict_int(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not an integer; allowed: ASCII digits with "
                         "an optional sign, e.g. 4") from None


def parse_float(text: str, flag: str) -> float:
    try:
        return strict_float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a number; allowed: an ASCII decimal "
                         "number, e.g. 0.5 or 1e-3") from None


def parse_out(text: str, flag: str = "--out") -> Path:
    """``--out DIR``: a folder's name; the empty text is refused (it would name the current
    folder, and write the results among whatever is there)."""
    if not text.strip():
        raise UsageError(f"{flag} is empty; allowed: a folder's name, e.g. {flag} results")
    return Path(text)


def check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise UsageError(f"{flag} {value} is not allowed; allowed: integers >= 1")


def check_known(flag: str, names: Iterable[str], allowed: Sequence[str]) -> None:
    for name in names:
        if name not in allowed:
            raise UsageError(f"{flag}: {name!r} is unknown; allowed: {', '.join(allowed)}")


def check_timeout(seconds: float) -> None:
    if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN fails too
        raise UsageError(f"--timeout {seconds:g} is not allowed; allowed: 0 < seconds <= "
                         f"{MAX_TIMEOUT_S:g} (a day)")


def check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed {seed} is not allowed; allowed: integers 0..{MAX_SEED} "
                         "(below 2^32, what numpy's RandomState takes; torch generators "
                         "take below 2^64)")


def check_out_folder(out: Path) -> None:
    """``--out``: a folder, or one that can be created, refused before anything runs rather
    than when the first file is written. Creating (and removing) a probe folder in the
    nearest existing one is the test: permission bits do not stop root, /proc does."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file; allowed: a folder "
                         "(it is created when missing)")
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    try:
        probe_writing(existing)
    except OSError as error:
        room = " with free space" if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise UsageError(f"--out {str(out)!r} cannot be created or written: {error.strerror} "
                         f"in {str(existing)!r}; allowed: a folder you can write{room}") from None


#: Bytes the probe writes: a file system too full to hold them cannot hold a row either.
PROBE_BYTES = 4096


def probe_writing(folder: Path) -> None:
    """Create a folder and a file of :data:`PROBE_BYTES` in ``folder``, flushed to disk,
    then remove both: OSError where any of it fails (no permission, a read-only or full
    file system; a folder alone still fits where a file's bytes no longer do)."""
    probe = tempfile.mkdtemp(prefix=".out-probe-", dir=folder)
    try:
        with open(os.path.join(probe, "probe"), "wb") as handle:
            handle.write(b"\0" * PROBE_BYTES)
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(probe, "probe"))
        os.rmdir(probe)


def check_positive_unique(flag: str, values: Sequence[int], upper: int | None = None) -> None:
    """Non-empty, every value >= 1 (and <= ``upper``), none repeated."""
    if not values:
        raise UsageError(f"{flag} is empty; give at least one value")
    for value in values:
        if value < 1 or (upper is not None and value > upper):
            allowed = f"1..{upper}" if upper else "integers >= 1"
            raise UsageError(f"{flag}: {value} is not allowed; allowed: {allowed}")
    if len(set(values)) != len(values):
        raise UsageError(f"{flag}: {','.join(map(str, values))} repeats a value; "
                         "give each value once")


# ------------------------------------------------------------- study options
def option(flag: str, metavar: str, help: str, parse: Callable[[str, str], Any] | None = None,
           ) -> dict[str, Any]:
    """Metadata that makes a dataclass field a command-line flag.

    ``parse(text, flag)`` turns the flag's text into the field's value (and
    raises UsageError naming the flag on bad text); None: the text as it is.
    The default shown by ``--help`` is the field's own default, never a copy.
    """
    return {"flag": flag, "metavar": metavar, "help": help, "parse": parse}


@dataclass(frozen=True)
class StudyOptions:
    """Base of a study's own settings. Subclasses add :func:`option` fields and check
    them in ``__post_init__`` (raising UsageError that names the flag and the value)."""

    @classmethod
    def flags(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class NoOptions(StudyOptions):
    """A study without settings of its own."""


class CommandParser(argparse.ArgumentParser):
    """argparse for every command of the harness: an error raises UsageError (one line,
    exit 2, like every other bad input) and only the rank that speaks (rank 0, or a
    process outside torchrun) prints ``--help``.

    A value that starts with a minus and a digit (``--splits -1x1``, ``--seed -1e3``) is the
    flag's value, refused by its own check with what is allowed, not an unknown option
    ("expected one argument"): no flag of the harness's looks like ``-1``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse reads '-1x1' as an option unless it looks like a negative number by this
        # pattern (its own matches '-1' and '-1.5' alone).
        self._negative_number_matcher = re.compile(r"^-[0-9.]")

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)

    def _print_message(self, message: str, file=None) -> None:
        if leader_from_environment():
            super()._print_message(message, file)


#: More local ranks than this would only oversubscribe a machine's cores.
MAX_NPROC = 256


def parse_nproc(text: str) -> int:
    """``--nproc N``: the ranks a command starts itself, which it cannot under torchrun."""
    nproc = parse_int(text, "--nproc")
    if not 1 <= nproc <= MAX_NPROC:
        raise UsageError(f"--nproc {nproc} is not allowed; allowed: 1..{MAX_NPROC}")
    if under_torchrun():
        raise UsageError("--nproc starts ranks of its own; under torchrun (or Slurm's "
                         "torchrun) leave it out")
    return nproc
