"""Which rank of a split failed first, or hung, read from what the split's processes left.

A rank that fails leaves its one line (``rank<R>.txt``: ``Type: sentence (at
file:line)``, written by the capture's excepthook) or only its exit code. Its peers then
fail too, for want of it: a collective or the store that lost its connection ("Connection
closed by peer"), a collective that timed out waiting. Those are victims: the rank
blamed is the one that failed for a reason of its own, the first of them by the time
its line was written or its end was seen; a victim only where nobody else failed.

Under a launcher in the command grad-check sees the launcher's exit code, not its
workers': a worker that ended without a line is named from the launcher's own summary
(torch elastic's "Root Cause" in torchrun's and accelerate's output, DeepSpeed's
"exits with return code").

A split stopped at ``--timeout`` names the ranks that made no progress: every rank
writes its optimizer steps and forward passes as they change, and where it waits in
grad-check's own exchange (``progress/rank<R>``, harness/grad_check/script/guard.py): a
rank waiting there reached that point of the step, so the ranks furthest behind hung, and
how long ago they last moved is said. "Still making progress" (raise --timeout) is said
only where they moved in the timeout's last tenth.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path

from harness.errors import USAGE_EXIT, error_file, timed_out_in_collective
from harness.grad_check.script import wire
from harness.ranks import describe_exit, error_line

#: How torch words a collective, or the store, that lost a peer: gloo's "Connection closed
#: by peer" and "Connection reset by peer", a broken pipe, the store's failed receive,
#: NCCL's aborted communicator.
_LOST_PEER = re.compile(r"connection (closed|reset) by peer|broken pipe|econnreset|"
                        r"connection refused|failed to recv|connection was likely closed|"
                        r"remote process exited|communicator was aborted|"
                        r"\bDist(Network|Store)Error\b", re.IGNORECASE)
#: torch elastic's summary of a failed run (torchrun, accelerate launch): its root cause.
_ELASTIC_ROOT = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?"
                           r"exitcode\s*:\s*(-?\d+)", re.DOTALL)
#: DeepSpeed's launcher on a worker that failed: its command, ``--local_rank=R`` before the
#: script's own arguments, then its exit code.
_DEEPSPEED_EXIT = re.compile(r"--local_rank=(\d+)'?(?:, [^\]]*)?\]\s+exits with return code = "
                             r"(-?\d+)")
#: argparse's last line: "prog: error: message".
_ARGPARSE_ERROR = re.compile(r"^\S+: error: .+$", re.MULTILINE)


class Unusable(StrEnum):
    """Why the reference's runs give nothing to compare with: a stable id, as
    ``failures.json`` says it."""

    FAILED = "reference-failed"
    REFUSED = "arguments-refused"
    NEVER_STEPPED = "never-stepped"
    NOT_DETERMINISTIC = "not-deterministic"
    NOT_FINITE = "not-finite"


class ReferenceUnusable(Exception):
    """The reference's runs give nothing to compare with: the command failed or refused its
    input, never stepped an optimizer, or did not repeat itself. One line, exit code 1:
    found by running the command, not bad input found before it ran (exit code 2).
    ``reason``: why, as an id; ``alike``: the line as every run of the same script on the
    same machine says it (``line`` without what differs from run to run: a magnitude drawn
    at random, the temporary folder of its output, which of the ranks that fail alike said
    it first)."""

    def __init__(self, line: str, reason: Unusable, alike: str = "") -> None:
        super().__init__(line)
        self.reason, self.alike = reason, alike or line


@dataclass(frozen=True)
class RunFailure:
    """A run of the command that failed: which run, at which split, its line (without the
    rank, a field of its own), and the rank it names with its exit code and, where it
    raised, its error's fields."""

    run: str
    split: str
    line: str
    rank: int | None = None
    exitcode: int | None = None
    error: wire.RankError | None = None

    @classmethod
    def from_json(cls, data: dict) -> RunFailure:
        run = cls(**wire.known_fields(cls, data))
        error = run.error
        return replace(run, error=wire.RankError(**wire.known_fields(wire.RankError, error))
                       if error else None)


@dataclass(frozen=True)
class CheckFailures:
    """What failed in one ``grad-check run``, by its fields (``failures.json`` in --out, for
    a program that reads the check: the trainers study): the reference found unusable (why,
    its line as every run says it alike, and the line said), and every run that failed."""

    unusable: str = ""
    alike: str = ""
    line: str = ""
    runs: tuple[RunFailure, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CheckFailures:
        found = wire.known_fields(cls, json.loads(text))
        return replace(cls(**found), runs=tuple(map(RunFailure.from_json, found.get("runs", []))))


def lost_a_peer(line: str) -> bool:
    """Whether ``line`` is a rank failing for want of another: a peer's connection lost,
    or a collective that timed out waiting for it."""
    return bool(_LOST_PEER.search(line)) or timed_out_in_collective(line)


@dataclass(frozen=True)
class SplitFailure:
    """The rank that failed first (None: the run as a whole), its exit code and its line;
    ``hung``: the ranks named as hung (their line says so itself); ``error``: the Python
    error the line says, by its fields, where the rank raised one."""

    rank: int | None
    exitcode: int | None
    line: str
    hung: tuple[int, ...] = ()
    error: wire.RankError | None = None

    @property
    def refused(self) -> bool:
        """The command refused its input (exit code 2: an argparse error, the capture's
        refusal of a setup it cannot read)."""
        return self.exitcode == USAGE_EXIT

    def __str__(self) -> str:
        return self.line if self.rank is None or self.hung else f"rank {self.rank}: {self.line}"


def rank_error(folder: Path, rank: int) -> wire.RankError | None:
    """The fields of the Python error behind rank ``rank``'s line, where it raised one."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        return wire.RankError.from_json(wire.error_record(folder, rank).read_text())
    return None


def line_time(folder: Path, rank: int) -> float | None:
    with contextlib.suppress(OSError):
        return error_file(folder, rank).stat().st_mtime
    return None


def left_early(codes: Sequence[int | None], folder: Path) -> list[int]:
    """The ranks that exited with code 0 without their summary (``rank<R>.pt``: a rank that
    took its steps writes one before it ends) while another rank still ran or failed:
    they left the split, and the others wait for them or lose them."""
    if all(code == 0 for code in codes):
        return []
    return [rank for rank, code in enumerate(codes)
            if code == 0 and not (folder / f"rank{rank}.pt").exists()]


def left_line(folder: Path, rank: int, codes: Sequence[int | None]) -> str:
    """What a rank that left did: how far it got (it never joined the process group, or
    how many steps it took) and the ranks it left behind."""
    others = [r for r, code in enumerate(codes) if r != rank and code != 0]
    who = f"rank {others[0]}" if len(others) == 1 else "ranks " + ", ".join(map(str, others))
    found = progress(folder, rank)
    if not (folder / wire.CLAIMS / f"rank{rank}").exists():
        when, left = "before joining the process group", f"while {who} waited for it to join"
    else:
        steps = found.steps if found else 0
        when = ("after joining the process group, before its first optimizer step"
                if not steps else f"after {steps} optimizer step(s), before grad-check had "
                "captured its steps")
        left = f"while {who} went on without it"
    return (f"exited with code 0 {when}, {left}: every rank must take each step (look for "
            "a condition on the rank that ends the script early)")


def first_failure(codes: list[int | None], ended: dict[int, float], folder: Path,
                  logs: Path | None = None) -> SplitFailure:
    """Among ranks started by grad-check: the first that failed for a reason of its own
    (its line, else its exit code, or its exit with code 0 before the others were done:
    :func:`left_early`; dated by when its end was seen: ``ended``, wall time), else the
    first victim."""
    logs = logs or folder
    left = left_early(codes, folder)
    candidates = []
    for rank, code in enumerate(codes):
        line = error_line(folder, rank) or (left_line(folder, rank, codes)
                                            if rank in left else "")
        if not line and code in (None, 0):
            continue
        own = not lost_a_peer(line) if line else True
        when = line_time(folder, rank) if error_line(folder, rank) else ended.get(rank)
        candidates.append((not own, float("inf") if when is None else when, rank, line))
    _, _, rank, line = min(candidates)
    return SplitFailure(rank, codes[rank], line or log_line(logs / f"rank{rank}.log", codes[rank]),
                        error=rank_error(folder, rank))


def launched_failure(folder: Path, log: Path, nproc: int, code: int | None,
                     launcher: str) -> SplitFailure:
    """Under a launcher in the command (exit code ``code``, output in ``log``): the first
    of its workers that failed by itself, else the one its summary names, else a victim,
    else the launcher itself."""
    lines = {rank: line for rank in ranks_with_lines(folder, nproc)
             if (line := error_line(folder, rank))}
    own = [rank for rank, line in lines.items() if not lost_a_peer(line)]
    if own:
        rank = min(own, key=lambda r: line_time(folder, r) or float("inf"))
        return SplitFailure(rank, 1, lines[rank], error=rank_error(folder, rank))
    output = read(log)
    named = summary_of(output)
    if named is not None:
        rank, exitcode = named
        return SplitFailure(rank, exitcode, lines.get(rank) or exit_line(output, exitcode),
                            error=rank_error(folder, rank))
    if lines:
        rank = min(lines, key=lambda r: line_time(folder, r) or float("inf"))
        return SplitFailure(rank, 1, lines[rank], error=rank_error(folder, rank))
    return SplitFailure(None, code, f"{launcher} {log_line(log, code)}"
                   if code is not None and code > 0 else f"{launcher} was {describe_exit(code)}"
                   if code is not None else f"{launcher} stopped")


def ranks_with_lines(folder: Path, nproc: int) -> list[int]:
    found = {int(match[1]) for path in folder.glob("rank*.txt")
             if (match := re.fullmatch(r"rank(\d+)\.txt", path.name))}
    return sorted(found | set(range(nproc)))


def summary_of(output: str) -> tuple[int, int] | None:
    """The failed worker a launcher's summary names: (rank, exit code)."""
    match = _ELASTIC_ROOT.search(output)
    if match:
        return int(match[1]), int(match[2])
    exits = [(int(rank), int(code)) for rank, code in _DEEPSPEED_EXIT.findall(output)
             if int(code) != 0]
    return exits[0] if exits else None


def exit_line(output: str, exitcode: int) -> str:
    """A worker without a line: argparse's message where it refused its arguments, else
    how it ended."""
    if exitcode == USAGE_EXIT:
        errors = _ARGPARSE_ERROR.findall(output)
        if errors:
            return errors[-1].strip()
    return describe_exit(exitcode)


def read(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return ""


def log_line(log: Path, code: int | None) -> str:
    """A process that wrote no error line: the last line of its output where it exited by
    itself with code 2 (an argparse error), else how it ended, with its last line."""
    if code is None:
        return "stopped"
    lines = [line.strip() for line in read(log).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if code == USAGE_EXIT and last:
        return last
    ended = describe_exit(code)
    if code > 0 and last:
        return f"exited with code {code}; its last output: {last[:200]}"
    return ended


def fatal(folder: Path) -> SplitFailure | None:
    """A failure that ends the split at once (guard.py: a rank claimed twice, a launcher
    that started another number of ranks)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        found = wire.Fatal.from_json((folder / wire.FATAL).read_text())
        return SplitFailure(found.rank, found.exitcode, found.line)
    return None


@dataclass(frozen=True)
class RankProgress:
    """A rank's progress as it last wrote it (harness/grad_check/script/guard.py)."""

    steps: int
    forwards: int
    #: Wall time of its last change.
    at: float
    #: Where it waits in grad-check's own exchange (it reached that point), if it does.
    waiting: str | None = None

    @property
    def reached(self) -> tuple[int, int, bool]:
        """How far it got: a rank waiting in grad-check's exchange is past one that ran as
        many forwards but never arrived there."""
        return self.steps, self.forwards, self.waiting is not None

    def __str__(self) -> str:
        if self.waiting is not None:
            return f"reached {self.waiting}, in grad-check's exchange"
        if self.steps == self.forwards == 0:
            return "before its first forward pass"
        return f"at step {self.steps} after {self.forwards} forward pass(es)"


#: A rank that has not written its progress yet: behind every rank that has.
NOWHERE = (-1, -1, False)


def progress(folder: Path, rank: int) -> RankProgress | None:
    path = folder / wire.PROGRESS / f"rank{rank}"
    with contextlib.suppress(OSError, ValueError, TypeError):
        found = wire.Progress.from_json(path.read_text())
        return RankProgress(found.steps, found.forwards, path.stat().st_mtime, found.waiting)
    return None


def recent_s(timeout: float) -> float:
    """How near the end of ``--timeout`` a rank must have moved to be still making progress:
    its last tenth, at least a second (a few periods of the guard's writes, under load)."""
    return max(1.0, timeout / 10)


def hang(folder: Path, nproc: int, timeout: float, started: float) -> SplitFailure:
    """The split ran past ``--timeout``: the ranks furthest behind hung (``started``: wall
    time of the split's start, the last progress of a rank that never wrote any)."""
    now = time.time()
    seen = {rank: progress(folder, rank) for rank in range(nproc)}

    def reached(rank: int) -> tuple[int, int, bool]:
        found = seen[rank]
        return NOWHERE if found is None else found.reached

    behind = min(reached(rank) for rank in seen)
    hung = tuple(rank for rank in seen if reached(rank) == behind)
    # The newest move of any of them: none has moved since, so each has been idle as long.
    last = max((found.at if (found := seen[rank]) else started) for rank in hung)
    idle = now - last
    who = (f"rank {hung[0]}" if len(hung) == 1 else "ranks " + ", ".join(map(str, hung)))
    where = (str(seen[hung[0]]) if seen[hung[0]] else "before its first forward pass")
    if len(hung) > 1:
        where = where.replace(" its ", " their ")
    stopped = f"--timeout {timeout:g} s stopped the split"
    if idle < recent_s(timeout):
        return SplitFailure(hung[0], None, f"{who} still making progress when {stopped} ({where}, "
                       f"{idle:.1f} s before): the script trains longer than --timeout "
                       "allows; raise --timeout", hung)
    return SplitFailure(hung[0], None, f"{who} hung: no progress for {idle:.0f} s {where} "
                   f"({stopped}; {why_hung(seen, hung, nproc)})", hung)


def why_hung(seen: dict[int, RankProgress | None], hung: tuple[int, ...], nproc: int) -> str:
    """What the hung ranks' peers were doing: further on, waiting for them; or nothing
    else, where every rank is as far."""
    if len(hung) == len(seen) and nproc > 1:
        return ("all alike: they wait for something outside the split (input, a file, a "
                "peer), or train longer than --steps needs")
    if len(hung) == len(seen):
        return "it waits for something (input, a file, a peer), or trains longer than --steps needs"
    ahead = [rank for rank in seen if rank not in hung]
    others = ", ".join(f"rank {rank} {seen[rank]}" for rank in ahead[:3])
    return f"{others}: waiting for {'them' if len(hung) > 1 else 'it'}"


def missing_ranks(folder: Path, nproc: int, launcher: str, split: str) -> SplitFailure | None:
    """Under a launcher: every one of the split's N ranks must have stepped (its summary,
    ``rank<R>.pt``: capture.py's ``summary_file``), and no other."""
    wrote = sorted(int(match[1]) for path in folder.glob("rank*.pt")
                   if (match := re.fullmatch(r"rank(\d+)\.pt", path.name)))
    if not wrote or wrote == list(range(nproc)):
        return None
    ranks = ", ".join(map(str, wrote))
    return SplitFailure(None, USAGE_EXIT, f"{launcher} started {len(wrote)} rank(s) that stepped "
                   f"(rank {ranks}) at split {split}, which needs {nproc}; allowed: a launcher "
                   "given {nproc} as its number of processes, that starts them all "
                   "(e.g. torchrun --nproc_per_node={nproc})")
