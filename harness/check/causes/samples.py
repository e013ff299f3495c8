"""What a step's sample fingerprints say (grad-check run records each sample a step fed:
harness/grad_check/script/samples.py). A heuristic: the causes that read it explain a
measured difference, and never turn a gradient that matches into anything else.

A sample is ``[fingerprint, fingerprint without its trailing padding, last value]`` (and,
where recorded, its length with and without that padding).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from harness.check.causes.evidence import Evidence

Sample = Sequence[str]
#: Candidate padding values tried when telling padding from content.
PADDING_CANDIDATES = 3


def counted(samples: Sequence[Sample], padding: str | None) -> collections.Counter[str]:
    """The samples as a multiset, rows ending in ``padding`` without their trailing run."""
    return collections.Counter(sample[1] if padding is not None and sample[2] == padding
                               else sample[0] for sample in samples)


def same_samples(ours: Sequence[Sample], theirs: Sequence[Sample]) -> bool:
    """Whether two steps fed the same samples, counted with repeats, once padding (a
    trailing run of one value, the same in every padded row) is left out."""
    lasts = collections.Counter(sample[2] for sample in [*ours, *theirs])
    for padding in (None, *(value for value, _ in lasts.most_common(PADDING_CANDIDATES))):
        if counted(ours, padding) == counted(theirs, padding):
            return True
    return False


def drawn_alike(ours: Sequence[int], theirs: Sequence[int]) -> bool:
    """Whether two steps were handed the same dataset indices (with repeats)."""
    return bool(ours) and collections.Counter(ours) == collections.Counter(theirs)


def fed_otherwise(evidence: Evidence) -> bool:
    """A script's step fed other samples than the reference's."""
    script = evidence.script
    return script is not None and not same_samples(script.samples, script.reference_samples)


def sampled_otherwise(evidence: Evidence) -> bool:
    """Other samples, and other dataset items drawn: the sampler's doing, not the values'."""
    script = evidence.script
    return fed_otherwise(evidence) and not drawn_alike(script.indices, script.reference_indices)


def by_rank(evidence: Evidence) -> list[collections.Counter[str]]:
    """Each rank's samples as a multiset of their fingerprints."""
    return [collections.Counter(sample[0] for sample in rank)
            for rank in evidence.script.samples_by_rank]


def of_reference(evidence: Evidence) -> collections.Counter[str]:
    return collections.Counter(sample[0] for sample in evidence.script.reference_samples)


def extra_and_missing(evidence: Evidence) -> tuple[int, int]:
    """How many samples the step fed that the reference's did not, and left out of its."""
    together, reference = sum(by_rank(evidence), collections.Counter()), of_reference(evidence)
    return sum((together - reference).values()), sum((reference - together).values())


def fed_other_samples(evidence: Evidence) -> str:
    """``step s fed E sample(s) the reference's step did not and left out M of its T``."""
    extra, missing = extra_and_missing(evidence)
    return (f"step {evidence.step} fed {extra} sample(s) the reference's step did not and left "
            f"out {missing} of its {len(evidence.script.reference_samples)}")
