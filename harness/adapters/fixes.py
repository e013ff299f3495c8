"""The fix of a framework's row: what only a framework does, then the check's own fixes.

A framework may clip the window's gradient by default, step the setup's scheduler its
own way, or hand the loss a count (the Trainer's ``num_items_in_batch``) that the model
counts or uses differently: each is named from what was seen. Everything else (a scale
named as k, N or N*k, BatchNorm, unused parameters, a loss whose pieces do not average
to the whole) is the check's :func:`harness.check.fix.suggest`, on the comparison with
the big batch under the framework's recipe.
"""

from __future__ import annotations

from typing import Any

from harness.adapters.data import IGNORE
from harness.adapters.registry import Applied, Framework, Job
from harness.check.compare import Comparison
from harness.check.fix import Facts, suggest
from harness.tolerances import CLIPPED_ALIKE, close
from harness.verdicts import Equivalence


def framework_fix(point: str, plain: Comparison, recipe: Comparison, facts: Facts,
                  framework: Framework, applied: Applied,
                  lrs: tuple[tuple[float, ...], tuple[float, ...]], job: Job) -> str:
    """The fix a row's two comparisons point to; empty where the plain step is matched."""
    if plain.verdict is Equivalence.MATCHES:
        return ""
    if applied.clip:
        if recipe.verdict is Equivalence.MATCHES:
            return (f"{framework.name}'s clip binds: {framework.clip_setting} clipped the "
                    f"window's gradient to norm {applied.clip:g}, scaling the step by "
                    f"{plain.scale:.4g} (once per window, as a big batch clipped the same "
                    f"way); for the plain loop's step set {framework.clip_off}")
        if abs(recipe.scale - 1) < CLIPPED_ALIKE:
            return (f"{framework.name}'s clip binds and hides the accumulation's own scale: "
                    f"{framework.clip_setting} clipped the window's gradient to norm "
                    f"{applied.clip:g}, as it clips the big batch's; set {framework.clip_off} "
                    "to see the scale, or fix it where the loss is computed")
    used, expected = lrs
    if not all(close(a, b, facts.rtol) for a, b in zip(used, expected, strict=True)):
        return (f"the optimizer stepped at learning rate {_rates(used)} where the big batch's "
                f"step used {_rates(expected)}: {framework.schedules}")
    if applied.counts_passed and (why := count_fix(recipe, applied, job, facts.rtol)):
        return why
    return suggest(point, recipe, facts)


def _rates(rates: tuple[float, ...]) -> str:
    return "/".join(f"{rate:.6g}" for rate in rates)


def count_fix(recipe: Comparison, applied: Applied, job: Job, rtol: float) -> str:
    """What the count the Trainer passed does to the step, where it explains the row: a
    count the loss ignores, or a count of other tokens than the loss averages over."""
    passed = applied.counts_passed[0]
    if applied.count_ignored:
        return (f"the model's forward takes **kwargs, so the Trainer passed "
                f"num_items_in_batch = {passed} and stopped dividing the loss by k (it "
                "multiplies it by N instead, undoing DDP's average), but the loss ignores the "
                "count (the same loss with twice the count): divide the summed loss by "
                "num_items_in_batch, or set model.accepts_loss_kwargs = False (the Trainer "
                "then divides by k)")
    counted, predicted = _label_counts(job.windows[0])
    if (passed == counted != predicted and recipe.verdict is Equivalence.SCALED
            and close(recipe.scale, predicted / counted, rtol)):
        model = job.setup.make_model()
        return (f"the Trainer passed num_items_in_batch = {counted}, the window's labels "
                f"other than {IGNORE} counted before the shift, but the loss averages over "
                f"the {predicted} tokens it predicts (labels[..., 1:]): "
                f"{type(model).__name__}.loss_type is {getattr(model, 'loss_type', None)!r}, "
                "so the Trainer does not count the shifted labels; set "
                "model.loss_type = \"ForCausalLM\"")
    return ""


def _label_counts(window: Any) -> tuple[int, int]:
    """The window's labels other than -100: all of them, and those after the shift."""
    if not isinstance(window, dict) or "labels" not in window:
        return 0, 0
    labels = window["labels"]
    return int(labels.ne(IGNORE).sum()), int(labels[..., 1:].ne(IGNORE).sum())
