"""Which of N and k a scale follows, told from the other splits of the same run.

A split with as many ranks as micro-steps (2x2) cannot tell by itself whether a gradient
half the big batch's follows N or k: both are 2. The other splits of the run can: where
1x2 matches and 2x1 is scaled 1/2, the loss is divided by N once too often (a loss
divided by N*k under DDP), and the fix names N. Each judged row of a split whose N and k
differ says, for its optimizer and step, the power of N and of k its scale is (s = N^a *
k^b, a and b in -1, 0, 1, a split of N = 1 saying nothing of a, one of k = 1 nothing of
b); they are pooled, and a tie is named by the factor they show, or as "N or k" where they
show neither or contradict each other.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from harness.check.precision import tolerance
from harness.tolerances import close
from harness.verdicts import Equivalence

#: (optimizer, step, point): the rows of one point of one optimizer step.
Key = tuple[str, int, str]
#: Each factor's power where known: {"N": a, "k": b}.
Powers = dict[str, int]
#: The name of a tie where nothing tells N from k.
EITHER = "N or k"


def powers_of(scale: float, world_size: int, accum_steps: int, rtol: float) -> Powers:
    """The powers of N and k that make ``scale`` (s = N^a * k^b, each in -1..1) where one
    pair alone does; a factor of 1 has no power to tell. Empty where none or several fit,
    and at N == k, where the two cannot be told apart."""
    if not math.isfinite(scale) or scale <= 0 or world_size == accum_steps:
        return {}
    fitting = [(a, b) for a, b in itertools.product((-1, 0, 1), repeat=2)
               if (world_size > 1 or a == 0) and (accum_steps > 1 or b == 0)
               and close(scale, float(world_size) ** a * float(accum_steps) ** b, rtol)]
    if len(fitting) != 1:
        return {}
    (a, b), = fitting
    return {name: power for name, power, factor in (("N", a, world_size), ("k", b, accum_steps))
            if factor > 1}


def evidence(rows: Iterable[Mapping[str, Any]]) -> dict[Key, Powers]:
    """The powers each optimizer step's rows show, pooled over the splits whose N and k
    differ, each scale told at its row's precision's tolerance (a factor given two
    different powers is dropped: no telling then)."""
    pooled: dict[Key, dict[str, set[int]]] = {}
    for row in rows:
        if row.get("verdict") not in (Equivalence.MATCHES, Equivalence.SCALED):
            continue
        scale = 1.0 if row["verdict"] == Equivalence.MATCHES else float(row["scale"])
        rtol = tolerance(getattr(torch, str(row["precision"])))
        found = powers_of(scale, int(row["world_size"]), int(row["accum_steps"]), rtol)
        for name, power in found.items():
            key = (str(row["optimizer"]), int(row["step"]), str(row["point"]))
            pooled.setdefault(key, {}).setdefault(name, set()).add(power)
    return {key: {name: next(iter(seen)) for name, seen in powers.items() if len(seen) == 1}
            for key, powers in pooled.items()}


def tie_name(powers: Powers) -> str:
    """How a value that is both N and k is named, by what the other splits show: the
    factor that scales (or the other one, where that one is shown not to)."""
    n, k = powers.get("N"), powers.get("k")
    says_n = (n is not None and n != 0) or k == 0
    says_k = (k is not None and k != 0) or n == 0
    if says_n and not says_k:
        return "N"
    if says_k and not says_n:
        return "k"
    return EITHER


def step_tie(ties: Mapping[Key, str], optimizer: str, step: int) -> str:
    """The name of a tie at one optimizer step: its gradient's, else its update's (an lr
    scaled with N leaves every gradient matching and shows in the updates alone)."""
    by_gradient = ties.get((optimizer, step, "grad"), EITHER)
    return by_gradient if by_gradient != EITHER else ties.get((optimizer, step, "params"),
                                                              EITHER)
