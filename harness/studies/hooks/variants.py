"""The reduction variants people switch on, and a model trained under each.

A variant is DDP with a comm hook and options, or FSDP2's ``fully_shard`` with a
divide factor or a reduce dtype. :func:`build_replica` wraps a fresh model in it
on a process group; the replica then trains one step at a time, with every
gradient collective counted (:mod:`harness.studies.hooks.measure`).

The two hand-written hooks are the classic bugs: DDP hands a comm hook the
*undivided* local gradients, so a hook that all-reduces and returns gives the
sum, and one that divides before calling a hook that divides again gives the
average over N.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)

from harness.models import device_slot
from harness.strategies import STRATEGIES, ddp
from harness.strategies.common import flat_grad, flat_params
from harness.studies.hooks.measure import RecordingState, recording
from harness.studies.hooks.schema import LEARNING_RATE, MOMENTUM, POWERSGD_STEPS, STEPS

#: PowerSGD all-reduces uncompressed for this many steps first: the smallest value
#: PowerSGDState accepts with error feedback (DDP rebuilds its buckets after step 1).
POWERSGD_WARMUP = 2
#: PowerSGD compresses a matrix only if (rows + cols) x rank x this < rows x cols. Its
#: default, 2, compresses no matrix of a 4-8-2 MLP at rank 2; 1 compresses the 8x4
#: weight at ranks 1 and 2 and the 2x8 weight at rank 1.
POWERSGD_MIN_COMPRESSION_RATE = 1.0
#: A bucket cap below any parameter's size (one bucket per parameter) and one far above
#: the whole model (one bucket), in MiB.
SMALL_BUCKET_MB = 1e-6
LARGE_BUCKET_MB = 100.0


# ------------------------------------------------------------ custom hooks
def sum_hook(group, bucket):
    """A hand-written hook that forgets DDP does not divide for it: all-reduce SUM, return."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def double_divide_hook(group, bucket):
    """A hand-written hook that divides by the world size and then calls a hook that
    divides again (``allreduce_hook``)."""
    bucket.buffer().div_(group.size())
    return allreduce_hook(group, bucket)


def _plain(hook: Callable) -> Callable[[dist.ProcessGroup, int], tuple[Any, Callable]]:
    """A hook whose state is the process group."""
    return lambda group, seed: (group, hook)


def _powersgd(rank: int, error_feedback: bool = True
              ) -> Callable[[dist.ProcessGroup, int], tuple[Any, Callable]]:
    def make(group: dist.ProcessGroup, seed: int) -> tuple[Any, Callable]:
        state = PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                              start_powerSGD_iter=POWERSGD_WARMUP,
                              min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE,
                              use_error_feedback=error_feedback, random_seed=seed)
        return state, powerSGD_hook

    return make


def _renamed(hook: Callable) -> Callable:
    """``hook`` under another name: DDP's by-name refusal of bf16 hooks without NCCL
    does not see it, so its arithmetic can be measured over gloo."""

    def renamed(state, bucket):
        return hook(state, bucket)

    return renamed


# ---------------------------------------------------------------- catalogue
@dataclass(frozen=True)
class Variant:
    """One reduction setting: a strategy and what is switched on."""

    strategy: str
    name: str
    #: The exact settings, as a user would write them.
    setting: str
    #: DDP: a factory ``(group, seed) -> (state, hook)``.
    hook: Callable[[dist.ProcessGroup, int], tuple[Any, Callable]] | None = None
    #: DDP constructor options.
    options: tuple[tuple[str, Any], ...] = ()
    #: ZeroRedundancyOptimizer instead of torch.optim.SGD.
    sharded_optimizer: bool = False
    #: FSDP2: ``set_gradient_divide_factor`` argument (None: FSDP's own average).
    divide_factor: float | None = None
    #: FSDP2: ``MixedPrecisionPolicy(reduce_dtype=...)`` (None: no policy).
    reduce_dtype: torch.dtype | None = None
    #: SGD steps the case trains.
    steps: int = STEPS


def _ddp(name: str, setting: str, hook: Callable = allreduce_hook, *,
         make: Callable[[dist.ProcessGroup, int], tuple[Any, Callable]] | None = None,
         options: tuple[tuple[str, Any], ...] = (), sharded_optimizer: bool = False,
         steps: int = STEPS) -> Variant:
    """A DDP variant: ``hook`` with the group as its state, or a hook and state from ``make``."""
    return Variant("ddp", name, setting, hook=make or _plain(hook), options=options,
                   sharded_optimizer=sharded_optimizer, steps=steps)


VARIANTS: tuple[Variant, ...] = (
    _ddp("allreduce_hook", "register_comm_hook(group, allreduce_hook): DDP's default "
         "reduction (divide by N, all-reduce SUM) as a hook"),
    _ddp("fp16_compress_hook", "register_comm_hook(group, fp16_compress_hook)",
         fp16_compress_hook),
    _ddp("bf16_compress_hook", "register_comm_hook(group, bf16_compress_hook)",
         bf16_compress_hook),
    _ddp("bf16_compress_hook-renamed", "bf16_compress_hook registered under another name "
         "(DDP refuses it by name without NCCL)", _renamed(bf16_compress_hook)),
    _ddp("powerSGD-rank1", f"PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter="
         f"{POWERSGD_WARMUP}, min_compression_rate={POWERSGD_MIN_COMPRESSION_RATE:g}), "
         "powerSGD_hook", make=_powersgd(1), steps=POWERSGD_STEPS),
    _ddp("powerSGD-rank2", f"PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter="
         f"{POWERSGD_WARMUP}, min_compression_rate={POWERSGD_MIN_COMPRESSION_RATE:g}), "
         "powerSGD_hook", make=_powersgd(2), steps=POWERSGD_STEPS),
    _ddp("powerSGD-rank1-no-error-feedback", "as powerSGD-rank1 with use_error_feedback=False: "
         "each step's compression error is dropped instead of added to the next step's "
         "gradient", make=_powersgd(1, error_feedback=False),
         steps=POWERSGD_STEPS),
    _ddp("sum-hook", "a hand-written hook: all_reduce(bucket.buffer()) without dividing",
         sum_hook),
    _ddp("double-divide-hook", "a hand-written hook: bucket.buffer().div_(N), then "
         "allreduce_hook (which divides again)", double_divide_hook),
    _ddp("gradient_as_bucket_view", "DDP(gradient_as_bucket_view=True)",
         options=(("gradient_as_bucket_view", True),)),
    _ddp("static_graph", "DDP(static_graph=True)", options=(("static_graph", True),)),
    _ddp("bucket_cap_mb-small", f"DDP(bucket_cap_mb={SMALL_BUCKET_MB:g})",
         options=(("bucket_cap_mb", SMALL_BUCKET_MB),)),
    _ddp("bucket_cap_mb-large", f"DDP(bucket_cap_mb={LARGE_BUCKET_MB:g})",
         options=(("bucket_cap_mb", LARGE_BUCKET_MB),)),
    _ddp("ZeroRedundancyOptimizer", "ZeroRedundancyOptimizer(optimizer_class=SGD) over DDP "
         "with allreduce_hook", sharded_optimizer=True),
    Variant("fsdp", "fully_shard", "fully_shard(model, mesh=...): FSDP2's own average"),
    Variant("fsdp", "set_gradient_divide_factor", "fully_shard(...)."
            "set_gradient_divide_factor(1.0): divide by 1 instead of N", divide_factor=1.0),
    Variant("fsdp", "reduce_dtype-bfloat16", "fully_shard(..., mp_policy=MixedPrecisionPolicy("
            "reduce_dtype=torch.bfloat16))", reduce_dtype=torch.bfloat16),
    Variant("fsdp", "reduce_dtype-float16", "fully_shard(..., mp_policy=MixedPrecisionPolicy("
            "reduce_dtype=torch.float16))", reduce_dtype=torch.float16),
)


def variant_by_name(strategy: str, name: str) -> Variant:
    for variant in VARIANTS:
        if (variant.strategy, variant.name) == (strategy, name):
            return variant
    raise ValueError(f"unknown variant {strategy}/{name}")


# ----------------------------------------------------------------- replicas
class Replica(ABC):
    """A model under a variant on this rank: forward, optimizer, and what a step left.

    After each step, :meth:`snapshot` packs this rank's gradient and weights into one
    vector; rank 0 gathers every rank's snapshots once per case and :meth:`assemble`
    turns them back into whole vectors (one collective per case, not two per step).
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    #: Every rank holds the whole gradient and weights (DDP), not a shard of them (FSDP).
    replicated: bool = True

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with device_slot(self.rank):
            return self.wrapped(x)

    @property
    @abstractmethod
    def wrapped(self) -> nn.Module: ...

    @abstractmethod
    def snapshot(self) -> torch.Tensor:
        """This rank's ``param.grad`` and weights (or its shards of them), float64, flat."""

    @abstractmethod
    def assemble(self, snapshots: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every rank's snapshot of one step -> (gradients, weights) as whole vectors: one
        per rank when replicated, the one reassembled from the shards otherwise."""

    def buckets(self) -> int | None:
        """Buckets the comm hook was handed since :meth:`start_step`; None without buckets."""
        return None

    def start_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_elements(self) -> int:
        """Optimizer state elements (momentum buffers) this rank holds."""
        # ZeroRedundancyOptimizer keeps this rank's partition in a local optimizer.
        local_optimizer = getattr(self.optimizer, "optim", self.optimizer)
        total = 0
        for state in local_optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    local = value.to_local() if hasattr(value, "to_local") else value
                    total += local.numel()
        return total


def _sgd(params, group: dist.ProcessGroup, sharded: bool) -> torch.optim.Optimizer:
    if not sharded:
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=MOMENTUM)
    # Imported here: torch.distributed.optim pulls in FSDP and DTensor and scripts its
    # functional optimizers (~0.7 s per rank after FSDP, ~2 s without).
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, process_group=group,
                                   lr=LEARNING_RATE, momentum=MOMENTUM)


class DDPReplica(Replica):
    def __init__(self, variant: Variant, module: nn.Module, group: dist.ProcessGroup,
                 device: torch.device, seed: int) -> None:
        super().__init__(dist.get_rank(group))
        self.module = module.to(device)
        self.ddp = ddp.wrap(self.module, group, device, **dict(variant.options))
        inner_state, hook = variant.hook(group, seed)
        self.hook_state = RecordingState(inner_state)
        self.ddp.register_comm_hook(self.hook_state, recording(hook))
        self.optimizer = _sgd(self.module.parameters(), group, variant.sharded_optimizer)

    @property
    def wrapped(self) -> nn.Module:
        return self.ddp

    def snapshot(self) -> torch.Tensor:
        return torch.cat([flat_grad(self.module), flat_params(self.module)]).to(torch.float64)

    def assemble(self, snapshots: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        size = len(snapshots[0]) // 2
        return [s[:size] for s in snapshots], [s[size:] for s in snapshots]

    def buckets(self) -> int | None:
        return len(self.hook_state.buckets)

    def start_step(self) -> None:
        super().start_step()
        self.hook_state.buckets.clear()


class FSDPReplica(Replica):
    """FSDP2 shards every parameter (and its gradient) along dim 0 as ``torch.chunk``
    does: rank r holds rows [r*c, (r+1)*c) with c = ceil(rows / N), possibly none."""

    replicated = False

    def __init__(self, variant: Variant, module: nn.Module, group: dist.ProcessGroup,
                 device: torch.device) -> None:
        super().__init__(dist.get_rank(group))
        # Imported here: torch.distributed.fsdp costs ~1 s to import, in every rank.
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.world_size = dist.get_world_size(group)
        mesh = DeviceMesh.from_group(group, device.type)
        policy = ({"mp_policy": MixedPrecisionPolicy(reduce_dtype=variant.reduce_dtype)}
                  if variant.reduce_dtype is not None else {})
        self.module = fully_shard(module.to(device), mesh=mesh, **policy)
        if variant.divide_factor is not None:
            self.module.set_gradient_divide_factor(variant.divide_factor)
        self.optimizer = _sgd(self.module.parameters(), group, sharded=False)
        self.shapes = [tuple(p.shape) for p in self.module.parameters()]

    @property
    def wrapped(self) -> nn.Module:
        return self.module

    def _rows(self, shape: tuple[int, ...]) -> int:
        return -(-shape[0] // self.world_size)

    def _padded(self, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's shard, zero-padded to c rows, so that every rank sends as much."""
        rows, width = self._rows(shape), math.prod(shape[1:])
        padded = torch.zeros(rows, width, dtype=torch.float64)
        padded[:local.shape[0]] = local.detach().reshape(-1, width).cpu()
        return padded.reshape(-1)

    def snapshot(self) -> torch.Tensor:
        # Shards, not DTensor.full_tensor(): one gather per case instead of one per parameter.
        params = list(self.module.parameters())
        grads = [self._padded(p.grad.to_local(), s) for p, s in zip(params, self.shapes,
                                                                    strict=True)]
        weights = [self._padded(p.to_local(), s) for p, s in zip(params, self.shapes,
                                                                 strict=True)]
        return torch.cat(grads + weights)

    def _whole(self, snapshots: list[torch.Tensor], offset: int) -> tuple[torch.Tensor, int]:
        """The whole vector whose shards start at ``offset`` in every rank's snapshot."""
        parts = []
        for shape in self.shapes:
            rows, width = self._rows(shape), math.prod(shape[1:])
            for rank, snapshot in enumerate(snapshots):
                held = max(0, min(rows, shape[0] - rank * rows))
                parts.append(snapshot[offset:offset + held * width])
            offset += rows * width
        return torch.cat(parts), offset

    def assemble(self, snapshots: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        grad, offset = self._whole(snapshots, 0)
        weights, _ = self._whole(snapshots, offset)
        return [grad], [weights]


def build_replica(variant: Variant, module: nn.Module, group: dist.ProcessGroup,
                  device: torch.device, seed: int) -> Replica:
    if STRATEGIES[variant.strategy].sharded:
        return FSDPReplica(variant, module, group, device)
    return DDPReplica(variant, module, group, device, seed)
