"""A plain PyTorch loop under FullyShardedDataParallel: FSDP1 (``--fsdp 1``: the
``FullyShardedDataParallel`` wrapper, flat parameters, or pieces of them with
``--use-orig-params``, its own ``clip_grad_norm_``) or
FSDP2 (``--fsdp 2``: ``fully_shard``, DTensor parameters), each linear layer a unit of its
own; gradient accumulation under ``no_sync`` (FSDP1) or
``set_requires_gradient_sync(False)`` (FSDP2), clipping, AdamW.

Correct as it is; ``--forget-divide`` leaves out the loss's ``/ k``, the classic bug of
accumulation: the window's gradient is then k times the big batch's. Check it with

    grad-check run --global-batch 16 -- python examples/scripts/fsdp_loop.py --fsdp 1 \\
        --batch-size {batch} --grad-accum {accum}

Every split runs under FSDP, one process too (a process group of one, on a free port).
"""

import argparse
import contextlib
import itertools
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=1, help="FSDP version")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--use-orig-params", action="store_true",
                        help="FSDP1: hand the optimizer the original parameters (as "
                             "Accelerate and the Trainer do), each a piece of a flat shard")
    parser.add_argument("--width", type=int, default=32, help="hidden layers' width")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--forget-divide", action="store_true",
                        help="the bug: backpropagate the micro-batch's loss without / k")
    return parser.parse_args()


def init_process_group() -> None:
    """Under a launcher as it says; alone, a process group of one on a free port."""
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def regression_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    y = 0.1 * torch.tanh(x @ torch.randn(8, generator=generator))
    return TensorDataset(x, y)


def sharded(model: nn.Module, version: int, orig_params: bool) -> nn.Module:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                        use_orig_params=orig_params, device_id=device)
    from torch.distributed.fsdp import fully_shard

    model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def accumulating(model: nn.Module, version: int, last: bool):
    """No gradient reduction but on the window's last micro-step."""
    if version == 1:
        return contextlib.nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def main() -> None:
    args = arguments()
    init_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank and at every split
    width = args.width
    model = sharded(nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width),
                                  nn.Tanh(), nn.Linear(width, 1)), args.fsdp,
                    args.use_orig_params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = regression_data()
    # Shuffled once, with one seed: the first N*k*b samples of the permutation make up the
    # first global batch whatever N, k and b are.
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    device = next(model.parameters()).device
    step = 0
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for micro, (x, y) in enumerate(loader):
            last = (micro + 1) % args.grad_accum == 0
            with accumulating(model, args.fsdp, last):
                loss = nn.functional.mse_loss(model(x.to(device)).squeeze(1), y.to(device))
                (loss if args.forget_divide else loss / args.grad_accum).backward()
            if not last:
                continue
            if args.fsdp == 1:
                model.clip_grad_norm_(args.max_grad_norm)  # FSDP1 clips its shards itself
            else:
                nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.steps:
                dist.destroy_process_group()
                return


if __name__ == "__main__":
    main()
