"""A small training script for ``grad-check run``'s tests, one flaw per ``--case``.

- ``sound``: a DDP loop (DDP from N > 1 on) over a DistributedSampler shuffled with one
  seed, the loss divided by k: every split takes the big batch's step;
- ``clock-seeded``: the model's initial weights drawn from a clock seed;
- ``per-rank-shuffle``: each rank shuffles the whole dataset with its own seed;
- ``never-steps``: forward and backward, but no optimizer step;
- ``fails-on-rank-1``: rank 1 raises in its first micro-step;
- ``without-ddp``: N > 1 ranks that never all-reduce;
- ``hangs-on-rank-1``: rank 1 waits forever before its first micro-step;
- ``fsdp2``: the sound loop with FSDP2's ``fully_shard`` (per layer, then the model)
  instead of DDP: the optimizer steps DTensor shards.

``--finished FILE`` writes FILE when the loop has run all ``--steps``.
"""

import argparse
import contextlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

CASES = ("sound", "clock-seeded", "per-rank-shuffle", "never-steps", "fails-on-rank-1",
         "without-ddp", "hangs-on-rank-1", "fsdp2")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, default="sound")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--finished", type=Path)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(time.time_ns() if args.case == "clock-seeded" else 0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    if distributed and args.case == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif distributed and args.case != "without-ddp":
        model = DistributedDataParallel(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(128, 4, generator=generator, dtype=torch.float64)
    data = TensorDataset(x, x.sum(dim=1).sin())
    sampler = (RandomSampler(data, generator=torch.Generator().manual_seed(rank))
               if args.case == "per-rank-shuffle" else
               DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(DataLoader(data, batch_size=args.batch_size, sampler=sampler))
    for _ in range(args.steps):
        for micro in range(args.grad_accum):
            if args.case == "fails-on-rank-1" and rank == 1:
                raise RuntimeError("rank 1 lost its data shard")
            while args.case == "hangs-on-rank-1" and rank == 1:
                time.sleep(1)
            last = micro == args.grad_accum - 1
            sync = (model.no_sync() if isinstance(model, DistributedDataParallel) and not last
                    else contextlib.nullcontext())
            with sync:
                x, y = next(batches)
                loss = nn.functional.mse_loss(model(x).squeeze(1), y) / args.grad_accum
                loss.backward()
        if args.case != "never-steps":
            optimizer.step()
        optimizer.zero_grad()
    if args.finished is not None:
        args.finished.write_text("finished\n")


if __name__ == "__main__":
    main()
