"""Whether the script repeats its steps: the reference split is run twice, and a second run
that differs from the first beyond its precision's tolerance (other steps, other samples,
other tensors) makes every split's comparison meaningless, so the check refuses it
(:class:`~harness.grad_check.script.failures.ReferenceUnusable`, exit code 1). Where the
two runs agree, how far apart they are at each point is the rows' ``reference_noise``."""

from __future__ import annotations

from harness.check.causes.samples import same_samples
from harness.check.causes.words import WHAT, shown
from harness.check.precision import tolerance
from harness.columns import POINTS
from harness.grad_check.script.failures import ReferenceUnusable, Unusable
from harness.grad_check.script.records import Captured
from harness.grad_check.script.split_judge import (
    Noise,
    Unmatched,
    compared,
    noise,
    precision,
)
from harness.tolerances import dtype_name
from harness.verdicts import Equivalence


def not_deterministic(label: str, what: str, dropout: list[str],
                      alike: str = "") -> ReferenceUnusable:
    """The reference's two runs did not repeat each other (``what``: how; ``alike``: the
    same without what no two such runs say alike, a magnitude drawn at random)."""
    modules = f" (the model's {shown(dropout)})" if dropout else ""

    def line(how: str) -> str:
        return (f"the reference {label} ran twice and {how}: the script is not deterministic; "
                f"allowed: a script that repeats its steps exactly: look at dropout{modules}, "
                "an unseeded sampler or generator (seed torch, numpy and random at the start, "
                "DataLoader(generator=...)), nondeterministic kernels "
                "(torch.use_deterministic_algorithms(True))")

    return ReferenceUnusable(line(what), Unusable.NOT_DETERMINISTIC, line(alike or what))


def check_deterministic(first: Captured, again: Captured) -> Noise:
    """Refuse a reference whose two runs differ beyond its precision's tolerance; else the
    noise between them, by (optimizer, step, point)."""
    label = first.run.split.label
    steps = [first.steps(o) for o in range(len(first.optimizers))]
    if steps != [again.steps(o) for o in range(len(again.optimizers))]:
        raise not_deterministic(label, f"stepped {first.total_steps} then {again.total_steps} "
                                "time(s)", first.dropout)
    rtol = tolerance(precision(first, again))
    measured: Noise = {}
    for optimizer, count in enumerate(steps):
        for step in range(count):
            if not same_samples(again.samples(optimizer, step),
                                        first.samples(optimizer, step)):
                raise not_deterministic(label, f"fed other samples in step {step}",
                                        first.dropout)
            for point in POINTS:
                measured[(optimizer, step, point)] = _repeated(first, again, optimizer, step,
                                                               point, rtol)
    return measured


def _repeated(first: Captured, again: Captured, optimizer: int, step: int, point: str,
              rtol: float) -> float:
    """How far the reference's second run is from its first at one point; refused beyond
    the precision's tolerance."""
    label = first.run.split.label
    try:
        comparison = compared(again, first, optimizer, step, point, rtol)
    except Unmatched as unmatched_:
        raise not_deterministic(label, str(unmatched_), first.dropout) from None
    distance = noise(again, first, optimizer, step, point)
    if comparison.verdict is not Equivalence.MATCHES:
        beyond = f"beyond {dtype_name(precision(first, again))}'s tolerance {rtol:g}"
        raise not_deterministic(
            label, f"its step {step} {WHAT[point]} differed ({distance:.3g} relative, {beyond})",
            first.dropout, f"its step {step} {WHAT[point]} differed ({beyond})")
    return distance
