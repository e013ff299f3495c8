"""Cause ``trainer-count-unshifted``: the Trainer counted the window's labels before the
causal shift (the model's ``loss_type`` is not ForCausalLM), but the loss averages the
tokens it predicts: the step is predicted / counted times the big batch's."""

from __future__ import annotations

from harness.check.causes.cause import Cause
from harness.check.causes.evidence import Evidence
from harness.check.causes.trainer_count_ignored import passed_a_count
from harness.tolerances import close
from harness.verdicts import Equivalence


def applies(evidence: Evidence) -> bool:
    if not passed_a_count(evidence):
        return False
    framework = evidence.framework
    counted, predicted = framework.label_counts
    recipe = framework.recipe
    return (framework.counts_passed[0] == counted != predicted
            and recipe.verdict is Equivalence.SCALED
            and close(recipe.scale, predicted / counted, evidence.facts.rtol))


def fix(evidence: Evidence) -> str:
    framework = evidence.framework
    counted, predicted = framework.label_counts
    model = framework.model()
    return (f"the Trainer passed num_items_in_batch = {counted}, the window's labels other "
            f"than {framework.ignored_label} counted before the shift, but the loss averages "
            f"over the {predicted} tokens it predicts (labels[..., 1:]): {type(model).__name__}."
            f"loss_type is {getattr(model, 'loss_type', None)!r}, so the Trainer does not "
            "count the shifted labels; set model.loss_type = \"ForCausalLM\"")


CAUSE = Cause(id="trainer-count-unshifted", summary="the Trainer counts the labels before the "
              "causal shift", applies=applies, fix=fix)
