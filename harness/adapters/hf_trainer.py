"""HF transformers: ``Trainer`` with ``TrainingArguments(gradient_accumulation_steps=k)``.

The Trainer decides how to normalize a micro-step's loss from the user's model:
when the model *accepts loss kwargs* (its ``forward`` takes ``**kwargs``, or it says
so with an ``accepts_loss_kwargs`` attribute) or a ``compute_loss_func`` is given, it
counts the window's real tokens (``num_items_in_batch``, over all ranks with
``average_tokens_across_devices``; the labels after the shift only where the model's
``loss_type`` maps to the causal-LM loss), hands that count to the loss, multiplies the
loss by N to undo DDP's average, and does not divide by k; otherwise it divides the
micro-batch's loss by k. It then clips the window's gradient to ``max_grad_norm`` (1.0
by default) once, calls its callbacks' ``on_pre_optimizer_step`` (where the setup's
``before_step`` runs) and steps.

The model goes in as is where it computes the setup's loss itself: fed a dict batch, it
returns a loss equal to ``Setup.loss`` on a micro-batch (measured, on a copy). Its own
loss and ``num_items_in_batch`` path are then what is measured, and the counts the
Trainer passed are recorded. Any other model (a loss with terms of its own, a model
that returns logits) goes in wrapped in a module whose ``forward`` returns
``{"loss": setup.loss(model, micro_batch)}`` and which does not accept loss kwargs, so
the Trainer divides by k, as it does for any model returning a per-micro-batch mean.

The Trainer trains with the setup's optimizer and scheduler (a constant one where the
setup has none, instead of the Trainer's linear decay), reads the data in order (the
windows must stay whole: no shuffling), and ``bf16=True`` for ``Setup.autocast``
bfloat16.
"""

from __future__ import annotations

import copy
import functools
import inspect
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from harness.adapters import registry
from harness.adapters.data import Samples, data_set
from harness.adapters.registry import Applied, Framework, FrameworkSetting, Job
from harness.adapters.step_capture import parameter_grads, parameter_values, watch_step
from harness.check import batches
from harness.check.setup import make_optimizer
from harness.tolerances import check_tolerance, close

SETTINGS = (
    FrameworkSetting(registry.DEFAULT, core=True),
    FrameworkSetting("max_grad_norm=0", {"max_grad_norm": 0.0}, core=True),
    FrameworkSetting("average_tokens_across_devices=False",
                     {"average_tokens_across_devices": False}),
)
#: The keyword the Trainer passes the window's count under.
COUNT = "num_items_in_batch"


def _own_loss(model: nn.Module, batch: Any, **counts: Any) -> torch.Tensor | None:
    """The loss a model computes itself from a dict batch (None where it returns none)."""
    out = model(**batch, **counts)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def goes_in_as_is(job: Job, model: nn.Module) -> bool:
    """Whether the model computes the setup's loss itself: fed a dict micro-batch, its own
    loss equals ``Setup.loss`` (on a copy, without gradients: the probe trains nothing)."""
    piece = batches.take(job.windows[0], 0, job.micro_batch_size)
    if not isinstance(piece, dict):
        return False
    probe = copy.deepcopy(model)
    with torch.no_grad():
        try:
            own = _own_loss(probe, piece)
        except TypeError:  # a forward that takes no such keywords: not an HF-style model
            return False
        return own is not None and close(float(own), float(job.setup.loss(probe, piece)),
                                         check_tolerance(job.dtype))


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """The Trainer's own test: an ``accepts_loss_kwargs`` attribute, else a ``forward``
    that takes ``**kwargs``."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD
               for p in inspect.signature(model.forward).parameters.values())


class SetupLoss(nn.Module):
    """The user's model and loss as a model that returns its loss (see the module's doc)."""

    #: The Trainer then divides the returned per-micro-batch loss by k.
    accepts_loss_kwargs = False

    def __init__(self, model: nn.Module, job: Job) -> None:
        super().__init__()
        self.model, self.job, self.micro_steps = model, job, 0

    def forward(self, **inputs):
        batch = inputs["batch"] if set(inputs) == {"batch"} else inputs
        index, self.micro_steps = self.micro_steps, self.micro_steps + 1
        return {"loss": registry.micro_loss(self.job, self.model, batch, index)}


class _Collate(Samples):
    """A non-dict batch goes to the model under one key, ``batch``."""

    def __call__(self, indices: list[int]) -> dict:
        batch = super().__call__(indices)
        return batch if isinstance(batch, dict) else {"batch": batch}


def _recording_counts(model: nn.Module, counts: list[int]) -> None:
    """Record the ``num_items_in_batch`` each forward of ``model`` is passed."""
    original = model.forward

    # wraps: the Trainer reads the forward's signature (``**kwargs``?) through it.
    @functools.wraps(original)
    def forward(*args, **kwargs):
        if kwargs.get(COUNT) is not None:
            counts.append(int(kwargs[COUNT]))
        return original(*args, **kwargs)

    model.forward = forward


def first_window(counts: list[int], accum_steps: int) -> tuple[int, ...] | None:
    """The counts the Trainer passed in step 0's window (its k micro-steps), which the
    rows of step 0 are judged with; None where it passed none."""
    return tuple(counts[:accum_steps]) or None


def count_ignored(job: Job, model: nn.Module, count: int) -> bool:
    """Whether the model's loss ignores the count it is passed: the same loss on a
    micro-batch with the count and with twice the count (on a copy, no gradients)."""
    piece = batches.take(job.windows[0], 0, job.micro_batch_size)
    probe = copy.deepcopy(model)
    with torch.no_grad():
        once = _own_loss(probe, piece, **{COUNT: count})
        twice = _own_loss(probe, piece, **{COUNT: 2 * count})
    return once is not None and twice is not None and bool(torch.equal(once, twice))


def _callback(job: Job):
    """The setup's before_step at the Trainer's ``on_pre_optimizer_step`` (after its clip)."""
    from transformers import TrainerCallback

    class BeforeStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None,
                                  **kwargs):
            last_micro_step = (state.global_step + 1) * job.accum_steps - 1
            registry.before_step(job, model, optimizer, last_micro_step)

    return BeforeStep()


def _arguments(job: Job, out: str) -> dict:
    return {"output_dir": out, "use_cpu": True, "ddp_backend": "gloo",
            "per_device_train_batch_size": job.micro_batch_size,
            "gradient_accumulation_steps": job.accum_steps, "max_steps": job.setup.steps,
            **({"bf16": True} if job.setup.autocast == torch.bfloat16 else {}),
            # Quiet, and nothing written: no checkpoint, log, bar or report.
            "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True,
            **job.setting.options}


def _scheduler(job: Job, optimizer: torch.optim.Optimizer):
    """The setup's scheduler; a constant one without it (the Trainer would decay)."""
    if job.setup.make_scheduler is not None:
        return job.setup.make_scheduler(optimizer)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def _trainer(job: Job, model: nn.Module, args, optimizer, scheduler):
    from transformers import PrinterCallback, Trainer

    class InOrder(Trainer):
        """Windows stay whole: the data set is read in order, as each rank's share."""

        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    trainer = InOrder(model=model, args=args, train_dataset=data_set(job),
                      data_collator=_Collate(job), optimizers=(optimizer, scheduler),
                      callbacks=[_callback(job)])
    # The Trainer prints its closing metrics; the rows are the measurement.
    trainer.remove_callback(PrinterCallback)
    return trainer


def train(job: Job) -> Applied:
    from transformers import TrainingArguments

    from harness.adapters.hf_accelerate import reset_accelerate_state

    inner = job.model()
    as_is = goes_in_as_is(job, inner)
    model = inner if as_is else SetupLoss(inner, job)
    counts: list[int] = []
    if as_is:
        _recording_counts(inner, counts)
    optimizer = make_optimizer(job.setup, inner.parameters())
    watch_step(optimizer, job.capture, parameter_grads(inner), parameter_values(inner))
    with tempfile.TemporaryDirectory() as out:
        arguments = _arguments(job, out)
        args = TrainingArguments(**arguments)
        try:
            _trainer(job, model, args, optimizer, _scheduler(job, optimizer)).train()
        finally:
            reset_accelerate_state()
    shown = {**arguments, "output_dir": "<a temporary folder>"}
    scheduler = ("the setup's scheduler" if job.setup.make_scheduler is not None
                 else "a constant scheduler")
    how = ("" if as_is else ", the model wrapped to return {'loss': setup.loss(...)}")
    passed = first_window(counts, job.accum_steps)
    return Applied(f"{registry.call('TrainingArguments', shown)}, Trainer(optimizers=(optimizer, "
                   f"{scheduler}), data in order){how}", clip=args.max_grad_norm or None,
                   counts_passed=passed,
                   count_ignored=(count_ignored(job, job.model(), passed[0]) if passed
                                  else None))


FRAMEWORK = Framework(
    name="transformers", module="transformers", distribution="transformers",
    settings=SETTINGS, train=train,
    find_unused="pass TrainingArguments(ddp_find_unused_parameters=True)",
    clip_setting="TrainingArguments.max_grad_norm (1.0 unless set)",
    clip_off="TrainingArguments(max_grad_norm=0)", unclipped="max_grad_norm=0",
    refuses={"autocast=torch.float16": "the Trainer's fp16 needs CUDA"},
    schedules="the Trainer steps its scheduler once per optimizer step")
