"""Where a row stands in the check's own order of causes, asked by the causes of each
branch: a buffer; a later row that follows step 0's scaled gradient; a pure scale; or a
difference no single scale explains (harness/check/causes/__init__.py gives the order)."""

from __future__ import annotations

import math

from harness.check.causes.evidence import Evidence
from harness.tolerances import close
from harness.verdicts import Equivalence


def off(evidence: Evidence) -> bool:
    """The row the check's own causes explain is not the big batch's."""
    return evidence.explained.verdict is not Equivalence.MATCHES


def of_buffers(evidence: Evidence) -> bool:
    return off(evidence) and evidence.point == "buffers"


def follows_gradient_scale(evidence: Evidence) -> bool:
    """One of the later rows of a case whose step-0 gradient is scaled, which that scale
    does not explain by itself."""
    comparison, facts = evidence.explained, evidence.facts
    if not off(evidence) or facts.gradient_scale is None or evidence.point == "buffers":
        return False
    return not (comparison.verdict is Equivalence.SCALED
                and close(comparison.scale, facts.gradient_scale, facts.rtol))


def purely_scaled(evidence: Evidence) -> bool:
    """A pure multiple of the big batch's (not a buffer, not following step 0's scale)."""
    comparison = evidence.explained
    return (off(evidence) and evidence.point != "buffers"
            and not follows_gradient_scale(evidence)
            and comparison.verdict is Equivalence.SCALED and not math.isnan(comparison.scale))


def unexplained_by_a_scale(evidence: Evidence) -> bool:
    """A difference no single scale describes: what the check's last causes look into."""
    return (off(evidence) and evidence.point != "buffers"
            and not follows_gradient_scale(evidence) and not purely_scaled(evidence))
