"""Training scripts that real users write, for ``grad-check run``'s verdicts, one per
``--case``; each trains a small model on a fixed dataset with DDP from N > 1 on, and a
DistributedSampler shuffled with one seed, so that every split feeds the same samples.

Correct scripts (each must match at every split):

- ``composite``: a model of two modules called one after the other, a loss module with a
  parameter of its own, an evaluation forward with autograd on every step, a forward on
  the meta device first (as a FLOP counter does), and a stateless SGD re-created every step;
- ``checkpointed``: a sequence-first GRU (its samples on axis 1) whose head runs under
  activation checkpointing, reentrant and not;
- ``bf16-layer``: a float32 model whose middle layer runs under bfloat16 autocast entered
  inside its ``forward``;
- ``bf16-by-hand``: a float32 model whose middle layer casts its input and weights to
  bfloat16 itself (``F.linear(h.bfloat16(), w.bfloat16())``), returning float32, as
  custom low-precision layers do;
- ``zero-redundancy``: DDP with a ZeroRedundancyOptimizer (each rank steps the state of
  its shard of the parameters, then broadcasts them), plain SGD in one process;
- ``task-module``: timm's train.py, a task module holding the model and the loss module,
  whose model child alone is swapped for ``DDP(model)`` from N > 1 on.

Scripts with a bug (each must read what it is):

- ``clipped-no-divide``: the loss not divided by k, under a clip that binds;
- ``one-logit``: cross-entropy over a single logit, whose gradient is zero;
- ``two-optimizers``: the head has an optimizer of its own and a loss not divided by k;
- ``clip-on-rank-0``: rank 0 alone clips before the step;
- ``remainder``: the dataset ends in a window of fewer micro-steps than k, stepped with
  the loss divided by k;
- ``zero-redundancy-no-divide``: ``zero-redundancy`` with the loss not divided by k;
- ``clip-every-micro-step``: DDP with ``no_sync`` but on the last micro-step, and a clip
  that binds after every micro-step's backward, not once per window;
- ``augmented-in-workers``: the sound loop, its samples given a random jitter as two
  DataLoader workers load them, from each worker's own seed (as image augmentation does):
  every split draws the same indices, but which worker loads which batch depends on b;
- ``count-before-shift``: a float64 model of padded sequences whose loss alone casts to
  float32, each micro-batch's token mean after the causal shift weighed by its tokens
  counted before it, the window divided by that count (torchtune's recipes): each
  micro-batch weighs 1 + rows / tokens, a small real difference (~1e-4).
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

CASES = ("composite", "checkpointed", "bf16-layer", "clipped-no-divide", "one-logit",
         "two-optimizers", "clip-on-rank-0", "remainder", "zero-redundancy",
         "zero-redundancy-no-divide", "bf16-by-hand", "count-before-shift",
         "clip-every-micro-step", "augmented-in-workers", "task-module")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    return parser.parse_args()


class Scaled(nn.Module):
    """A loss module with a parameter of its own (a learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output * self.temperature - target) ** 2).mean()


class Recurrent(nn.Module):
    """A sequence-first GRU and a head run under activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 5).double()
        self.head = nn.Linear(5, 1).double()

    def forward(self, sequences: torch.Tensor) -> torch.Tensor:  # (T, b, 3)
        hidden, _ = self.gru(sequences)
        last = checkpoint(self.head, hidden[-1], use_reentrant=False)
        return checkpoint(torch.tanh, last, use_reentrant=True).squeeze(1)


class Jittered(Dataset):
    """Each sample's input jittered at random as it loads, from the loading process's own
    random state (a DataLoader worker's is seeded per worker)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        x, y = self.data[index]
        return x + 0.1 * torch.randn_like(x), y


def wrapped(module: nn.Module, distributed: bool) -> nn.Module:
    return DistributedDataParallel(module) if distributed else module


def data(case: str) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    samples = 24 if case == "remainder" else 64
    x = torch.randn(samples, 4, generator=generator, dtype=torch.float64)
    if case == "one-logit":
        return TensorDataset(x, torch.zeros(samples, dtype=torch.long))
    if case == "count-before-shift":  # sequences of 30 to 32 tokens, padded: NaN targets
        tokens = torch.randn(samples, 32, 4, generator=generator, dtype=torch.float64)
        lengths = torch.randint(30, 33, (samples, 1), generator=generator)
        targets = tokens.sum(dim=2).sin()
        return TensorDataset(tokens, targets.where(torch.arange(32) < lengths, torch.nan))
    if case == "checkpointed":
        sequences = torch.randn(samples, 6, 3, generator=generator, dtype=torch.float64)
        return TensorDataset(sequences, sequences.sum(dim=(1, 2)).sin())
    return TensorDataset(x, x.sum(dim=1).sin())


def main() -> None:
    args = arguments()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    dataset = data(args.case)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
    workers = 0
    if args.case == "augmented-in-workers":
        dataset, workers = Jittered(dataset), 2
    batches = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                         num_workers=workers)
    step = TRAINERS[args.case](args, distributed, rank)
    done = 0
    while True:  # epochs, until --steps optimizer steps
        for index, (x, y) in enumerate(batches, start=1):
            last = index % args.grad_accum == 0 or index == len(batches)
            step(x, y, last)
            done += last
            if done == args.steps:
                return


def composite(args, distributed: bool, rank: int):
    encoder = wrapped(nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double(), distributed)
    head = wrapped(nn.Linear(8, 1).double(), distributed)
    loss_module = wrapped(Scaled(), distributed)
    parameters = [*encoder.parameters(), *head.parameters(), *loss_module.parameters()]
    with torch.device("meta"):  # as a FLOP counter runs the model before training
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))(torch.empty(2, 4))

    def step(x, y, last: bool) -> None:
        loss = loss_module(head(encoder(x)).squeeze(1), y) / args.grad_accum
        loss.backward()
        if last:
            torch.optim.SGD(parameters, lr=0.1).step()  # stateless: re-created each step
            for p in parameters:
                p.grad = None
            encoder.eval(), head.eval()
            head(encoder(x)).sum()  # an evaluation forward, autograd on
            encoder.train(), head.train()

    return step


def single_model(module: nn.Module, distributed: bool, clip: float | None = None,
                 divide: bool = True, loss=nn.functional.mse_loss, clip_ranks=None,
                 inputs=lambda x: x, sharded_state: bool = False):
    def make(args, dist_on: bool, rank: int):
        model = wrapped(module, distributed and dist_on)
        optimizer = (ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                             momentum=0.9)
                     if sharded_state and dist_on else
                     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if sharded_state
                                     else 0.0))

        def step(x, y, last: bool) -> None:
            output = model(inputs(x))
            output = output.squeeze(1) if output.dim() > 1 and output.shape[1] == 1 else output
            value = loss(output, y)
            (value / args.grad_accum if divide else value).backward()
            if last:
                if clip is not None and (clip_ranks is None or rank in clip_ranks):
                    nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()

        return step

    return make


class HalfLayer(nn.Module):
    """float32, but its middle layer runs under bfloat16 autocast, entered in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x.float()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = torch.tanh(self.middle(hidden))
        return self.last(hidden.float())


def bf16_layer(args, distributed: bool, rank: int):
    torch.manual_seed(0)
    return single_model(HalfLayer(), True, loss=lambda o, y: nn.functional.mse_loss(
        o, y.float()))(args, distributed, rank)


def two_optimizers(args, distributed: bool, rank: int):
    body = wrapped(nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double(), distributed)
    head = wrapped(nn.Linear(8, 1).double(), distributed)
    body_optimizer = torch.optim.SGD(body.parameters(), lr=0.1)
    head_optimizer = torch.optim.SGD(head.parameters(), lr=0.1)

    def step(x, y, last: bool) -> None:
        features = body(x)
        loss = nn.functional.mse_loss(head(features.detach()).squeeze(1), y)
        loss.backward()  # the head's loss is not divided by k
        (nn.functional.mse_loss(features.sum(dim=1), y) / args.grad_accum).backward()
        if last:
            body_optimizer.step()
            head_optimizer.step()
            body_optimizer.zero_grad(), head_optimizer.zero_grad()

    return step


class ByHand(nn.Module):
    """float32, its middle layer computed in bfloat16 by hand and returned as float32."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x.float()))
        weight, bias = self.middle.weight, self.middle.bias
        hidden = nn.functional.linear(hidden.bfloat16(), weight.bfloat16(), bias.bfloat16())
        return self.last(torch.tanh(hidden.float()))


def bf16_by_hand(args, distributed: bool, rank: int):
    torch.manual_seed(0)
    return single_model(ByHand(), True, loss=lambda o, y: nn.functional.mse_loss(
        o, y.float()))(args, distributed, rank)


def count_before_shift(args, distributed: bool, rank: int):
    """Each micro-batch's mean over its targets after the shift, times its tokens counted
    before it; the window's gradient times N over the window's count (all ranks')."""
    model = wrapped(nn.Linear(4, 1).double(), distributed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    world_size = dist.get_world_size() if distributed else 1
    counted = torch.zeros((), dtype=torch.float64)

    def step(x, y, last: bool) -> None:
        nonlocal counted
        before = ~y.isnan()  # the tokens, counted before the shift
        after = before[:, 1:]  # each predicts the next token's target
        predicted = model(x).squeeze(2)[:, :-1].float()  # the loss alone casts to float32
        errors = (predicted - y[:, 1:].nan_to_num().float()) ** 2
        mean = errors[after].mean()
        (mean * before.sum()).backward()
        counted += before.sum()
        if last:
            if distributed:
                dist.all_reduce(counted)
            for parameter in model.parameters():
                parameter.grad *= world_size / counted
            optimizer.step()
            optimizer.zero_grad()
            counted = torch.zeros((), dtype=torch.float64)

    return step


def clip_every_micro_step(args, distributed: bool, rank: int):
    model = wrapped(mlp(), distributed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y, last: bool) -> None:
        synced = not distributed or last
        with contextlib.nullcontext() if synced else model.no_sync():
            loss = nn.functional.mse_loss(model(x).squeeze(1), y) / args.grad_accum
            loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # every micro-step
        if last:
            optimizer.step()
            optimizer.zero_grad()

    return step


class Task(nn.Module):
    """timm's train.py: the model and the loss module under one module, the model child
    alone wrapped in DDP (the optimizer's parameters are the task's)."""

    def __init__(self, model: nn.Module, distributed: bool) -> None:
        super().__init__()
        self.trainable_module = model
        self.criterion = nn.MSELoss()
        if distributed:
            self.trainable_module = DistributedDataParallel(model)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.trainable_module(x).squeeze(1), y)


def task_module(args, distributed: bool, rank: int):
    task = Task(mlp(), distributed)
    optimizer = torch.optim.SGD(task.parameters(), lr=0.1)

    def step(x, y, last: bool) -> None:
        (task(x, y) / args.grad_accum).backward()
        if last:
            optimizer.step()
            optimizer.zero_grad()

    return step


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


TRAINERS = {
    "composite": composite,
    "checkpointed": lambda args, d, rank: single_model(
        Recurrent(), True, inputs=lambda x: x.transpose(0, 1))(args, d, rank),
    "bf16-layer": bf16_layer,
    "clipped-no-divide": lambda args, d, rank: single_model(mlp(), True, clip=0.05,
                                                            divide=False)(args, d, rank),
    "one-logit": lambda args, d, rank: single_model(
        nn.Linear(4, 1).double(), True,
        loss=lambda o, y: nn.functional.cross_entropy(o.reshape(-1, 1), y))(args, d, rank),
    "two-optimizers": two_optimizers,
    "clip-on-rank-0": lambda args, d, rank: single_model(mlp(), True, clip=0.05,
                                                         clip_ranks={0})(args, d, rank),
    "remainder": lambda args, d, rank: single_model(mlp(), True)(args, d, rank),
    "zero-redundancy": lambda args, d, rank: single_model(
        mlp(), True, sharded_state=True)(args, d, rank),
    "zero-redundancy-no-divide": lambda args, d, rank: single_model(
        mlp(), True, sharded_state=True, divide=False)(args, d, rank),
    "bf16-by-hand": bf16_by_hand,
    "count-before-shift": count_before_shift,
    "clip-every-micro-step": clip_every_micro_step,
    "augmented-in-workers": lambda args, d, rank: single_model(mlp(), True)(args, d, rank),
    "task-module": task_module,
}


if __name__ == "__main__":
    main()
