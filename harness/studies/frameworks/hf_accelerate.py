"""HF Accelerate: ``Accelerator(gradient_accumulation_steps=k)`` and ``accumulate(model)``.

The loop is Accelerate's documented one: the data loader and the model go through
``prepare`` (the loader is sharded across the ranks, the model wrapped in DDP),
every micro-step runs inside ``accelerator.accumulate(model)``, calls
``accelerator.backward(loss)`` (which divides the loss by k) and
``optimizer.step()``, which steps only at the end of the window.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from harness.check.reference import make_optimizer
from harness.check.setup import Setup
from harness.studies.frameworks.capture import (
    StepCapture,
    parameter_grads,
    parameter_values,
    watch_step,
)
from harness.studies.frameworks.registry import Framework, Setting
from harness.studies.frameworks.setups import MICRO_BATCH, real_tokens, samples, token_sum

SETTINGS = (
    Setting("default", "Accelerator(gradient_accumulation_steps=k)", core=True),
    Setting("split_batches", "Accelerator(gradient_accumulation_steps=k, dataloader_config="
            "DataLoaderConfiguration(split_batches=True)), the loader's batch N times larger",
            {"split_batches": True}),
    Setting("loss/k", "accelerator.backward(loss / k): the user divides by k as well",
            {"divide_by_k": True}),
    Setting("token-normalized", "loss = token_sum * k * N / tokens of the window on all ranks "
            "(Accelerate's recipe for token losses)", {"normalize_tokens": True}),
)


def reset_accelerate_state() -> None:
    """Accelerate keeps its state in process-wide singletons: the next case builds afresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def train(setup: Setup, setting: Setting, accum_steps: int, capture: StepCapture) -> None:
    from accelerate import Accelerator, DataLoaderConfiguration

    split = setting.options.get("split_batches", False)
    accelerator = Accelerator(gradient_accumulation_steps=accum_steps, cpu=True,
                              dataloader_config=DataLoaderConfiguration(split_batches=split))
    try:
        model = setup.make_model()
        optimizer = make_optimizer(setup, model.parameters())
        watch_step(optimizer, capture, parameter_grads(model), parameter_values(model))
        per_loader = MICRO_BATCH * accelerator.num_processes if split else MICRO_BATCH
        loader = DataLoader(samples(setup.batch(0)), batch_size=per_loader)
        wrapped, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        window_tokens = _window_tokens(accelerator, loader)
        for batch in loader:
            capture.tokens += int(real_tokens(batch["labels"]))
            with accelerator.accumulate(wrapped):
                accelerator.backward(_micro_loss(setup, setting, wrapped, batch, accum_steps,
                                                 accelerator.num_processes, window_tokens))
                optimizer.step()
                optimizer.zero_grad()
    finally:
        reset_accelerate_state()


def _window_tokens(accelerator, loader) -> torch.Tensor:
    """Real tokens of the whole window (every micro-batch of every rank): the normalizer of
    the big batch's token mean."""
    local = sum(real_tokens(batch["labels"]) for batch in loader)
    return accelerator.gather(torch.as_tensor(local).reshape(1)).sum()


def _micro_loss(setup: Setup, setting: Setting, model, batch, accum_steps: int,
                world_size: int, window_tokens: torch.Tensor) -> torch.Tensor:
    if setting.options.get("normalize_tokens"):
        # accelerator.backward divides by k and DDP averages over N: both undone here.
        summed = token_sum(model(batch["input_ids"]), batch["labels"])
        return summed * accum_steps * world_size / window_tokens
    loss = setup.loss(model, batch)
    return loss / accum_steps if setting.options.get("divide_by_k") else loss


FRAMEWORK = Framework(name="accelerate", module="accelerate", distribution="accelerate",
                      settings=SETTINGS, train=train)
