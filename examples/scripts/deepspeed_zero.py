"""DeepSpeed ZeRO (stage 1, 2 or 3) training a small regression MLP, as DeepSpeed's own
examples do: ``deepspeed.initialize``, then ``engine(x)``, ``engine.backward(loss)`` and
``engine.step()`` every micro-step, with gradient accumulation and clipping in the
config.

Correct as it is: ``engine.backward`` divides each micro-step's loss by k itself
(``scale_wrt_gas``). ``--divide-again`` also divides it in the script, the classic bug
of code ported to DeepSpeed from a plain loop: the window's gradient is then 1/k of the
big batch's. Check it with

    grad-check run --global-batch 16 -- python examples/scripts/deepspeed_zero.py \\
        --stage 2 --batch-size {batch} --grad-accum {accum}

Alone, it defaults the variables DeepSpeed's ``init_distributed`` reads (a free port);
on a machine without GPUs it runs on DeepSpeed's CPU accelerator (gloo).
"""

import argparse
import os
import socket

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2,
                        help="ZeRO stage")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--width", type=int, default=32, help="hidden layers' width")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    # The `deepspeed` launcher passes each worker its --local_rank, as DeepSpeed's docs say.
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="set by the deepspeed launcher (LOCAL_RANK is read instead)")
    parser.add_argument("--divide-again", action="store_true",
                        help="the bug: divide the loss by k before engine.backward, which "
                             "divides by k itself")
    return parser.parse_args()


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def alone_as_rank_zero() -> None:
    """What a launcher would set, where none did (one plain process)."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()})
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def regression_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    y = 0.1 * torch.tanh(x @ torch.randn(8, generator=generator))
    return TensorDataset(x, y)


def main() -> None:
    args = arguments()
    alone_as_rank_zero()
    import deepspeed

    deepspeed.init_distributed(dist_backend=None if torch.cuda.is_available() else "gloo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)  # the same initial weights on every rank and at every split
    width = args.width
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 1))
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.max_grad_norm,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10 ** 9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    data = regression_data()
    # Shuffled once, with one seed: the first N*k*b samples of the permutation make up the
    # first global batch whatever N, k and b are.
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(engine.device), y.to(engine.device)
            loss = nn.functional.mse_loss(engine(x).squeeze(1), y)
            engine.backward(loss / args.grad_accum if args.divide_again else loss)
            engine.step()  # every micro-step; the optimizer steps at the window's end
            if engine.global_steps == args.steps:
                return
        epoch += 1


if __name__ == "__main__":
    main()
