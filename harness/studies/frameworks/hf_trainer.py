"""HF transformers: ``Trainer`` with ``TrainingArguments(gradient_accumulation_steps=k)``.

The Trainer decides how to normalize a micro-step's loss from the user's model:
when the model *accepts loss kwargs* (its ``forward`` takes ``**kwargs``, or it says
so with an ``accepts_loss_kwargs`` attribute) or a ``compute_loss_func`` is given, it
counts the window's real tokens (``num_items_in_batch``, over all ranks with
``average_tokens_across_devices``), hands that count to the loss, multiplies the loss
by N to undo DDP's average, and does not divide by k; otherwise it divides the
micro-batch's loss by k. The settings are the ways a model opts in or out.

Every setting turns gradient clipping off (``max_grad_norm=0``; the Trainer clips at
1.0 by default), so that what is measured is the accumulation alone, and trains with
the setup's optimizer (SGD) at a constant learning rate.
"""

from __future__ import annotations

import tempfile

import torch
from torch import nn

from harness.check.reference import make_optimizer
from harness.check.setup import Setup
from harness.studies.frameworks.capture import (
    StepCapture,
    parameter_grads,
    parameter_values,
    watch_step,
)
from harness.studies.frameworks.registry import Framework, Setting
from harness.studies.frameworks.setups import (
    MICRO_BATCH,
    real_tokens,
    samples,
    token_mean,
    token_sum,
)

SETTINGS = (
    Setting("forward(labels)", "forward(input_ids, labels) returns the micro-batch's token "
            "mean", {"model": "plain"}, core=True),
    Setting("forward(num_items_in_batch)", "forward(input_ids, labels, "
            "num_items_in_batch=None): the count as a named parameter, no **kwargs",
            {"model": "named"}),
    Setting("forward(**kwargs)", "forward(input_ids, labels, **kwargs) divides the token sum "
            "by kwargs['num_items_in_batch']", {"model": "kwargs"}, core=True),
    Setting("forward(**kwargs) ignored", "forward(input_ids, labels, **kwargs) returns the "
            "micro-batch's token mean, ignoring num_items_in_batch", {"model": "kwargs-ignored"}),
    Setting("accepts_loss_kwargs=False", "forward(..., **kwargs) as above, the model's "
            "accepts_loss_kwargs = False", {"model": "kwargs", "accepts_loss_kwargs": False}),
    Setting("compute_loss_func", "Trainer(compute_loss_func=token_sum / num_items_in_batch), "
            "forward returns logits", {"model": "logits", "compute_loss_func": True}),
    Setting("average_tokens_across_devices=False", "forward(**kwargs) as above, "
            "TrainingArguments(average_tokens_across_devices=False)",
            {"model": "kwargs", "average_tokens_across_devices": False}),
)


class LanguageModel(nn.Module):
    """The setup's model the way HF models are written: ``forward`` takes the labels and
    returns a dict with the loss and the logits."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def outputs(self, input_ids: torch.Tensor, loss: torch.Tensor | None) -> dict:
        logits = self.inner(input_ids)
        return {"logits": logits} if loss is None else {"loss": loss, "logits": logits}


class MicroMean(LanguageModel):
    def forward(self, input_ids, labels=None):
        return {"loss": token_mean(self.inner(input_ids), labels)}


class NamedCount(LanguageModel):
    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        logits = self.inner(input_ids)
        if num_items_in_batch is None:
            return {"loss": token_mean(logits, labels)}
        return {"loss": token_sum(logits, labels) / num_items_in_batch}


class KwargsCount(LanguageModel):
    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.inner(input_ids)
        count = kwargs.get("num_items_in_batch")
        if count is None:
            return {"loss": token_mean(logits, labels)}
        return {"loss": token_sum(logits, labels) / count}


class KwargsIgnored(LanguageModel):
    def forward(self, input_ids, labels=None, **kwargs):
        return {"loss": token_mean(self.inner(input_ids), labels)}


class LogitsOnly(LanguageModel):
    def forward(self, input_ids, labels=None):
        return {"logits": self.inner(input_ids)}


MODELS = {"plain": MicroMean, "named": NamedCount, "kwargs": KwargsCount,
          "kwargs-ignored": KwargsIgnored, "logits": LogitsOnly}


def _token_loss_func(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func`` as the Trainer's docs write one: the window's token mean."""
    if num_items_in_batch is None:
        return token_mean(outputs["logits"], labels)
    return token_sum(outputs["logits"], labels) / num_items_in_batch


def _model(setup: Setup, setting: Setting) -> nn.Module:
    model = MODELS[setting.options["model"]](setup.make_model())
    if "accepts_loss_kwargs" in setting.options:
        model.accepts_loss_kwargs = setting.options["accepts_loss_kwargs"]
    return model


class _CountingCollator:
    """Stacks the samples into a micro-batch and counts the real tokens this rank trained on."""

    def __init__(self, capture: StepCapture) -> None:
        self.capture = capture

    def __call__(self, features: list[dict]) -> dict:
        batch = {name: torch.stack([f[name] for f in features]) for name in features[0]}
        self.capture.tokens += int(real_tokens(batch["labels"]))
        return batch


def train(setup: Setup, setting: Setting, accum_steps: int, capture: StepCapture) -> None:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from harness.studies.frameworks.hf_accelerate import reset_accelerate_state

    model = _model(setup, setting)
    optimizer = make_optimizer(setup, model.parameters())
    watch_step(optimizer, capture, parameter_grads(model.inner), parameter_values(model.inner))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, per_device_train_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=accum_steps, max_steps=1, max_grad_norm=0.0,
            lr_scheduler_type="constant", report_to="none", save_strategy="no",
            logging_strategy="no", disable_tqdm=True, remove_unused_columns=False,
            dataloader_num_workers=0, ddp_backend="gloo",
            # Every parameter is used: the search for unused ones only costs a warning.
            ddp_find_unused_parameters=False,
            average_tokens_across_devices=setting.options.get(
                "average_tokens_across_devices", True))
        trainer = Trainer(
            model=model, args=args, train_dataset=samples(setup.batch(0)),
            data_collator=_CountingCollator(capture), optimizers=(optimizer, None),
            compute_loss_func=_token_loss_func if setting.options.get("compute_loss_func")
            else None)
        # The Trainer prints its closing metrics; the study's rows are the measurement.
        trainer.remove_callback(PrinterCallback)
        try:
            trainer.train()
        finally:
            reset_accelerate_state()


FRAMEWORK = Framework(name="transformers", module="transformers", distribution="transformers",
                      settings=SETTINGS, train=train)
