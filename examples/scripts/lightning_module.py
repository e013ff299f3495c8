"""A LightningModule trained by Lightning's Trainer with ``accumulate_grad_batches``.

Correct as it is: a mean loss, which Lightning divides by k, and DDP averages over N.
``--summed-loss`` returns the batch's summed loss instead (reduction="sum"): Lightning
still divides by k and DDP still averages, so a split's gradient is 1/(N*k) of the big
batch's summed one.

    grad-check run --global-batch 16 -- python examples/scripts/lightning_module.py \\
        --batch-size {batch} --grad-accum {accum} --devices {nproc}

``--devices`` must be N: Lightning checks it against the ranks torchrun (or
``grad-check run``) started.
"""

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self, summed_loss: bool) -> None:
        super().__init__()
        self.summed_loss = summed_loss
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, _index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(1), y,
                                      reduction="sum" if self.summed_loss else "mean")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step")
    parser.add_argument("--devices", type=int, default=1, help="processes (ranks)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--summed-loss", action="store_true",
                        help="the bug: a summed loss under accumulate_grad_batches")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    data = TensorDataset(x, 0.1 * torch.tanh(x @ torch.randn(8, generator=generator)))
    # One sampler at every split: left to itself, Lightning replaces the loader's sampler
    # by a shuffling DistributedSampler on N > 1 devices (even where the loader does not
    # shuffle) but keeps the loader's own on one, so N = 1 and N = 2 take other samples.
    # A DistributedSampler with one seed gives every split the same first N*k*b samples.
    sampler = DistributedSampler(data, num_replicas=args.devices,
                                 rank=int(os.environ.get("RANK", "0")), shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices,
                        strategy="ddp" if args.devices > 1 else "auto",
                        accumulate_grad_batches=args.grad_accum, max_steps=args.steps,
                        use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Regressor(args.summed_loss), loader)


if __name__ == "__main__":
    main()
