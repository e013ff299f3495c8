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
  of step 1, after step 0 finished everywhere;
- ``exits-0-on-rank-1``: rank 1 ends with exit code 0 once it has joined the process
  group, before its first step, while rank 0 goes on into DDP's all-reduce;
- ``exits-0-before-joining-on-rank-1``: rank 1 ends with exit code 0 before it joins,
  while rank 0 waits for it to;
- ``joins-one-rank-too-many``: from N > 1 on, every rank joins with
  ``world_size=WORLD_SIZE + 1``;
- ``starts-a-daemon``: rank 0 starts ``sleep`` in a session of its own (``setsid``), as a
  script starting a server does, and writes its pid to ``--pid-dir``;
- ``not-finite-at-n2``: at N = 2 the loss of step 0 is NaN; ``not-finite``: at every N;
- ``fails-after-training``: the loop runs all its steps, then the script raises (an
  evaluation that fails).

The loop takes k from ``--grad-accum``, or, as real trainers do, from ``--total-batch``
(llm.c, LitGPT: k = total / (b x N)) or from ``--grad-accum-all`` (nanoGPT: k x N, divided
by N). ``--finished FILE`` writes FILE when the loop has run all ``--steps``;
``--fill-at-n2 DIR``: at N = 2, rank 0 fills DIR's file system before it trains.
"""

import argparse
import contextlib
import faulthandler
import os
import signal
import subprocess
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
         "segfaults-at-step-1-on-rank-1", "exits-0-on-rank-1",
         "exits-0-before-joining-on-rank-1", "joins-one-rank-too-many", "starts-a-daemon",
         "not-finite-at-n2", "not-finite", "fails-after-training")


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
    parser.add_argument("--fill-at-n2", type=Path)
    return parser.parse_args()


def fill(folder: Path) -> None:
    """Zeros into ``folder`` until its file system takes no more."""
    with open(folder / "filler", "ab", buffering=0) as handle, \
            contextlib.suppress(OSError):
        while handle.write(b"\0" * 4096):
            pass


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
    if args.case == "exits-0-before-joining-on-rank-1" and os.environ.get("RANK") == "1":
        sys.exit(0)
    if args.case == "starts-a-daemon" and os.environ.get("RANK", "0") == "0":
        daemon = subprocess.Popen(["setsid", "sleep", "600"], stdin=subprocess.DEVNULL)
        (args.pid_dir / f"{daemon.pid}.pid").write_text("daemon\n")
    if args.case == "joins-one-rank-too-many" and distributed:
        dist.init_process_group("gloo", world_size=int(os.environ["WORLD_SIZE"]) + 1)
    elif distributed or args.case in ("always-distributed", "joins-twice"):
        dist.init_process_group("gloo")
    if args.case == "joins-twice" and os.fork() == 0:
        dist.init_process_group("gloo")  # the same RANK, the same store
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.fill_at_n2 is not None and world_size == 2 and rank == 0:
        fill(args.fill_at_n2)
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
            if args.case == "exits-0-on-rank-1" and rank == 1:
                sys.exit(0)
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
                if step == 0 and (args.case == "not-finite" or (
                        args.case == "not-finite-at-n2" and world_size == 2)):
                    loss = loss * float("nan")
                loss.backward()
            while args.case == "sleeps-after-backward-on-rank-1" and rank == 1:
                time.sleep(1)
        if args.case != "never-steps":
            optimizer.step()
        optimizer.zero_grad()
    if args.finished is not None:
        args.finished.write_text("finished\n")
    if args.case == "fails-after-training":
        raise RuntimeError("the evaluation after training failed")


if __name__ == "__main__":
    main()
