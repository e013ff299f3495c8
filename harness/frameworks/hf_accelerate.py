"""HF Accelerate: ``Accelerator(gradient_accumulation_steps=k)`` and ``accumulate(model)``.

The loop is Accelerate's documented one: the data loader and the model go through
``prepare`` (the loader is sharded across the ranks, the model wrapped in DDP),
every micro-step runs inside ``accelerator.accumulate(model)``, calls
``accelerator.backward(loss)`` (which divides the loss by k) and
``optimizer.step()``, which steps only at the end of the window. Accelerate does not
clip unless the loop calls ``clip_grad_norm_``.
"""

from __future__ import annotations

from torch.utils.data import DataLoader

from harness.check.reference import make_optimizer
from harness.frameworks import registry
from harness.frameworks.capture import parameter_grads, parameter_values, watch_step
from harness.frameworks.data import Samples, items, micro_batch_size, used_samples
from harness.frameworks.registry import Applied, Code, Job, Setting

SETTINGS = (
    Setting(registry.DEFAULT, core=True),
    # The loader's batch is then N micro-batches, which Accelerate splits over the ranks.
    Setting("split_batches", {"split_batches": True}),
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
        model, window = job.model(), job.window()
        optimizer = make_optimizer(job.setup, model.parameters())
        watch_step(optimizer, job.capture, parameter_grads(model), parameter_values(model))
        size = micro_batch_size(window, accelerator.num_processes, job.accum_steps)
        per_loader = size * accelerator.num_processes if job.option("split_batches") else size
        loader = DataLoader(range(used_samples(window, accelerator.num_processes,
                                               job.accum_steps)),
                            batch_size=per_loader, collate_fn=Samples(window))
        wrapped, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for index, batch in enumerate(loader):
            job.capture.tokens += items(batch)
            with accelerator.accumulate(wrapped):
                accelerator.backward(registry.micro_loss(job.setup, wrapped, batch, index,
                                                job.accum_steps, accelerator.num_processes,
                                                window))
                optimizer.step()
                optimizer.zero_grad()
    finally:
        reset_accelerate_state()
    return Applied(registry.call("Accelerator", shown))


FRAMEWORK = registry.Framework(name="accelerate", module="accelerate",
                              distribution="accelerate",
                              settings=SETTINGS, train=train)
