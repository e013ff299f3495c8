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
    Setting("default", 'Trainer(strategy="ddp", accelerator="cpu", devices=2, '
            "accumulate_grad_batches=k)", core=True),
    Setting("token-normalized", "training_step returns token_sum * k * N / tokens of the "
            "window on all ranks", {"normalize_tokens": True}),
)
#: Lightning's loggers announce devices, strategies and hints on every fit.
QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")


def _existing_ranks():
    """A cluster environment that is the already-initialized process group."""
    from lightning.fabric.plugins.environments import ClusterEnvironment

    class ExistingProcessGroup(ClusterEnvironment):
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

    return ExistingProcessGroup()


def _module(setup: Setup, setting: Setting, accum_steps: int, capture: StepCapture,
            window_tokens: torch.Tensor):
    import lightning.pytorch as pl

    class SetupModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = setup.make_model()

        def training_step(self, batch, batch_idx):
            capture.tokens += int(real_tokens(batch["labels"]))
            if setting.options.get("normalize_tokens"):
                # Lightning divides by k and DDP averages over N: both undone here.
                summed = token_sum(self.model(batch["input_ids"]), batch["labels"])
                return summed * accum_steps * dist.get_world_size() / window_tokens
            return setup.loss(self.model, batch)

        def configure_optimizers(self):
            optimizer = make_optimizer(setup, self.model.parameters())
            watch_step(optimizer, capture, parameter_grads(self.model),
                       parameter_values(self.model))
            return optimizer

    return SetupModule()


def train(setup: Setup, setting: Setting, accum_steps: int, capture: StepCapture) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    data = samples(setup.batch(0))
    local = [s for i, s in enumerate(data) if i % dist.get_world_size() == dist.get_rank()]
    window_tokens = sum(real_tokens(s["labels"]) for s in local)
    window_tokens = torch.as_tensor(window_tokens)
    dist.all_reduce(window_tokens)
    trainer = pl.Trainer(
        strategy=DDPStrategy(cluster_environment=_existing_ranks(),
                             process_group_backend=dist.get_backend()),
        accelerator="cpu", devices=dist.get_world_size(), num_nodes=1,
        accumulate_grad_batches=accum_steps, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0)
    # Lightning's own DistributedSampler shards the loader: rank r gets samples r, r+N, ...
    trainer.fit(_module(setup, setting, accum_steps, capture, window_tokens),
                train_dataloaders=DataLoader(data, batch_size=MICRO_BATCH))


FRAMEWORK = Framework(name="lightning", module="lightning", distribution="lightning",
                      settings=SETTINGS, train=train)
