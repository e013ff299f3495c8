"""The words a verdict column may hold, one enum per kind of verdict.

A verdict is written by the measuring code, in the row, and only read by the
report: these enums are the vocabulary both sides share, so that a typo on
either side is an AttributeError instead of a finding that silently never fires.
They are ``StrEnum``: a member *is* its CSV text (``Reduction.MEAN == "mean"``).
"""

from __future__ import annotations

from enum import StrEnum


class Reduction(StrEnum):
    """How a measured gradient relates to the sum of what N devices contributed."""

    MEAN = "mean"
    SUM = "sum"
    #: N = 1: summing and averaging are the same operation.
    SUM_EQUALS_MEAN = "sum=mean"
    #: No weight 1 or 1/N (or no weight at all) explains the gradient.
    OTHER = "other"


class Worded(StrEnum):
    """A word of a CSV column declared with its meaning, once: ``Member = "word", "meaning"``.
    The schemas, and docs/results.md from them, say what each word means from here."""

    meaning: str

    def __new__(cls, word: str, meaning: str = "") -> Worded:
        member = str.__new__(cls, word)
        member._value_ = word
        member.meaning = meaning
        return member

    @classmethod
    def described(cls) -> str:
        """Every word with its meaning, as a schema's column says them."""
        return "; ".join(f"`{member}`: {member.meaning}" for member in cls)

    @classmethod
    def words(cls) -> str:
        return ", ".join(f"`{member}`" for member in cls)


class Equivalence(Worded):
    """How a measured gradient (or update) relates to its big-batch reference."""

    MATCHES = "matches", "the big batch's step, within the row's tolerance"
    SCALED = "scaled", "a pure multiple `scale` of the big batch's step, the multiple not 1"
    DIFFERS = "differs", "no multiple of the big batch's step explains it"
    RANKS_DIFFER = "ranks differ", (
        "the ranks ended the step holding different tensors where only rank 0's were compared "
        "with the big batch (`grad-check run`): whatever rank 0's say, the others' differ")


#: The verdicts a scale fit alone gives (harness/fit.py); ``ranks differ`` is the check's,
#: where the ranks disagree.
FIT_VERDICTS = (Equivalence.MATCHES, Equivalence.SCALED, Equivalence.DIFFERS)


#: The ``--fail-on`` levels under which a row with each verdict fails a check (a verdict
#: not named here fails under none; a row's status may fail it whatever its verdict).
FAILS_UNDER: dict[Equivalence, frozenset[str]] = {
    Equivalence.DIFFERS: frozenset({"differs", "scaled"}),
    Equivalence.RANKS_DIFFER: frozenset({"differs", "scaled"}),
    Equivalence.SCALED: frozenset({"scaled"}),
}


class Status(Worded):
    """Whether a row of the check was judged, and where not, why."""

    OK = "ok", "measured and judged: the verdict says how it compares"
    ERROR = "error", "the case or split failed: `error` says how"
    SKIPPED = "skipped", ("not run here, written `skipped: why` (e.g. an update at learning "
                          "rate 0, a case that needs more devices)")
    NO_GRADIENT = "no gradient", ("the gradient was all zero in the case and in the big "
                                  "batch alike: nothing was compared")
    NO_UPDATE = "no update", ("the step moved no parameter in the case or in the big batch, "
                              "at a learning rate other than 0: nothing was compared")
    UNRESOLVED = "unresolved", (
        "measured, and beyond the reach of its precision (the verdict is left empty): a "
        "float32 step within float32's tolerance but above its rounding (a run in float64 "
        "tells), an update that carries such a gradient's difference, or an update below "
        "float32 off at scale 1 after a gradient that matched (an adaptive optimizer "
        "magnifies the gradient's rounding; a run in float32 tells); neither a match nor a "
        "failure")


#: Statuses that fail a check's exit code whatever ``--fail-on`` says: nothing was checked.
FAILING_STATUSES = frozenset({Status.ERROR, Status.NO_GRADIENT, Status.NO_UPDATE})


def skipped(why: str) -> str:
    """A skipped row's status: ``skipped: why``."""
    return f"{Status.SKIPPED}: {why}"


class Combination(StrEnum):
    """What a scalar is of the per-device contributions it came from."""

    SUM = "sum"
    MEAN = "mean"
    NEITHER = "neither"
    #: No contribution was recorded.
    UNRECORDED = "unrecorded"


class HookVerdict(StrEnum):
    """What a reduction variant did to the gradient, against the exact average ḡ."""

    #: Equal to ḡ within the run's tolerance.
    EXACT = "exact"
    #: Off, but by no more than rounding in its (narrower) wire format allows.
    COMPRESSED = "compressed"
    #: A pure multiple N of ḡ: the sum of the ranks' gradients, never divided.
    SUMMED = "summed"
    #: A pure multiple 1/N of ḡ: divided by the world size twice.
    OVER_AVERAGED = "over-averaged"
    #: A pure multiple of ḡ that is none of the above.
    SCALED = "scaled"
    #: Neither ḡ up to rounding nor a multiple of it (e.g. a low-rank approximation).
    DIFFERS = "differs"


def close(measured: float, expected: float, rtol: float) -> bool:
    """True when ``measured`` equals ``expected`` up to the relative tolerance ``rtol``."""
    return abs(measured - expected) <= rtol * max(abs(expected), 1.0)
