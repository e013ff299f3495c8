"""A PyTorch Ignite program as Ignite's documentation writes one: ``idist.Parallel`` runs
``training`` on every rank (started by torchrun), ``idist.auto_dataloader`` and
``idist.auto_model`` adapt the loader and the model to the world size, and
``create_supervised_trainer(..., gradient_accumulation_steps=k)`` trains.

``--batch-size`` is the batch over every rank, as Ignite's examples give it:
``auto_dataloader`` divides it by the world size (each rank's micro-batch b is it / N). The
loss is a mean over the micro-batch, which the trainer divides by k, and DDP averages over
N. ``auto_dataloader`` shuffles by default (``shuffle=True``): at N > 1 with a
DistributedSampler of its own (seed 0), at N = 1 with the loader's RandomSampler, each its
own permutation. ``--no-shuffle`` gives both the samples in order.

    grad-check run --global-batch 16 -- torchrun --nproc_per_node {nproc} \\
        examples/scripts/ignite_loop.py --batch-size {nproc*batch} --grad-accum {accum}
"""

import argparse

import ignite.distributed as idist
import torch
from ignite.engine import Events, create_supervised_trainer
from torch import nn
from torch.utils.data import TensorDataset


def points() -> TensorDataset:
    """512 points in 8 dimensions, four classes, drawn from a fixed seed."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    return TensorDataset(x, (x @ torch.randn(8, 4, generator=generator)).argmax(1))


def training(local_rank: int, options: argparse.Namespace) -> None:
    torch.manual_seed(0)
    loader = idist.auto_dataloader(points(), batch_size=options.batch_size,
                                   shuffle=options.shuffle)
    model = idist.auto_model(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    trainer = create_supervised_trainer(model, optimizer, nn.CrossEntropyLoss(),
                                        gradient_accumulation_steps=options.grad_accum)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=4 * options.grad_accum),
                              lambda engine: engine.terminate())
    trainer.run(loader, max_epochs=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=16,
                        help="samples per micro-step over every rank")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    options = parser.parse_args()
    # gloo: the CPU's backend; under torchrun, Parallel joins the group torchrun set up.
    with idist.Parallel(backend="gloo" if idist.has_native_dist_support else None) as parallel:
        parallel.run(training, options)


if __name__ == "__main__":
    main()
