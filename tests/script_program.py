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
  instead of DDP: the optimizer steps DTensor shards;
- ``exits-3-on-rank-1``: rank 1 ends with exit code 3 in its first micro-step, without a
  Python error, while rank 0 waits for it in DDP's all-reduce;
- ``always-distributed``: the sound loop, joining the process group even alone, as
  DeepSpeed's ``init_distributed`` does (``init_process_group()`` needs RANK);
- ``joins-twice``: the sound loop, whose process, once it has joined the process group,
  forks a child that joins again under the same RANK (a CLI that joins, then starts its
  worker with its own environment);
- ``forks-and-hangs``: every rank forks a child (as a DataLoader starts its workers),
  writes both pids to ``--pid-dir``, then both sleep;
- ``sleeps-after-backward-on-rank-1``: rank 1 sleeps forever once its first backward is
  done (its gradients all-reduced), while rank 0 goes on into the step;
- ``segfaults-at-step-1-on-rank-1``: rank 1 is killed by SIGSEGV in its first micro-step
  of step 1, after step 0 finished everywhere.

The loop takes k from ``--grad-accum``, or, as real trainers do, from ``--total-batch``
(llm.c, LitGPT: k = total / (b x N)) or from ``--grad-accum-all`` (nanoGPT: k x N, divided
by N). ``--finished FILE`` writes FILE when the loop has run all ``--steps``.
"""

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

CASES = ("sound", "clock-seeded", "per-rank-shuffle", "never-steps", "fails-on-rank-1",
         "without-ddp", "hangs-on-rank-1", "fsdp2", "exits-3-on-rank-1", "always-distributed",
         "joins-twice", "forks-and-hangs", "sleeps-after-backward-on-rank-1",
         "segfaults-at-step-1-on-rank-1")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, default="sound")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--total-batch", type=int)
    parser.add_argument("--grad-accum-all", type=int)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--finished", type=Path)
    parser.add_argument("--pid-dir", type=Path)
    return parser.parse_args()


def forks_and_hangs(pid_dir: Path) -> None:
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(1)
    (pid_dir / f"{os.getpid()}.pid").write_text("rank\n")
    (pid_dir / f"{child}.pid").write_text("child\n")
    while True:
        time.sleep(1)


def main() -> None:
    args = arguments()
    if args.case == "forks-and-hangs":
        forks_and_hangs(args.pid_dir)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed or args.case in ("always-distributed", "joins-twice"):
        dist.init_process_group("gloo")
    if args.case == "joins-twice" and os.fork() == 0:
        dist.init_process_group("gloo")  # the same RANK, the same store
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.total_batch is not None:
        args.grad_accum = args.total_batch // (args.batch_size * world_size)
    if args.grad_accum_all is not None:
        args.grad_accum = args.grad_accum_all // world_size
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
    for step in range(args.steps):
        for micro in range(args.grad_accum):
            if args.case == "segfaults-at-step-1-on-rank-1" and rank == 1 and step == 1:
                faulthandler.disable()  # as a crash in an extension: no Python traceback
                os.kill(os.getpid(), signal.SIGSEGV)
            if args.case == "fails-on-rank-1" and rank == 1:
                raise RuntimeError("rank 1 lost its data shard")
            if args.case == "exits-3-on-rank-1" and rank == 1:
                time.sleep(0.5)  # rank 0 is in its all-reduce by now
                sys.exit(3)
            while args.case == "hangs-on-rank-1" and rank == 1:
                time.sleep(1)
            last = micro == args.grad_accum - 1
            sync = (model.no_sync() if isinstance(model, DistributedDataParallel) and not last
                    else contextlib.nullcontext())
            with sync:
                x, y = next(batches)
                loss = nn.functional.mse_loss(model(x).squeeze(1), y) / args.grad_accum
                loss.backward()
            while args.case == "sleeps-after-backward-on-rank-1" and rank == 1:
                time.sleep(1)
        if args.case != "never-steps":
            optimizer.step()
        optimizer.zero_grad()
    if args.finished is not None:
        args.finished.write_text("finished\n")


if __name__ == "__main__":
    main()
