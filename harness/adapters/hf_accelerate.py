"""HF Accelerate: ``Accelerator(gradient_accumulation_steps=k)`` and ``accumulate(model)``.

The loop is Accelerate's documented one: the data loader, the model, the optimizer and
the scheduler go through ``prepare`` (the loader is sharded across the ranks, the model
wrapped in DDP), every micro-step runs inside ``accelerator.accumulate(model)``, calls
``accelerator.backward(loss)`` (which divides the loss by k), then, where
``accelerator.sync_gradients`` says the window ends, the setup's ``before_step`` (where
a loop clips), and ``optimizer.step()`` and ``scheduler.step()``, which step only at the
end of the window. Accelerate does not clip unless the loop does. ``Setup.autocast``
bfloat16 is Accelerate's ``mixed_precision="bf16"``.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from harness.adapters import registry
from harness.adapters.data import Samples, data_set
from harness.adapters.registry import Applied, Code, FrameworkSetting, Job
from harness.adapters.step_capture import parameter_grads, parameter_values, watch_step
from harness.check.setup import make_optimizer

SETTINGS = (
    FrameworkSetting(registry.DEFAULT, core=True),
    # The loader's batch is then N micro-batches, which Accelerate splits over the ranks.
    FrameworkSetting("split_batches", {"split_batches": True}),
)


def reset_accelerate_state() -> None:
    """Accelerate keeps its state in process-wide singletons: the next case builds afresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _arguments(job: Job) -> tuple[dict, dict]:
    """The Accelerator's keyword arguments, and the same as code for the rows."""
    # cpu=True: the harness's ranks reduce over gloo on the CPU.
    arguments = {"gradient_accumulation_steps": job.accum_steps, "cpu": True}
    if job.setup.autocast == torch.bfloat16:
        arguments["mixed_precision"] = "bf16"
    shown = dict(arguments)
    if job.option("split_batches"):
        from accelerate import DataLoaderConfiguration

        arguments["dataloader_config"] = DataLoaderConfiguration(split_batches=True)
        shown["dataloader_config"] = Code("DataLoaderConfiguration(split_batches=True)")
    return arguments, shown


def train(job: Job) -> Applied:
    from accelerate import Accelerator

    arguments, shown = _arguments(job)
    accelerator = Accelerator(**arguments)
    try:
        model = job.model()
        optimizer = make_optimizer(job.setup, model.parameters())
        watch_step(optimizer, job.capture, parameter_grads(model), parameter_values(model))
        scheduler = (job.setup.make_scheduler(optimizer)
                     if job.setup.make_scheduler is not None else None)
        per_loader = job.micro_batch_size * (job.world_size if job.option("split_batches")
                                             else 1)
        loader = DataLoader(data_set(job), batch_size=per_loader, collate_fn=Samples(job))
        wrapped, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                                    scheduler)
        for index, batch in enumerate(loader):
            with accelerator.accumulate(wrapped):
                accelerator.backward(registry.micro_loss(job, wrapped, batch, index))
                if accelerator.sync_gradients:
                    registry.before_step(job, wrapped, optimizer, index)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
    finally:
        reset_accelerate_state()
    return Applied(registry.call("Accelerator", shown)
                   + (", the setup's scheduler prepared with it" if scheduler else ""))


FRAMEWORK = registry.Framework(
    name="accelerate", module="accelerate", distribution="accelerate", settings=SETTINGS,
    train=train,
    find_unused=("pass kwargs_handlers=[DistributedDataParallelKwargs("
                 "find_unused_parameters=True)] to the Accelerator"),
    refuses={"autocast=torch.float16": "Accelerate's fp16 mixed precision needs CUDA (on the "
                                       "CPU it trains in float32 without a word)"},
    schedules=("Accelerate steps a prepared scheduler once per process, N times per "
               "optimizer step (AcceleratedScheduler, unless split_batches): count the "
               "schedule in those steps, or do not prepare the scheduler"))
