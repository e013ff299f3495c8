"""The real torch.nn.DataParallel, over CUDA devices 0..k-1 of this node.

Each replica's parameters are non-leaf copies made by DataParallel's
``replicate``; a forward pre-hook on the module (which the replicas share)
registers a gradient hook on every such copy, so the harness records exactly
the gradient each replica sends into DataParallel's reduce-add.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
from torch import nn

from harness.strategies.common import (
    StepMeasurement,
    StepSpec,
    StrategyTrainer,
    dataparallel_passes,
)
from harness.tasks import Batch


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def unavailable_reason(world_size: int) -> str | None:
    """Why real DataParallel cannot run with ``world_size`` devices here, or None."""
    have = cuda_devices()
    if have < world_size:
        return f"skipped: needs {world_size} CUDA device{'s' if world_size > 1 else ''}, has {have}"
    return None


class _ReplicaGradientRecorder:
    """Records, per replica device, the gradients of that replica's parameter copies."""

    def __init__(self, module: nn.Module) -> None:
        self.count = sum(1 for _ in module.parameters())
        self.grads: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        self.handle = module.register_forward_pre_hook(self._on_forward)

    def _on_forward(self, replica: nn.Module, inputs: tuple) -> None:
        copies = [getattr(m, name) for m in replica.modules()
                  for name in getattr(m, "_former_parameters", {})]
        if len(copies) != self.count:  # the original module (single-device path)
            return
        device = inputs[0].device.index
        for index, tensor in enumerate(copies):
            if tensor.requires_grad:
                tensor.register_hook(self._store(device, index))

    def _store(self, device: int, index: int):
        def hook(grad: torch.Tensor) -> None:
            self.grads[device][index] = grad.detach().reshape(-1).cpu()
        return hook

    def contributions(self) -> list[torch.Tensor]:
        return [torch.cat([self.grads[d][i] for i in range(self.count)])
                for d in sorted(self.grads)]


def measure_step(spec: StepSpec, replicas: int) -> StepMeasurement:
    """Run ``spec`` through real DataParallel on cuda:0..replicas-1."""
    model = copy.deepcopy(spec.model).to("cuda:0")
    recorder = _ReplicaGradientRecorder(model)
    wrapper = nn.DataParallel(model, device_ids=list(range(replicas)))
    batch = Batch.cat(spec.shards).to(torch.device("cuda:0"))

    def first_pass_contributions() -> list[torch.Tensor]:
        recorder.handle.remove()  # later passes are only about accumulation
        return recorder.contributions()

    grads, contributions, buffers = dataparallel_passes(spec, wrapper, model, batch,
                                                        first_pass_contributions)
    return StepMeasurement(grads=grads, contributions=contributions,
                           chunk_sizes=tuple(len(c) for c in batch.chunk(replicas)),
                           buffers=buffers)


class DPTrainer(StrategyTrainer):
    """Real DataParallel over cuda:0..replicas-1, fed the concatenated micro-batch."""

    def __init__(self, module: nn.Module, replicas: int) -> None:
        super().__init__()
        self.device = torch.device("cuda:0")
        self.module = module.to(self.device)
        self.replicas = replicas
        self.recorder = _ReplicaGradientRecorder(self.module)
        self.wrapper = nn.DataParallel(self.module, device_ids=list(range(replicas)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrapper(x)

    def after_backward(self) -> None:
        """One reduce-add per backward with several replicas: all but device 0's gradients."""
        devices = sorted(self.recorder.grads)
        if len(devices) > 1:
            self.reduce_add.add([g for d in devices[1:] for g in self.recorder.grads[d].values()])
        self.recorder.grads.clear()

    def chunk_sizes(self, batch: Batch) -> tuple[int, ...]:
        if self.replicas == 1:
            return (len(batch),)
        return tuple(len(c) for c in batch.chunk(self.replicas))
