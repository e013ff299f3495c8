"""Splits of one global batch (N ranks x k micro-steps) and the command's placeholders.

A split ``NxK`` runs the command on N ranks that each accumulate k micro-batches of
b = G / (N*k) samples per optimizer step: every split takes the same G samples per step.
The command names the per-split values with placeholders, substituted in each argument:
a name (``{batch}``) or integer arithmetic over the names (``{nproc*accum}``,
``{global_batch*1024}``: ``+ - * / //`` and parentheses; ``/`` must come out whole). As
in Python's ``str.format``, ``{{`` and ``}}`` are a literal brace; an argument with
braces of its own (a JSON argument, ``{0}``) keeps them as written, placeholders aside.
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
#: What reads as a placeholder: braces around lower-case names, integers, ``+ - * /`` and
#: parentheses, with at least one name. Other braces (a JSON argument, ``{0}``,
#: ``{HOME}``) are the command's own and left alone.
_EXPRESSION_TEXT = r"[a-z0-9_\s+\-*/()]*[a-z_][a-z0-9_\s+\-*/()]*"
#: One piece of an argument: an escaped brace, a placeholder, or any other character.
_PIECE = re.compile(r"(?P<open>\{\{)|(?P<close>\}\})|\{(?P<expression>" + _EXPRESSION_TEXT
                    + r")\}|(?P<other>[\s\S])")
_TOKEN = re.compile(r"\s*(?:(?P<number>\d+)|(?P<name>[a-z_][a-z0-9_]*)|(?P<op>//|[-+*/()]))")
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


# ---------------------------------------------------------------- placeholders
def _keeps_its_braces(argument: str) -> bool:
    """An argument with a brace that opens neither a placeholder nor ``{{`` (JSON,
    ``{0}``): its braces are its own, and doubled ones are not escapes."""
    return any(match["other"] == "{" for match in _PIECE.finditer(argument))


def expressions(argument: str) -> list[str]:
    """The placeholders' texts in ``argument``, in order (``{nproc*accum}`` -> 'nproc*accum')."""
    return [match["expression"] for match in _PIECE.finditer(argument)
            if match["expression"] is not None]


def names_in(expression: str) -> list[str]:
    return [token["name"] for token in _TOKEN.finditer(expression) if token["name"]]


def evaluate(expression: str, values: dict[str, int]) -> int:
    """``expression``'s value with ``values`` for its names; UsageError naming it otherwise.

    Integers only: ``/`` must come out whole (``//`` rounds down), as a batch size or a
    step count must."""
    tokens = _tokens(expression)
    position = 0

    def peek() -> str | None:
        return tokens[position] if position < len(tokens) else None

    def take() -> str:
        nonlocal position
        position += 1
        return tokens[position - 1]

    def sum_() -> int:
        value = product()
        while peek() in ("+", "-"):
            value = value + product() if take() == "+" else value - product()
        return value

    def product() -> int:
        value = factor()
        while peek() in ("*", "/", "//"):
            op, right = take(), factor()
            if op == "*":
                value *= right
                continue
            if right == 0:
                raise _bad(expression, "divides by 0", values)
            if op == "/" and value % right:
                raise _bad(expression, f"is {value}/{right} = {value / right:g}, not a whole "
                           "number (// rounds down)", values)
            value //= right
        return value

    def factor() -> int:
        token = peek()
        if token is None:
            raise _malformed(expression)
        take()
        if token == "-":
            return -factor()
        if token == "(":
            value = sum_()
            if peek() != ")":
                raise _malformed(expression)
            take()
            return value
        if token.isdigit():
            return int(token)
        if token in values:
            return values[token]
        raise _malformed(expression)

    value = sum_()
    if position != len(tokens):
        raise _malformed(expression)
    return value


def _tokens(expression: str) -> list[str]:
    tokens, position = [], 0
    while expression[position:].strip():
        match = _TOKEN.match(expression, position)
        if match is None:
            raise _malformed(expression)
        tokens.append(match.group().strip())
        position = match.end()
    return tokens


def _malformed(expression: str) -> UsageError:
    return UsageError(f"the command's placeholder {{{expression}}} is not an expression; "
                      "allowed: " + ", ".join(f"{{{name}}}" for name in PLACEHOLDERS)
                      + " and integer arithmetic over them (+ - * / // and parentheses), "
                      "e.g. {nproc*accum}; write {{ and }} for a literal brace")


def _bad(expression: str, what: str, values: dict[str, int]) -> UsageError:
    at = ", ".join(f"{name}={values[name]}" for name in dict.fromkeys(names_in(expression)))
    return UsageError(f"the command's placeholder {{{expression}}} {what} at {at}; allowed: "
                      "expressions whose value is a whole number at every split")


def substitute(argument: str, values: dict[str, int]) -> str:
    """One argument with its placeholders replaced and ``{{``, ``}}`` made single."""
    raw = _keeps_its_braces(argument)

    def piece(match: re.Match) -> str:
        if match["expression"] is not None:
            return str(evaluate(match["expression"], values))
        if raw or match["other"] is not None:
            return match.group()
        return "{" if match["open"] else "}"

    return _PIECE.sub(piece, argument)


def used_placeholders(command: Sequence[str]) -> set[str]:
    """Every name the command's placeholders use."""
    return {name for argument in command for expression in expressions(argument)
            for name in names_in(expression)}


def check_placeholders(command: Sequence[str], splits: Sequence[Split],
                       global_batch: int = 0) -> None:
    """Every placeholder known and whole at every split, and the command told what each
    split changes: without ``{batch}`` every split would take the script's own
    micro-batch, and with k > 1 a command must pass ``{accum}``, or ``{batch}`` and
    ``{global_batch}``, from which the script derives k (llm.c, LitGPT)."""
    used = used_placeholders(command)
    for name in sorted(used - set(PLACEHOLDERS)):
        raise UsageError(f"the command's placeholder {{{name}}} is unknown; allowed: "
                         + ", ".join(f"{{{known}}}" for known in PLACEHOLDERS)
                         + f" and arithmetic over them; write {{{{{name}}}}} for a literal "
                         f"{{{name}}} (an f-string's braces)")
    for split in splits:
        for argument in command:
            substitute(argument, split.values(global_batch or split.pieces))
    derived = {"batch", "global_batch"} <= used
    for split in splits:
        if split.accum_steps > 1 and "accum" not in used and not derived:
            raise UsageError(f"split {split.label} accumulates {split.accum_steps} micro-steps "
                             "but the command has no {accum}; allowed: a command that passes "
                             "{accum} to the script (e.g. --grad-accum {accum}, or "
                             "{nproc*accum} where it counts micro-steps over all ranks), or "
                             "{batch} and {global_batch} where the script derives k from "
                             "them, or splits NxK with K = 1")
        if split.pieces > 1 and "batch" not in used:
            raise UsageError(f"split {split.label} cuts the global batch into {split.pieces} "
                             "micro-batches but the command has no {batch}; allowed: a command "
                             "that passes {batch} to the script (e.g. --batch-size {batch})")


def substituted(command: Sequence[str], split: Split, global_batch: int) -> list[str]:
    """The command of one split: every placeholder replaced by its value."""
    values = split.values(global_batch)
    return [substitute(argument, values) for argument in command]
