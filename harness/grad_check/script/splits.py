"""Splits of one global batch (N ranks x k micro-steps) and the command's placeholders.

A split ``NxK`` runs the command on N ranks that each accumulate k micro-batches of
b = G / (N*k) samples per optimizer step: every split takes the same G samples per step.
The command names the per-split values with placeholders, substituted in each argument.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from harness.errors import UsageError

#: Placeholder -> what it stands for, in the order ``--help`` lists them.
PLACEHOLDERS = {
    "batch": "b = G / (N*k), the micro-batch per rank",
    "accum": "k, micro-steps per optimizer step",
    "nproc": "N, ranks",
    "global_batch": "G, samples per optimizer step",
}
#: Something that reads as a placeholder: ``{name}`` with a lower-case identifier. Other
#: braces (a JSON argument, ``{0}``) are the command's own and left alone.
PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")
#: More micro-steps per optimizer step than any real recipe needs only makes a check slow.
MAX_ACCUM_STEPS = 1024


@dataclass(frozen=True, order=True)
class Split:
    """N ranks x k micro-steps per optimizer step."""

    world_size: int
    accum_steps: int

    @property
    def label(self) -> str:
        return f"{self.world_size}x{self.accum_steps}"

    @property
    def pieces(self) -> int:
        """Micro-batches per optimizer step, over all ranks: N*k."""
        return self.world_size * self.accum_steps

    def micro_batch(self, global_batch: int) -> int:
        return global_batch // self.pieces

    def values(self, global_batch: int) -> dict[str, int]:
        """Each placeholder's value at this split."""
        return {"batch": self.micro_batch(global_batch), "accum": self.accum_steps,
                "nproc": self.world_size, "global_batch": global_batch}


def parse_split(text: str, flag: str) -> Split:
    """``'2x4'`` -> Split(2, 4); one line naming the flag and the text otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match or int(match[1]) < 1 or not 1 <= int(match[2]) <= MAX_ACCUM_STEPS:
        raise UsageError(f"{flag}: {text.strip()!r} is not a split; allowed: NxK with N >= 1 "
                         f"ranks and 1 <= K <= {MAX_ACCUM_STEPS} micro-steps, e.g. 2x4")
    return Split(int(match[1]), int(match[2]))


def parse_splits(text: str, flag: str = "--splits") -> tuple[Split, ...]:
    """``'1x1,1x4,2x2'`` -> its splits, each once, in the order given."""
    if not text.strip():
        raise UsageError(f"{flag} is empty; allowed: comma-separated NxK, e.g. 1x1,1x4,2x2")
    splits = tuple(parse_split(item, flag) for item in text.split(","))
    for split in splits:
        if splits.count(split) > 1:
            raise UsageError(f"{flag} {text!r}: {split.label} is given twice; give each "
                             "split once")
    return splits


def check_divides(split: Split, global_batch: int, flag: str) -> None:
    """G must cut into N*k micro-batches of equal size."""
    if global_batch % split.pieces:
        raise UsageError(f"{flag}: {split.label} cuts --global-batch {global_batch} into "
                         f"{split.pieces} micro-batches of {global_batch / split.pieces:g} "
                         f"samples; allowed: splits whose N*k divides {global_batch}")


def used_placeholders(command: Sequence[str]) -> set[str]:
    return {name for argument in command for name in PLACEHOLDER.findall(argument)}


def check_placeholders(command: Sequence[str], splits: Sequence[Split]) -> None:
    """Every placeholder known, and the command told what each split changes: without
    ``{accum}`` a split with k > 1 would run as the script's own k, and without
    ``{batch}`` every split would take the script's own micro-batch."""
    used = used_placeholders(command)
    for name in sorted(used - set(PLACEHOLDERS)):
        raise UsageError(f"the command's placeholder {{{name}}} is unknown; allowed: "
                         + ", ".join(f"{{{known}}}" for known in PLACEHOLDERS))
    for split in splits:
        if split.accum_steps > 1 and "accum" not in used:
            raise UsageError(f"split {split.label} accumulates {split.accum_steps} micro-steps "
                             "but the command has no {accum}; allowed: a command that passes "
                             "{accum} to the script (e.g. --grad-accum {accum}), or splits NxK "
                             "with K = 1")
        if split.pieces > 1 and "batch" not in used:
            raise UsageError(f"split {split.label} cuts the global batch into {split.pieces} "
                             "micro-batches but the command has no {batch}; allowed: a command "
                             "that passes {batch} to the script (e.g. --batch-size {batch})")


def substituted(command: Sequence[str], split: Split, global_batch: int) -> list[str]:
    """The command of one split: every placeholder replaced by its value."""
    values = split.values(global_batch)
    return [PLACEHOLDER.sub(lambda match: str(values[match[1]]), argument)
            for argument in command]
