"""DeepSpeed: ``deepspeed.initialize`` with ``gradient_accumulation_steps=k``, ZeRO 0, 1, 2.

On CPU (``DS_ACCELERATOR=cpu``) over the launch's gloo group, which
``deepspeed.init_distributed(dist_backend="gloo")`` adopts as it is. The loop is
DeepSpeed's: ``loss = ...; engine.backward(loss); engine.step()`` every micro-step;
the engine divides the loss by k and steps the optimizer at the window's end.

ZeRO 1 and 2 keep the optimizer's view of the weights as flat float32 partitions,
one per rank, so DeepSpeed trains in float32 here (its ZeRO master weights are
float32 whatever the model's dtype). The gradient the optimizer applies is then
this rank's partition: the ranks' partitions, gathered in rank order, are the flat
gradient in the model's parameter order (padding at the end), and the same for the
weights after the step.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
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
from harness.studies.frameworks.setups import MICRO_BATCH, real_tokens, samples

SETTINGS = (
    Setting("zero0", '"zero_optimization": {"stage": 0}', {"stage": 0}, core=True),
    Setting("zero0 gradient_clipping=1.0", '"zero_optimization": {"stage": 0}, '
            '"gradient_clipping": 1.0 (DeepSpeed\'s default)',
            {"stage": 0, "gradient_clipping": 1.0}, core=True),
    Setting("zero1", '"zero_optimization": {"stage": 1}', {"stage": 1}, core=True),
    Setting("zero2", '"zero_optimization": {"stage": 2}', {"stage": 2}, core=True),
    Setting("zero0 prescale_gradients", '"zero_optimization": {"stage": 0}, '
            '"prescale_gradients": true', {"stage": 0, "prescale_gradients": True}),
    Setting("zero0 gradient_predivide_factor=2", '"zero_optimization": {"stage": 0}, '
            '"gradient_predivide_factor": 2.0', {"stage": 0, "gradient_predivide_factor": 2.0}),
    Setting("zero2 gradient_predivide_factor=2", '"zero_optimization": {"stage": 2}, '
            '"gradient_predivide_factor": 2.0', {"stage": 2, "gradient_predivide_factor": 2.0}),
)
#: Never reached: DeepSpeed prints its progress every this many steps.
QUIET_STEPS = 10**9


def _config(setting: Setting, accum_steps: int) -> dict:
    options = dict(setting.options)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": accum_steps,
        "zero_optimization": {"stage": options.pop("stage")},
        # The setup's optimizer is plain SGD, which DeepSpeed has not tested under ZeRO.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": QUIET_STEPS,
        # DeepSpeed clips at 1.0 unless told otherwise; off, so that what is measured is the
        # accumulation alone (one setting keeps the default, to show what it does).
        "gradient_clipping": 0.0,
    }
    return {**config, **options}


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


def train(setup: Setup, setting: Setting, accum_steps: int, capture: StepCapture) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch

    # DeepSpeed's CPU backend compiles a shared-memory all-reduce on first use (a C++
    # build of minutes, needing a compiler) that only its inference path calls: training
    # reduces through torch.distributed either way.
    deepspeed.comm.torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    model = setup.make_model()
    optimizer = make_optimizer(setup, model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=_config(setting, accum_steps))
    _watch(engine, model, capture, setting.options["stage"])
    data = samples(setup.batch(0))
    local = [s for i, s in enumerate(data) if i % dist.get_world_size() == dist.get_rank()]
    for start in range(0, len(local), MICRO_BATCH):
        piece = local[start:start + MICRO_BATCH]
        batch = {name: torch.stack([s[name] for s in piece]) for name in piece[0]}
        capture.tokens += int(real_tokens(batch["labels"]))
        engine.backward(setup.loss(engine, batch))
        engine.step()
    engine.destroy()


FRAMEWORK = Framework(name="deepspeed", module="deepspeed", distribution="deepspeed",
                      settings=SETTINGS, train=train, dtype=torch.float32)
