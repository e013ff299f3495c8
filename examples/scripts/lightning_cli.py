"""A LightningCLI program as Lightning's documentation writes one: a LightningModule, a
LightningDataModule whose training DataLoader shuffles (``shuffle=True``), and
``LightningCLI`` giving every Trainer argument as a flag, ``accumulate_grad_batches``
among them.

The loss is a mean over the micro-batch's samples, which Lightning divides by k and DDP
averages over N: accumulation alone is exact. At N > 1 Lightning replaces the
DataLoader's sampler by a DistributedSampler of its own (``use_distributed_sampler``,
on by default), which shuffles with its own seed; at N = 1 it keeps the loader's
RandomSampler: N = 1 and N = 2 train on other samples. ``--data.shuffle false`` gives
both the samples in order.

    grad-check run --global-batch 16 -- python examples/scripts/lightning_cli.py fit \\
        --trainer.devices {nproc} --trainer.accumulate_grad_batches {accum} \\
        --data.batch_size {batch}
"""

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4))

    def training_step(self, batch, _index):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class Points(L.LightningDataModule):
    """512 points in 8 dimensions, four classes, drawn from a fixed seed."""

    def __init__(self, batch_size: int = 16, shuffle: bool = True) -> None:
        super().__init__()
        self.batch_size, self.shuffle = batch_size, shuffle

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(512, 8, generator=generator)
        self.data = TensorDataset(x, (x @ torch.randn(8, 4, generator=generator)).argmax(1))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=self.shuffle)


def main() -> None:
    # overwrite: each run writes its config.yaml where the last one did.
    LightningCLI(Classifier, Points, seed_everything_default=0,
                 save_config_kwargs={"overwrite": True},
                 trainer_defaults={"accelerator": "cpu", "max_steps": 4, "logger": False,
                                   "enable_checkpointing": False,
                                   "enable_progress_bar": False,
                                   "enable_model_summary": False})


if __name__ == "__main__":
    main()
