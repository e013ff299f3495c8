"""DeepSpeed: ``deepspeed.initialize`` with ``gradient_accumulation_steps=k``, ZeRO 0, 1, 2.

On CPU (``DS_ACCELERATOR=cpu``) over the launch's gloo group, which
``deepspeed.init_distributed(dist_backend="gloo")`` adopts as it is. The loop is
DeepSpeed's: ``loss = ...; engine.backward(loss); engine.step()`` every micro-step;
the engine divides the loss by k and steps the optimizer at the window's end,
after clipping the window's gradient to ``gradient_clipping``, 1.0 unless the
configuration says otherwise (``GRADIENT_CLIPPING_DEFAULT``); the ZeRO stage is 0
unless it says otherwise.

ZeRO 1 and 2 keep the optimizer's view of the weights as flat float32 partitions,
one per rank, so DeepSpeed trains in float32 here (its ZeRO master weights are
float32 whatever the model's dtype). The gradient the optimizer applies is then
this rank's partition: the ranks' partitions, gathered in rank order, are the flat
gradient in the model's parameter order (padding at the end), and the same for the
weights after the step.
"""

from __future__ import annotations

import importlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn

from harness.adapters import registry
from harness.adapters.data import rank_micro_batches
from harness.adapters.registry import Applied, Framework, FrameworkSetting, Job
from harness.adapters.step_capture import (
    StepCapture,
    parameter_grads,
    parameter_values,
    watch_step,
)
from harness.check.setup import make_optimizer

#: The settings users change, each named for what it changes (``zero1``: the ZeRO stage).
#: ZeRO 1 and 2 refuse an optimizer DeepSpeed has not tested (the setup's SGD) unless
#: told to allow it: part of what those settings pass.
UNTESTED = {"zero_allow_untested_optimizer": True}
SETTINGS = (
    FrameworkSetting(registry.DEFAULT, core=True),
    FrameworkSetting("gradient_clipping=0", {"gradient_clipping": 0.0}, core=True),
    FrameworkSetting("zero1", {"zero_optimization": {"stage": 1}, **UNTESTED}, core=True),
    FrameworkSetting("zero2", {"zero_optimization": {"stage": 2}, **UNTESTED}, core=True),
    FrameworkSetting("prescale_gradients", {"prescale_gradients": True}),
    FrameworkSetting("gradient_predivide_factor=2", {"gradient_predivide_factor": 2.0}),
    FrameworkSetting("zero2+gradient_predivide_factor=2",
            {"zero_optimization": {"stage": 2}, **UNTESTED, "gradient_predivide_factor": 2.0}),
)
#: Never reached: DeepSpeed prints its progress every this many steps (its banner only).
QUIET_STEPS = 10**9


def _config(job: Job, micro_batch: int) -> dict:
    """The whole configuration passed: the batch sizes, k, quiet progress, the setting."""
    return {"train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": job.accum_steps, "steps_per_print": QUIET_STEPS,
            **job.setting.options}


def _stage(config: dict) -> int:
    return config.get("zero_optimization", {}).get("stage", 0)


def _gathered(optimizer: torch.optim.Optimizer, numel: int, read) -> list[torch.Tensor]:
    """``read(p)`` of this rank's flat partitions, every rank's in rank order, the padding
    at the end cut off: the whole flat tensor in the model's parameter order."""
    local = torch.cat([read(p).reshape(-1) for group in optimizer.param_groups
                       for p in group["params"]])
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return [torch.cat(parts)[:numel]]


def _watch(engine, model: nn.Module, capture: StepCapture, stage: int) -> None:
    """Wrap the step of the torch optimizer the engine ends in. Under ZeRO it holds the
    flat partitions, and the module's weights are refreshed from them only after its
    step: both the gradient and the weights are read from the partitions then."""
    inner = engine.optimizer
    while not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optimizer
    if stage == 0:
        watch_step(inner, capture, parameter_grads(model), parameter_values(model))
        return
    numel = sum(p.numel() for p in model.parameters())
    watch_step(inner, capture, lambda: _gathered(inner, numel, lambda p: p.grad),
               lambda: _gathered(inner, numel, lambda p: p.detach()))


def train(job: Job) -> Applied:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # DeepSpeed's CPU backend compiles a shared-memory all-reduce on first use (a C++
    # build of tens of seconds, needing a compiler) that only its inference path calls:
    # training reduces through torch.distributed either way. The module is taken from
    # importlib: the attribute ``deepspeed.comm.torch`` is torch itself (deepspeed.comm
    # star-imports it), where patching the build would change nothing.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    model = job.model()
    config = _config(job, job.micro_batch_size)
    optimizer = make_optimizer(job.setup, model.parameters())
    scheduler = (job.setup.make_scheduler(optimizer)
                 if job.setup.make_scheduler is not None else None)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      lr_scheduler=scheduler)
    _watch(engine, model, job.capture, _stage(config))
    for index, batch in enumerate(rank_micro_batches(job, dist.get_rank())):
        engine.backward(registry.micro_loss(job, engine, batch, index))
        engine.step()
    clip = engine.gradient_clipping()
    engine.destroy()
    return Applied(json.dumps(config) + (", the setup's scheduler passed to "
                                         "deepspeed.initialize" if scheduler else ""),
                   clip=clip or None)


FRAMEWORK = Framework(
    name="deepspeed", module="deepspeed", distribution="deepspeed", settings=SETTINGS,
    train=train, dtype=torch.float32,
    reduces_in_buckets=False,
    clip_setting='"gradient_clipping" (1.0 unless set)',
    clip_off='"gradient_clipping": 0.0', unclipped="gradient_clipping=0",
    refuses={"before_step": "engine.step() clips and steps in one call, with no hook between "
                            "the window's last backward and the optimizer's step",
             "autocast": "DeepSpeed's bf16 and fp16 cast the model's weights (no autocast)"},
    schedules="DeepSpeed steps the scheduler passed to deepspeed.initialize once per "
              "optimizer step")
