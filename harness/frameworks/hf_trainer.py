"""HF transformers: ``Trainer`` with ``TrainingArguments(gradient_accumulation_steps=k)``.

The Trainer decides how to normalize a micro-step's loss from the user's model:
when the model *accepts loss kwargs* (its ``forward`` takes ``**kwargs``, or it says
so with an ``accepts_loss_kwargs`` attribute) or a ``compute_loss_func`` is given, it
counts the window's real tokens (``num_items_in_batch``, over all ranks with
``average_tokens_across_devices``), hands that count to the loss, multiplies the loss
by N to undo DDP's average, and does not divide by k; otherwise it divides the
micro-batch's loss by k. It then clips the window's gradient to ``max_grad_norm``
(1.0 by default) once, before the step.

A model written the HF way (a ``PreTrainedModel``, or any module whose ``forward``
takes ``labels``) fed dict batches goes in as is: its own loss and its own
``num_items_in_batch`` path are what is measured. Any other model goes in wrapped in a
module whose ``forward`` returns ``{"loss": setup.loss(model, micro_batch)}`` and which
does not accept loss kwargs, so the Trainer divides by k, as it does for any model
returning a per-micro-batch mean. (A ``compute_loss_func`` sees only the outputs and
the labels, not the batch the Setup's loss is a function of.)

The Trainer trains with the setup's optimizer (``optimizers=(optimizer, None)``) and
its default linear schedule, whose factor at the first step is 1.
"""

from __future__ import annotations

import inspect
import tempfile
from typing import Any

import torch.distributed as dist
from torch import nn

from harness.check.reference import make_optimizer
from harness.frameworks.capture import parameter_grads, parameter_values, watch_step
from harness.frameworks.data import Samples, items, micro_batch_size, used_samples
from harness.frameworks.registry import (
    DEFAULT,
    Applied,
    Framework,
    Job,
    Setting,
    call,
    micro_loss,
)

SETTINGS = (
    Setting(DEFAULT, core=True),
    Setting("max_grad_norm=0", {"max_grad_norm": 0.0}, core=True),
    Setting("average_tokens_across_devices=False", {"average_tokens_across_devices": False}),
)


def goes_in_as_is(model: nn.Module, window: Any) -> bool:
    """A model written the HF way, fed dict batches: the Trainer calls it with the batch
    and takes the loss it returns."""
    if not isinstance(window, dict):
        return False
    try:
        from transformers import PreTrainedModel

        if isinstance(model, PreTrainedModel):
            return True
    except ImportError:
        pass
    return "labels" in inspect.signature(model.forward).parameters


class SetupLoss(nn.Module):
    """The user's model and loss as a model that returns its loss (see the module's doc)."""

    #: The Trainer then divides the returned per-micro-batch loss by k.
    accepts_loss_kwargs = False

    def __init__(self, model: nn.Module, job: Job, window: Any) -> None:
        super().__init__()
        self.model = model
        self.job, self.window, self.micro_steps = job, window, 0

    def forward(self, **inputs):
        batch = inputs["batch"] if set(inputs) == {"batch"} else inputs
        index, self.micro_steps = self.micro_steps % self.job.accum_steps, self.micro_steps + 1
        return {"loss": micro_loss(self.job.setup, self.model, batch, index,
                                   self.job.accum_steps, dist.get_world_size(), self.window)}


class _Collate:
    """Takes the micro-batch's samples (a non-dict batch under one key, ``batch``) and
    counts what this rank trained on."""

    def __init__(self, window: Any, job: Job) -> None:
        self.samples, self.job = Samples(window), job
        self.wrap = not isinstance(window, dict)

    def __call__(self, indices: list[int]) -> dict:
        batch = self.samples(indices)
        self.job.capture.tokens += items(batch)
        return {"batch": batch} if self.wrap else batch


def _arguments(job: Job, window: Any, out: str) -> dict:
    size = micro_batch_size(window, dist.get_world_size(), job.accum_steps)
    return {"output_dir": out, "use_cpu": True, "ddp_backend": dist.get_backend(),
            "per_device_train_batch_size": size, "gradient_accumulation_steps": job.accum_steps,
            "max_steps": 1,
            # Quiet, and nothing written: no checkpoint, log, bar or report.
            "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True,
            **job.setting.options}


def train(job: Job) -> Applied:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from harness.frameworks.hf_accelerate import reset_accelerate_state

    window = job.window()
    inner = job.model()
    model = inner if goes_in_as_is(inner, window) else SetupLoss(inner, job, window)
    optimizer = make_optimizer(job.setup, inner.parameters())
    watch_step(optimizer, job.capture, parameter_grads(inner), parameter_values(inner))
    with tempfile.TemporaryDirectory() as out:
        arguments = _arguments(job, window, out)
        args = TrainingArguments(**arguments)
        dataset = range(used_samples(window, dist.get_world_size(), job.accum_steps))
        trainer = Trainer(model=model, args=args, train_dataset=list(dataset),
                          data_collator=_Collate(window, job), optimizers=(optimizer, None))
        # The Trainer prints its closing metrics; the rows are the measurement.
        trainer.remove_callback(PrinterCallback)
        try:
            trainer.train()
        finally:
            reset_accelerate_state()
    shown = {**arguments, "output_dir": "<a temporary folder>"}
    how = "" if model is inner else ", the model wrapped to return {'loss': setup.loss(...)}"
    return Applied(f"{call('TrainingArguments', shown)}, Trainer(optimizers=(optimizer, None))"
                   f"{how}", clip=args.max_grad_norm or None)


FRAMEWORK = Framework(name="transformers", module="transformers", distribution="transformers",
                      settings=SETTINGS, train=train,
                      clip_setting="TrainingArguments.max_grad_norm (1.0 unless set)",
                      clip_off="TrainingArguments(max_grad_norm=0)",
                      unclipped="max_grad_norm=0")
