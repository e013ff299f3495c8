"""PyTorch Lightning: ``Trainer(strategy="ddp", accumulate_grad_batches=k)``.

Lightning normally starts its ranks itself. Here they already exist (the harness's
launch, with its process group initialized), so the DDP strategy gets a cluster
environment that reports those ranks and says the processes were created
externally: Lightning then neither spawns nor initializes a process group (it finds
one and uses it), exactly as under ``torchrun``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from harness.adapters import registry
from harness.adapters.data import Samples, data_set
from harness.adapters.registry import Applied, Code, Framework, FrameworkSetting, Job
from harness.adapters.step_capture import parameter_grads, parameter_values, watch_step
from harness.check.setup import make_optimizer

#: Lightning clips only with ``gradient_clip_val``, which is None by default.
SETTINGS = (FrameworkSetting(registry.DEFAULT, core=True),)
#: Lightning's loggers announce devices, strategies and hints on every fit.
QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")


class _LaunchedRanks:
    """The answers a Lightning ``ClusterEnvironment`` gives, from the launch's process
    group and environment. A plain class, so that this module imports without Lightning:
    ``_existing_ranks`` joins it to Lightning's base class."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", 0))

    @staticmethod
    def detect() -> bool:
        return dist.is_initialized()

    def world_size(self) -> int:
        return dist.get_world_size()

    def set_world_size(self, size: int) -> None:
        if size != dist.get_world_size():
            raise ValueError(f"Lightning asked for {size} ranks; the launch has "
                             f"{dist.get_world_size()}")

    def global_rank(self) -> int:
        return dist.get_rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # the launch decided it

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", dist.get_rank()))

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", 0))


def _existing_ranks():
    """A cluster environment that is the already-initialized process group."""
    from lightning.fabric.plugins.environments import ClusterEnvironment

    class ExistingProcessGroup(_LaunchedRanks, ClusterEnvironment):
        pass

    return ExistingProcessGroup()


def _module(job: Job):
    import lightning.pytorch as pl

    class SetupModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = job.model()
            self.micro_steps = 0

        def training_step(self, batch, batch_idx):
            self.micro_steps = batch_idx
            return registry.micro_loss(job, self.model, batch, batch_idx)

        def on_before_optimizer_step(self, optimizer):
            # After the window's last backward, before Lightning's clip (none by default)
            # and the step: where the setup's before_step belongs.
            registry.before_step(job, self.trainer.strategy.model, optimizer, self.micro_steps)

        def configure_optimizers(self):
            optimizer = make_optimizer(job.setup, self.model.parameters())
            watch_step(optimizer, job.capture, parameter_grads(self.model),
                       parameter_values(self.model))
            if job.setup.make_scheduler is None:
                return optimizer
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": job.setup.make_scheduler(optimizer),
                                     "interval": "step"}}

    return SetupModule()


def train(job: Job) -> Applied:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # The harness's ranks exist already: the strategy adopts them (see the module's doc).
    strategy = DDPStrategy(cluster_environment=_existing_ranks(),
                           process_group_backend=dist.get_backend())
    arguments = {"strategy": strategy, "accelerator": "cpu", "devices": job.world_size,
                 "num_nodes": 1, "accumulate_grad_batches": job.accum_steps,
                 # Lightning's own sampler would shuffle the training data across windows.
                 "use_distributed_sampler": False,
                 "max_steps": job.setup.steps,
                 **({"precision": "bf16-mixed"} if job.setup.autocast == torch.bfloat16
                    else {}),
                 # Quiet, and nothing written: no logger, checkpoint, bar or summary.
                 "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                 "enable_model_summary": False}
    trainer = pl.Trainer(**arguments)
    # A DistributedSampler without shuffling: rank r gets samples r, r+N, ... of each window.
    data = data_set(job)
    trainer.fit(_module(job), train_dataloaders=DataLoader(
        data, batch_size=job.micro_batch_size, collate_fn=Samples(job),
        sampler=DistributedSampler(data, shuffle=False)))
    shown = {**arguments, "strategy": Code(f'DDPStrategy(cluster_environment=<the launch\'s '
                                           f'ranks>, process_group_backend='
                                           f'"{dist.get_backend()}")')}
    return Applied(registry.call("Trainer", shown) + ", DataLoader(sampler=DistributedSampler("
                   "shuffle=False))")


FRAMEWORK = Framework(
    name="lightning", module="lightning", distribution="lightning", settings=SETTINGS,
    train=train,
    find_unused="pass DDPStrategy(find_unused_parameters=True) to the Trainer",
    refuses={"autocast=torch.float16": "Lightning's 16-mixed precision needs CUDA"},
    schedules="Lightning steps the scheduler of configure_optimizers once per optimizer step "
              "(interval 'step')")
