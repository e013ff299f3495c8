"""A plain PyTorch training loop: DDP, a DistributedSampler, gradient accumulation, clipping.

Correct as it is; ``--forget-divide`` leaves out the loss's ``/ k``, the classic bug of
accumulation: the window's gradient is then k times the big batch's. Check it with

    grad-check run --global-batch 16 -- \\
        python examples/scripts/ddp_loop.py --batch-size {batch} --grad-accum {accum}

Under torchrun (or ``grad-check run`` at N > 1) it trains with DDP on gloo; alone, in one
process.
"""

import argparse
import contextlib
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--forget-divide", action="store_true",
                        help="the bug: backpropagate the micro-batch's loss without / k")
    return parser.parse_args()


def regression_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    y = 0.1 * torch.tanh(x @ torch.randn(8, generator=generator))
    return TensorDataset(x, y)


def main() -> None:
    args = arguments()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)  # the same initial weights on every rank and at every split
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    if distributed:
        model = DistributedDataParallel(model)
    data = regression_data()
    # Shuffled once, with one seed: the first N*k*b samples of the permutation make up the
    # first global batch whatever N, k and b are.
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = 0
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for micro, (x, y) in enumerate(loader):
            last = (micro + 1) % args.grad_accum == 0
            # DDP all-reduces on the window's last backward only.
            sync = contextlib.nullcontext() if last or not distributed else model.no_sync()
            with sync:
                loss = nn.functional.mse_loss(model(x).squeeze(1), y)
                (loss if args.forget_divide else loss / args.grad_accum).backward()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if rank == 0:
                print(f"step {step}: loss {loss.item():.5f}", flush=True)
            if step == args.steps:
                if distributed:
                    dist.destroy_process_group()
                return


if __name__ == "__main__":
    main()
