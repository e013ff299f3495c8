"""The words the update study's verdict columns may hold (see harness/verdicts.py for why enums).

``verdict`` reuses :class:`harness.verdicts.Equivalence` (``matches`` / ``differs``)
for "are the parameters after the optimizer step the big-batch run's?"; the
two enums here are the update study's own.
"""

from __future__ import annotations

from enum import StrEnum


class LrFactor(StrEnum):
    """Whether some learning-rate factor c makes a recipe's run equal the big-batch run."""

    #: lr * c gives the big-batch parameters within the update tolerance.
    EXACT = "exact"
    #: Only within the approximate tolerance (e.g. Adam, whose scale invariance holds up to eps).
    APPROXIMATE = "approximate"
    #: No factor tried comes within the approximate tolerance (e.g. coupled weight decay).
    NONE = "none"


class ScalingRule(StrEnum):
    """Whether Goyal's linear scaling rule held for one learning rate."""

    #: One step at lr * N on the N-times batch lands within the rule's tolerance of
    #: the N small steps at lr.
    HOLDS = "holds"
    BREAKS = "breaks"
