"""DataParallel's dataflow, emulated on the CPU (an emulation, labelled as such everywhere).

torch.nn.DataParallel refuses CPU tensors, yet its *semantics* are what users
ask about. This module reproduces each step of its forward and backward:

1. scatter: the batch is split along dim 0 with ``torch.chunk`` -- ceil(B/k)
   samples per chunk, so a batch of 5 on 4 devices uses only 3 of them;
2. replicate: every parameter is copied once per replica by an autograd
   function whose backward *sums* the replicas' gradients (DataParallel's
   ``Broadcast`` / ``ReduceAddCoalesced`` pair); buffers are copied without
   autograd, and replica 0 shares the original buffers -- so running statistics
   are those of replica 0 alone;
3. parallel_apply: each replica runs on its chunk (here one after the other,
   under its device slot);
4. gather: outputs are concatenated along dim 0 (scalars become a vector) and
   the loss is taken on the gathered output by the caller.

With a single device, DataParallel calls the module directly; so does this.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call

from harness.models import device_slot
from harness.strategies.common import (
    CommCounter,
    StepMeasurement,
    StepSpec,
    StrategyTrainer,
    dataparallel_passes,
)
from harness.tasks import Batch


class _ReplicateParameters(torch.autograd.Function):
    """Forward: ``replicas`` copies of every parameter. Backward: the sum of the copies' grads."""

    @staticmethod
    def forward(ctx, replicas: int, record: Callable[[list[list[torch.Tensor]]], None],
                *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.replicas, ctx.count, ctx.record = replicas, len(params), record
        return tuple(p.detach().clone() for _ in range(replicas) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        per_replica = [list(grads[j * ctx.count:(j + 1) * ctx.count]) for j in range(ctx.replicas)]
        ctx.record(per_replica)
        summed = [torch.stack([per_replica[j][i] for j in range(ctx.replicas)]).sum(0)
                  for i in range(ctx.count)]
        return (None, None, *summed)


class EmulatedDataParallel(nn.Module):
    """A CPU emulation of ``torch.nn.DataParallel(module, device_ids=range(replicas))``."""

    def __init__(self, module: nn.Module, replicas: int,
                 reduce_add: CommCounter | None = None) -> None:
        super().__init__()
        self.module = module
        self.replicas = replicas
        #: Counts the reduce-adds into device 0: one per backward, carrying the
        #: gradients of every replica but the first (which is already there).
        self.reduce_add = reduce_add if reduce_add is not None else CommCounter()
        #: Per replica, its flattened parameter gradients from the last backward.
        self.last_contributions: list[torch.Tensor] = []
        #: Samples per replica in the last forward.
        self.last_chunk_sizes: tuple[int, ...] = ()

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.replicas == 1:
            self.last_chunk_sizes = (len(inputs[0]),)
            with device_slot(0):
                return self.module(*inputs)
        chunked = [t.chunk(self.replicas) for t in inputs]
        used = len(chunked[0])
        self.last_chunk_sizes = tuple(len(c) for c in chunked[0])
        names = [name for name, p in self.module.named_parameters()]
        copies = _ReplicateParameters.apply(used, self._record,
                                            *[p for _, p in self.module.named_parameters()])
        buffers = dict(self.module.named_buffers())
        outputs = []
        for j in range(used):
            params = dict(zip(names, copies[j * len(names):(j + 1) * len(names)], strict=True))
            replica_buffers = buffers if j == 0 else {n: b.clone() for n, b in buffers.items()}
            with device_slot(j):
                outputs.append(functional_call(self.module, {**params, **replica_buffers},
                                               tuple(c[j] for c in chunked)))
        if outputs[0].dim() == 0:
            return torch.stack(outputs)
        return torch.cat(outputs)

    def _record(self, per_replica: list[list[torch.Tensor]]) -> None:
        self.reduce_add.add([g for grads in per_replica[1:] for g in grads])
        self.last_contributions = [torch.cat([g.reshape(-1) for g in grads]).detach().cpu()
                                   for grads in per_replica]


def measure_step(spec: StepSpec, replicas: int, device: torch.device) -> StepMeasurement:
    """Run ``spec`` through the emulated DataParallel and record what lands in ``param.grad``."""
    model = copy.deepcopy(spec.model).to(device)
    wrapper = EmulatedDataParallel(model, replicas)
    batch = Batch.cat(spec.shards).to(device)
    grads, contributions, buffers = dataparallel_passes(
        spec, wrapper, model, batch, lambda: wrapper.last_contributions)
    return StepMeasurement(grads=grads, contributions=contributions,
                           chunk_sizes=wrapper.last_chunk_sizes, buffers=buffers)


class EmulatedDPTrainer(StrategyTrainer):
    """The emulated DataParallel, fed the concatenated micro-batch of every device."""

    def __init__(self, module: nn.Module, replicas: int, device: torch.device) -> None:
        super().__init__()
        self.module = module.to(device)
        self.device = device
        self.wrapper = EmulatedDataParallel(self.module, replicas, self.reduce_add)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrapper(x)

    def chunk_sizes(self, batch: Batch) -> tuple[int, ...]:
        if self.wrapper.replicas == 1:
            return (len(batch),)
        return tuple(len(c) for c in batch.chunk(self.wrapper.replicas))
