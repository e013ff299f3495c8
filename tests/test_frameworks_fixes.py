"""What a framework's row says to change, from what was seen (the framework causes of
harness/check/causes/): each cause on a hand-made measurement whose truth is known, no
framework run."""

from __future__ import annotations

import torch
from torch import nn

from harness.adapters.data import IGNORE, label_counts
from harness.adapters.hf_trainer import FRAMEWORK as TRAINER
from harness.adapters.registry import DEFAULT, Applied, Job
from harness.adapters.step_capture import StepCapture
from harness.check.causes import Explanation, explain
from harness.check.causes.evidence import Evidence, FrameworkStep
from harness.check.compare import Comparison
from harness.check.fix import Facts
from harness.check.setup import Setup
from harness.fit import ScaleFit
from harness.verdicts import Equivalence

RTOL = 1e-9
#: Three rows of five labels: 13 other than -100 (the Trainer's count before the shift),
#: 10 after it (what a causal LM predicts).
LABELS = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, -100, -100], [1, 2, 3, 4, 5]])
COUNTED, PREDICTED = 13, 10


class CausalLM(nn.Module):
    loss_type = None

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)


def job() -> Job:
    setup = Setup(make_model=CausalLM, batch=lambda i: {"input_ids": LABELS, "labels": LABELS},
                  loss=lambda model, batch: torch.zeros((), requires_grad=True), name="lm")
    return Job(setup, TRAINER.setting(DEFAULT), accum_steps=1, dtype=torch.float64,
               capture=StepCapture(), world_size=3)


def comparison(verdict: Equivalence, scale: float, residual: float = 0.0) -> Comparison:
    return Comparison(ScaleFit(scale, residual), verdict, {"head.weight": residual})


NOTHING_APPLIED = Applied("")


def explained(plain: Comparison, recipe: Comparison | None = None,
              applied: Applied = NOTHING_APPLIED, lrs=((0.1,), (0.1,))) -> Explanation:
    """The gradient row's cause, as the frameworks' measure hands its evidence."""
    facts = Facts(world_size=3, accum_steps=1, rtol=RTOL)
    step = FrameworkStep(recipe or plain, TRAINER.name, TRAINER.clip_setting, TRAINER.clip_off,
                         TRAINER.schedules, applied.clip, applied.counts_passed,
                         applied.count_ignored, label_counts(job().windows[0]), IGNORE, lrs,
                         job().setup.make_model)
    return explain(Evidence(0, "grad", plain, facts, framework=step))


def fix(*args, **kwargs) -> str:
    return explained(*args, **kwargs).fix


def test_a_count_of_the_labels_before_the_shift_is_named_with_both_counts():
    scaled = comparison(Equivalence.SCALED, PREDICTED / COUNTED)
    text = fix(scaled, applied=Applied("", counts_passed=(COUNTED,), count_ignored=False))
    assert f"num_items_in_batch = {COUNTED}" in text and f"the {PREDICTED} tokens" in text
    assert "CausalLM.loss_type is None" in text and 'loss_type = "ForCausalLM"' in text
    assert explained(scaled, applied=Applied("", counts_passed=(COUNTED,),
                                             count_ignored=False)).cause == \
        "trainer-count-unshifted"


def test_another_scale_with_a_count_passed_is_not_blamed_on_the_count():
    scaled = comparison(Equivalence.SCALED, 0.5)
    text = fix(scaled, applied=Applied("", counts_passed=(COUNTED,), count_ignored=False))
    assert "loss_type" not in text and "multiply the loss by 2" in text


def test_a_count_the_loss_ignores_is_named():
    differs = comparison(Equivalence.DIFFERS, 2.7, 0.3)
    text = fix(differs, applied=Applied("", counts_passed=(COUNTED,), count_ignored=True))
    assert f"passed num_items_in_batch = {COUNTED}" in text
    assert "the loss ignores the count" in text


def test_a_clip_that_binds_is_named_before_any_other_cause():
    plain = comparison(Equivalence.SCALED, 0.25)
    text = fix(plain, comparison(Equivalence.MATCHES, 1.0), Applied("", clip=1.0,
                                                                     counts_passed=(COUNTED,)))
    assert text.startswith("transformers's clip binds") and "max_grad_norm=0" in text


def test_a_learning_rate_other_than_the_big_batchs_names_how_the_framework_schedules():
    plain = comparison(Equivalence.SCALED, 0.5)
    text = fix(plain, lrs=((0.025,), (0.05,)))
    assert "learning rate 0.025 where the big batch's step used 0.05" in text
    assert TRAINER.schedules in text


def test_a_match_needs_no_fix():
    assert explained(comparison(Equivalence.MATCHES, 1.0)) == Explanation()


def test_a_binding_clip_does_not_explain_a_recipe_scaled_below_1():
    """The framework's clip binds, but the big batch clipped the same way is still twice
    the framework's gradient: the clip did not hide the scale, the accumulation is off."""
    plain = comparison(Equivalence.SCALED, 0.3)
    text = fix(plain, comparison(Equivalence.SCALED, 0.5), Applied("", clip=1.0))
    assert "hides the accumulation's own scale" not in text
    assert "multiply the loss by 2" in text


def test_the_trainers_count_is_read_from_step_0s_window():
    """Two steps of two micro-steps, their windows counting other tokens: step 0's rows
    are judged with step 0's counts."""
    from harness.adapters.hf_trainer import first_window

    assert first_window([13, 10, 7, 12], accum_steps=2) == (13, 10)
    assert first_window([], accum_steps=2) is None
