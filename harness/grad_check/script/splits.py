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
from harness.options import MAX_NPROC

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
_TOKEN = re.compile(r"\s*(?:(?P<number>[0-9]+)|(?P<name>[a-z_][a-z0-9_]*)|(?P<op>//|[-+*/()]))")
#: More micro-steps per optimizer step than any real recipe needs only makes a check slow.
MAX_ACCUM_STEPS = 1024
#: A global batch larger than this cannot be checked: the capture keeps a fingerprint of
#: every sample a step feeds (a few strings, ~100 bytes each once saved) and the launcher
#: reads every rank's, so 2^24 samples are already ~2 GB of records per step.
MAX_GLOBAL_BATCH = 2**24


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
    match = re.fullmatch(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*", text)
    if (not match or not 1 <= int(match[1]) <= MAX_NPROC
            or not 1 <= int(match[2]) <= MAX_ACCUM_STEPS):
        raise UsageError(f"{flag}: {text.strip()!r} is not a split; allowed: NxK with 1 <= N "
                         f"<= {MAX_NPROC} ranks and 1 <= K <= {MAX_ACCUM_STEPS} micro-steps "
                         "(ASCII digits), e.g. 2x4")
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
    parser = _Parser(expression, values)
    value = parser.sum_()
    if not parser.done():
        raise _malformed(expression)
    return value


class _Parser:
    """Reads an expression's tokens left to right by recursive descent: a sum of products
    of factors (an integer, a name, ``-`` factor, or a parenthesized sum)."""

    def __init__(self, expression: str, values: dict[str, int]) -> None:
        self.expression = expression
        self.values = values
        self.tokens = _tokens(expression)
        self.position = 0

    def done(self) -> bool:
        return self.position == len(self.tokens)

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        self.position += 1
        return self.tokens[self.position - 1]

    def sum_(self) -> int:
        value = self.product()
        while self.peek() in ("+", "-"):
            value = value + self.product() if self.take() == "+" else value - self.product()
        return value

    def product(self) -> int:
        value = self.factor()
        while self.peek() in ("*", "/", "//"):
            op, right = self.take(), self.factor()
            value = value * right if op == "*" else self.divided(value, op, right)
        return value

    def divided(self, value: int, op: str, right: int) -> int:
        """``value / right`` (whole, or a UsageError) or ``value // right``."""
        if right == 0:
            raise _bad(self.expression, "divides by 0", self.values)
        if op == "/" and value % right:
            raise _bad(self.expression, f"is {value}/{right} = {value / right:g}, not a whole "
                       "number (// rounds down)", self.values)
        return value // right

    def factor(self) -> int:
        token = self.peek()
        if token is None:
            raise _malformed(self.expression)
        self.take()
        if token == "-":
            return -self.factor()
        if token == "(":
            value = self.sum_()
            if self.peek() != ")":
                raise _malformed(self.expression)
            self.take()
            return value
        if token.isdigit():
            return int(token)
        if token in self.values:
            return self.values[token]
        raise _malformed(self.expression)


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
