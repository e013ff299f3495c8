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


class Equivalence(StrEnum):
    """How a measured gradient (or update) relates to its big-batch reference."""

    MATCHES = "matches"
    #: A pure multiple of the reference, the multiple not 1.
    SCALED = "scaled"
    #: No multiple of the reference explains it.
    DIFFERS = "differs"
    #: The ranks ended the step holding different tensors, where only rank 0's were
    #: compared with the reference: whatever rank 0's say, the others' differ.
    RANKS_DIFFER = "ranks differ"


#: The ``--fail-on`` levels under which a row with each verdict fails a check (a verdict
#: not named here fails under none; a row's status may fail it whatever its verdict).
FAILS_UNDER: dict[Equivalence, frozenset[str]] = {
    Equivalence.DIFFERS: frozenset({"differs", "scaled"}),
    Equivalence.RANKS_DIFFER: frozenset({"differs", "scaled"}),
    Equivalence.SCALED: frozenset({"scaled"}),
}


class Status(StrEnum):
    """Whether a row of the check was judged, and where not, why."""

    OK = "ok"
    #: The case or split failed: the row's ``error`` says how.
    ERROR = "error"
    #: Not run here: written ``skipped: why``.
    SKIPPED = "skipped"
    #: The gradient was all zero in the case and in the reference: nothing was compared.
    NO_GRADIENT = "no gradient"
    #: The step moved no parameter in the case or in the reference, at a learning rate
    #: other than 0: nothing was compared.
    NO_UPDATE = "no update"
    #: Measured, and beyond the reach of its precision: a float32 step within float32's
    #: tolerance but above its rounding (only a run in float64 can tell); or an update
    #: below float32 off by more than the tolerance after a gradient that matched it, at
    #: scale 1 (an adaptive optimizer magnifies the gradient's rounding in its step, which
    #: such a run cannot tell from a difference of the optimizer's own; a run in float32
    #: can). Neither a match nor a failure: the row says which run resolves it.
    UNRESOLVED = "unresolved"


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
