"""DeepSpeed's engine under the capture: its optimizer step, read where it is whole.

Under ZeRO the model's ``param.grad`` is None at the accumulation boundary and inside the
step (stage 3's parameters even have no elements); the global pre-hook fires only for
the inner torch optimizer, over this rank's flat fp32 partition, after DeepSpeed has
unscaled and clipped it. So the capture wraps the engine's own boundary step,
``DeepSpeedEngine._take_model_step`` (run by ``engine.step()`` at the accumulation
boundary, after the gradients are reduced, before DeepSpeed clips them): the step counts
once, for the engine, named ``zero<stage>`` and by the type of the optimizer DeepSpeed
steps; the gradient is read there with ``safe_get_full_grad`` per model parameter, the
parameters after it with ``safe_get_full_fp32_param`` (harness/grad_check/script/
sharded.py ``Engine``). The inner optimizer's hook counts as inside another's step: it
is never a second optimizer. Its partitions give what DeepSpeed's clip left: the norm
of the gradient the optimizer received, summed over the ranks' partitions.
"""

from __future__ import annotations

import functools
import gc
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from harness.check.shards import Piece
from harness.grad_check.script.naming import parameter_names
from harness.grad_check.script.never_raising import never_raising
from harness.grad_check.script.wrappers import after_import

if TYPE_CHECKING:
    from harness.grad_check.script.events import EngineHost
    from harness.grad_check.script.tracked import Tracked

#: The module defining DeepSpeed's engine, and its boundary step.
ENGINE_MODULE, BOUNDARY_STEP = "deepspeed.runtime.engine", "_take_model_step"
#: Parameters no module holds under DeepSpeed: its flat copies, stepped outside the
#: engine's boundary step, which differ from one split to the next.
OUTSIDE_THE_ENGINE = (
    "DeepSpeed stepped an optimizer over its flat fp32 copies of the parameters (ZeRO "
    "partitions, master weights) outside DeepSpeedEngine.step(), e.g. a PipelineEngine's "
    "train_batch(); these belong to no module and are not captured; allowed: the engine "
    "of deepspeed.initialize, stepped with engine.step()")


@dataclass
class Engine:
    """A DeepSpeed engine's model, read as DeepSpeed holds it: the gradient as its
    partitions hold it at the accumulation boundary (reduced over the ranks, before its
    clip), the parameters as its fp32 master copy (the model's own where it keeps none);
    each rank its partition's part of each tensor, which is what DeepSpeed's own gather
    (``safe_get_full_grad``, ``safe_get_full_fp32_param``) assembles: stages 1 and 2 by
    each parameter's fragment (``_hp_mapping``), stage 3 by its partition
    (``safe_get_local_grad`` / ``safe_get_local_fp32_param``)."""

    names: list[str]
    sharding: str
    #: Whether DeepSpeed partitions the parameters' fp32 copies over the ranks (ZeRO, or
    #: its bf16 optimizer); else every rank holds them whole (stage 0 in float32).
    sharded: bool

    def specs(self, parameters: Sequence[nn.Parameter], tensors: Sequence[Any],
              point: str = "") -> list[tuple[str, tuple[int, ...], torch.dtype, bool]]:
        return [(name, tuple(getattr(p, "ds_shape", p.shape)),
                 torch.float32 if self.sharded else p.dtype, True)
                for name, p in zip(self.names, parameters, strict=True)]

    def pieces(self, parameters: Sequence[nn.Parameter], tensors: Sequence[Any], rank: int,
               point: str = "grad") -> list[Piece]:
        found = []
        for name, p in zip(self.names, parameters, strict=True):
            found += fragments(name, p, point, rank)
        return found


def fragments(name: str, p: nn.Parameter, point: str, rank: int) -> list[Piece]:
    """This rank's part of parameter ``p``'s gradient or fp32 master copy."""
    if hasattr(p, "ds_id"):  # stage 3: each rank one partition of every parameter
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad

        local = (safe_get_local_grad(p) if point == "grad" else safe_get_local_fp32_param(p))
        if local is None:
            return []
        group = p._z3_optimizer._get_param_partition_group(p)
        start = local.numel() * dist.get_rank(group=group)
        kept = max(0, min(local.numel(), p.ds_numel - start))
        return [Piece(name, start, local.detach().reshape(-1)[:kept])] if kept else []
    if hasattr(p, "_hp_mapping"):  # stages 1 and 2: a fragment of the flat partition
        mapping = p._hp_mapping
        if mapping is None:  # none of it in this rank's partition
            return []
        address = mapping.lp_fragment_address
        if point != "grad":
            return [Piece(name, address.start, mapping.get_hp_fragment().detach().reshape(-1))]
        grad = mapping.get_lp_grad_fragment(p._index_in_param_group).detach().reshape(-1)
        if grad.numel() == p.numel() and grad.numel() != address.numel:
            grad = grad.narrow(0, address.start, address.numel)  # a full buffer (bf16)
        return [Piece(name, address.start, grad.to(torch.float32))]
    tensor = p.grad if point == "grad" else p  # no partition: every rank holds it whole
    return [Piece(name, 0, tensor.detach().reshape(-1))] if rank == 0 and tensor is not None \
        else []


def wrap_engine(capture: EngineHost) -> None:
    """The engine's boundary step through ``capture.on_engine_step``, once DeepSpeed loads."""
    def patch(module: ModuleType) -> None:
        kind = module.DeepSpeedEngine
        original = getattr(kind, BOUNDARY_STEP)

        @functools.wraps(original)
        def boundary_step(engine, *args, **kwargs):
            return capture.on_engine_step(engine, lambda: original(engine, *args, **kwargs))

        setattr(kind, BOUNDARY_STEP, boundary_step)

    after_import(capture, ENGINE_MODULE, patch)


def engine_alive() -> bool:
    """Whether a DeepSpeed engine exists in this process (importing DeepSpeed, as the
    Trainer may, makes none)."""
    if "deepspeed" not in sys.modules:
        return False
    return any(issubclass(type(o), torch.nn.Module) and type(o).__name__.endswith("Engine")
               and type(o).__module__.startswith("deepspeed.") for o in gc.get_objects())


def engine_model(engine: Any) -> torch.nn.Module:
    return engine.module


def engine_kind(engine: Any) -> str:
    """The type of the torch optimizer DeepSpeed steps (the client's, or its own)."""
    optimizer = engine.optimizer
    return type(getattr(optimizer, "optimizer", optimizer)).__name__


def engine_sharding(engine: Any) -> str:
    return f"zero{int(engine.zero_optimization_stage())}"


def engine_clip(engine: Any) -> str | None:
    """DeepSpeed's own clip (``gradient_clipping``), as a row names a clip; None: none."""
    bound = float(engine.gradient_clipping() or 0.0)
    return f"gradient_clipping(max_norm={bound:g})" if bound > 0 else None


@dataclass
class EngineStep:
    """One boundary step of an engine: the tracked optimizer and what the inner optimizer
    received (sums of squares of its partitions' gradients, this rank's)."""

    engine: Any
    tracked: Tracked | None
    squares: float = 0.0
    device: torch.device = torch.device("cpu")

    def received(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                grad = getattr(parameter, "grad", None)
                if grad is not None and grad.is_floating_point():
                    self.device = grad.device
                    self.squares += float(torch.linalg.vector_norm(
                        grad.detach(), dtype=torch.float64)) ** 2

    def received_norm(self) -> float:
        """The received gradient's norm over every rank: partitions (ZeRO stage > 0) are
        summed over the data-parallel group (a collective), whole copies are not."""
        total = torch.tensor([self.squares], dtype=torch.float64, device=self.device)
        if (int(self.engine.zero_optimization_stage()) > 0 and dist.is_initialized()
                and dist.get_world_size() > 1):
            group = getattr(self.engine.optimizer, "dp_process_group", None)
            dist.all_reduce(total, group=group)
        return math.sqrt(float(total.cpu()))


@never_raising
def before_step(capture: EngineHost, engine: Any) -> Tracked | None:
    """The engine's model as one optimizer (tracked at its first boundary step), its
    gradient read while this step is among the first S; None inside another step, or once
    the capture is written."""
    if capture.step_depth != 1 or not capture.recording:
        return None
    model = engine_model(engine)
    parameters = [p for p in model.parameters() if p.requires_grad]
    key = frozenset(id(p) for p in parameters)
    tracked = capture.tracked_by(key)
    if tracked is None:
        names = parameter_names(parameters, model, [0] * len(parameters))
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        sharded = any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for p in parameters)
        tracked = capture.track(engine_kind(engine), key, parameters,
                                 Engine(names, engine_sharding(engine), sharded), model,
                                 capture.constructed.get(inner, 0))
    if tracked.steps < capture.steps:
        capture.read_gradients(tracked, engine.optimizer, engine_clip(engine))
    return tracked


@never_raising
def after_step(capture: EngineHost, done: EngineStep) -> None:
    """What DeepSpeed's clip left (a collective where it clipped), then the parameters."""
    record = done.tracked.record
    if record is not None and record.clips:
        done.tracked.record = replace(record, received_norm=done.received_norm())
    if capture.recording:
        capture.finish_step(done.tracked)
