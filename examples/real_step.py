"""The step people really write: clipping, bf16 autocast, AdamW with a warm-up schedule.

- ``make_micro_clip_setup``: ``clip_grad_norm_`` inside the micro-step, as a loop that
  clips after every backward does: each clip sees only the gradient accumulated so far,
  not the window's. Differs from the big batch wherever a partial norm exceeds the limit.
- ``make_clip_setup``: the same clip once per window, in ``before_step``: after DDP's
  all-reduce (under FSDP on the sharded gradients, whose DTensor norm is the whole
  model's), it sees the big batch's gradient and its total norm. Matches.
- ``make_bf16_setup``: every forward under ``torch.autocast(dtype=torch.bfloat16)``;
  the model runs in float32 and the rows are judged at bfloat16's precision.
- ``make_warmup_setup``: AdamW with a linear warm-up of the learning rate over four
  steps, the scheduler stepped after every optimizer step: one row per step and point.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.mlp import batch, make_model, mean_loss
from harness.check import MicroStep, Setup

#: Small enough that the clip is active on these gradients (their norm is ~1).
MAX_NORM = 0.1
WARMUP_STEPS = 4


def clip_each_micro_step(model: nn.Module, data, where: MicroStep) -> torch.Tensor:
    """Wrong: clips what the earlier micro-steps accumulated, micro-step by micro-step."""
    nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return mean_loss(model, data) / where.accum_steps


def clip_window(model: nn.Module, optimizer: torch.optim.Optimizer, where: MicroStep) -> None:
    """Right: once per window, on the reduced gradient."""
    nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def linear_warmup(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / WARMUP_STEPS))


def make_micro_clip_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=mean_loss,
                 micro_step=clip_each_micro_step, name="clip-per-micro-step")


def make_clip_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=mean_loss, before_step=clip_window,
                 name="clip-in-before-step")


def make_bf16_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=mean_loss, autocast=torch.bfloat16,
                 name="bf16-autocast")


def make_warmup_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=mean_loss, make_optimizer=adamw,
                 make_scheduler=linear_warmup, steps=WARMUP_STEPS, name="adamw-warmup")
