"""How the capture reads an optimizer's tensors whole, by the model's names, however they
are sharded, and how rows name that sharding.

A reader turns what one optimizer holds into ``{name: whole tensor}``, the same at every
split:

- :class:`Whole`: the optimizer holds the model's own parameters, whole (one process,
  DDP, ZeroRedundancyOptimizer, whose wrapper's step holds them all) or as FSDP2's
  DTensors, gathered with ``full_tensor()``;
- :class:`Flat`: FSDP1 with ``use_orig_params=False`` hands the optimizer one
  FlatParameter per wrapped module, this rank's piece of the module's parameters
  flattened and concatenated. Every rank's piece is all-gathered (the handle's process
  group), the padding cut, and the rest split by the FlatParameter's own layout (its
  ``_numels_with_padding``, ``_shapes``), named by the module's prefix and ``_fqns``:
  ``summon_full_params(with_grads=True)`` refuses these;
- :class:`Engine`: DeepSpeed's engine, read at its accumulation boundary (harness/
  grad_check/script/deepspeed.py) with DeepSpeed's own gather, ``safe_get_full_grad`` and
  ``safe_get_full_fp32_param``, per parameter of the model it wraps.

Every gather is a collective: every rank reads the same optimizer's tensors in the same
order.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.grad_check.script.tracked import whole

#: How rows name the sharding of an optimizer's step (the ``sharding`` column).
SHARDINGS = ("none", "ddp", "fsdp1", "fsdp2", "zero-redundancy", "zero0", "zero1", "zero2",
             "zero3")
#: The attribute a FlatParameter answers to (its type reads as ``Parameter``).
FLAT = "_is_flat_param"
#: The name FSDP1 registers each FlatParameter under, on the module it wraps.
FLAT_NAME = "_flat_param"

Named = dict[str, "torch.Tensor | None"]


def is_flat(parameter: torch.Tensor) -> bool:
    """A FlatParameter, or an original parameter FSDP1 shards (``use_orig_params``)."""
    return bool(getattr(parameter, FLAT, False)) or hasattr(parameter, "_fsdp_flattened")


def is_dtensor(tensor: torch.Tensor) -> bool:
    return callable(getattr(tensor, "full_tensor", None))


def sharding_of(optimizer: torch.optim.Optimizer, parameters: Sequence[nn.Parameter]) -> str:
    """How the optimizer's parameters are spread over the ranks."""
    if any(is_flat(p) for p in parameters):
        return "fsdp1"
    if any(is_dtensor(p) for p in parameters):
        return "fsdp2"
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        return "zero-redundancy"
    return "ddp" if replicated(parameters) else "none"


def replicated(parameters: Sequence[nn.Parameter]) -> bool:
    """Whether a live DistributedDataParallel holds the parameters."""
    wanted = {id(p) for p in parameters}
    for module in (o for o in gc.get_objects() if issubclass(type(o), nn.Module)):
        if (type(module).__name__ == "DistributedDataParallel"
                and any(id(p) in wanted for p in module.parameters())):
            return True
    return False


@dataclass
class Whole:
    """The optimizer's parameters by their names, whole (DTensors gathered)."""

    names: list[str]
    sharding: str = "none"

    def gradients(self, parameters: Sequence[nn.Parameter],
                  grads: Sequence[torch.Tensor | None]) -> Named:
        return {name: None if g is None else whole(g).detach()
                for name, g in zip(self.names, grads, strict=True)}

    def parameters(self, parameters: Sequence[nn.Parameter]) -> Named:
        return {name: whole(p).detach() for name, p in zip(self.names, parameters,
                                                            strict=True)}


@dataclass(frozen=True)
class Layout:
    """One FlatParameter: the tensors it concatenates, and how to gather its pieces."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    #: Each piece's elements, padding included; ``padding``: which pieces are padding.
    numels: tuple[int, ...]
    padding: tuple[bool, ...]
    #: Elements of the whole flat tensor before the right-hand padding for the ranks.
    unpadded: int
    group: object
    sharded: bool
    #: This rank's shard: its elements (padding included) and its type.
    shard: int
    dtype: torch.dtype
    #: Where each tensor's piece lies in this rank's shard, (offset, elements), or None
    #: where it has none here: the optimizer holds these pieces under ``use_orig_params``.
    pieces: tuple[tuple[int, int] | None, ...]

    def assembled(self, pieces: dict[int, torch.Tensor | None]) -> torch.Tensor:
        """This rank's shard from the pieces the optimizer holds, by tensor index."""
        like = next((t for t in pieces.values() if t is not None), None)
        local = torch.zeros(self.shard, dtype=like.dtype if like is not None else self.dtype,
                            device=like.device if like is not None else None)
        for index, tensor in pieces.items():
            where = self.pieces[index]
            if where is not None and tensor is not None and where[1]:
                local[where[0]:where[0] + where[1]] = tensor.detach().reshape(-1)
        return local

    def split(self, local: torch.Tensor | None) -> Named:
        """The tensors of this rank's shard ``local``, gathered from every rank."""
        if local is None:
            return dict.fromkeys(self.names)
        flat = local.detach().reshape(-1)
        if self.sharded:
            pieces = [torch.empty_like(flat) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(pieces, flat, group=self.group)
            flat = torch.cat(pieces)
        tensors = [t for t, pad in zip(torch.split(flat[:self.unpadded], list(self.numels)),
                                       self.padding, strict=True) if not pad]
        return {name: tensor.reshape(shape).clone()
                for name, tensor, shape in zip(self.names, tensors, self.shapes, strict=True)}


def handles() -> dict[int, Any]:
    """FSDP1's handles alive, by the id of their FlatParameter and, under
    ``use_orig_params``, of each original parameter they shard."""
    found = {}
    for handle in (o for o in gc.get_objects() if type(o).__name__ == "FlatParamHandle"):
        flat = handle.flat_param
        found[id(flat)] = handle
        for parameter in getattr(flat, "_params", None) or ():
            found[id(parameter)] = handle
    return found


def layout_of(handle: Any, names: dict[int, str], name: str) -> Layout:
    """The layout of the handle's FlatParameter, its tensors named as the model names them
    (``names``, by parameter id), else by the prefix of ``name`` (``<prefix>._flat_param``,
    or an original parameter's) and their ``_fqns``."""
    flat = handle.flat_param
    originals = getattr(flat, "_params", None) or ()
    fqns = list(flat._fqns)
    known = next((j for j, p in enumerate(originals) if id(p) in names), None)
    prefix = (name[:-len(FLAT_NAME)] if name.endswith(FLAT_NAME)
              else name[:len(name) - len(fqns[known])] if known is not None else "")
    own = [names.get(id(originals[j])) if j < len(originals) else None
           for j in range(len(fqns))]
    numels = tuple(getattr(flat, "_numels_with_padding", flat._numels))
    group = handle.process_group
    sharded = (handle.uses_sharded_strategy and dist.is_initialized()
               and dist.get_world_size(group) > 1)
    pieces = tuple((info.offset_in_shard, info.numel_in_shard) if info.in_shard else None
                   for info in flat._shard_param_infos)
    return Layout(tuple(n or prefix + fqn for n, fqn in zip(own, fqns, strict=True)),
                  tuple(flat._shapes), numels,
                  tuple(getattr(flat, "_is_padding_mask", [False] * len(numels))),
                  flat._unpadded_unsharded_size.numel(), group, sharded,
                  flat._sharded_size.numel(), flat.dtype, pieces)


@dataclass(frozen=True)
class Part:
    """What one read of the optimizer's parameters at ``positions`` gives: a whole
    tensor (``name``), a FlatParameter split (``layout``), or the original parameters'
    pieces assembled into their FlatParameter's shard first (``slots``: each one's index
    among the layout's tensors)."""

    positions: tuple[int, ...]
    name: str = ""
    layout: Layout | None = None
    slots: tuple[int, ...] = ()

    def read(self, tensors: Sequence[torch.Tensor | None]) -> Named:
        if self.layout is None:
            tensor = tensors[self.positions[0]]
            return {self.name: None if tensor is None else whole(tensor).detach()}
        if not self.slots:
            return self.layout.split(tensors[self.positions[0]])
        return self.layout.split(self.layout.assembled(
            {slot: tensors[position] for position, slot in zip(self.positions, self.slots,
                                                                strict=True)}))


@dataclass
class Flat:
    """FSDP1's parameters read whole: FlatParameters (``use_orig_params=False``) split
    into the tensors they hold, original parameters (``use_orig_params=True``: each a
    piece of its FlatParameter's shard on each rank) gathered by their FlatParameter's
    layout, among whole parameters."""

    parts: list[Part]
    sharding: str = "fsdp1"

    @classmethod
    def of(cls, parameters: Sequence[nn.Parameter], names: Sequence[str]) -> Flat:
        by_id, found = {id(p): n for p, n in zip(parameters, names, strict=True)}, handles()
        parts: list[Part | int] = []  # an int: a handle whose original parameters gather
        originals: dict[int, tuple[Layout, list[int], list[int]]] = {}
        for position, (parameter, name) in enumerate(zip(parameters, names, strict=True)):
            handle = found.get(id(parameter))
            if handle is None:
                parts.append(Part((position,), name))
            elif handle.flat_param is parameter:
                parts.append(Part((position,), layout=layout_of(handle, by_id, name)))
            else:
                if id(handle) not in originals:
                    originals[id(handle)] = (layout_of(handle, by_id, name), [], [])
                    parts.append(id(handle))
                _, positions, slots = originals[id(handle)]
                positions.append(position)
                slots.append(next(j for j, p in enumerate(handle.flat_param._params)
                                  if p is parameter))
        return cls([part if isinstance(part, Part) else
                    Part(tuple(originals[part][1]), layout=originals[part][0],
                         slots=tuple(originals[part][2])) for part in parts])

    @property
    def names(self) -> list[str]:
        return [name for part in self.parts
                for name in (part.layout.names if part.layout is not None else (part.name,))]

    def _read(self, tensors: Sequence[torch.Tensor | None]) -> Named:
        named: Named = {}
        for part in self.parts:
            named.update(part.read(tensors))
        return named

    def gradients(self, parameters: Sequence[nn.Parameter],
                  grads: Sequence[torch.Tensor | None]) -> Named:
        return self._read(grads)

    def parameters(self, parameters: Sequence[nn.Parameter]) -> Named:
        return self._read(list(parameters))


@dataclass
class Engine:
    """A DeepSpeed engine's model, read with DeepSpeed's own gather: the gradient as its
    partitions hold it at the accumulation boundary (reduced over the ranks, before
    DeepSpeed's clip), the parameters as its fp32 master copy (the model's own where
    DeepSpeed keeps none)."""

    names: list[str]
    sharding: str

    def gradients(self, parameters: Sequence[nn.Parameter],
                  grads: Sequence[torch.Tensor | None]) -> Named:
        from deepspeed.utils import safe_get_full_grad

        named: Named = {}
        for name, p in zip(self.names, parameters, strict=True):
            grad = safe_get_full_grad(p)
            named[name] = None if grad is None else grad.detach()
        return named

    def parameters(self, parameters: Sequence[nn.Parameter]) -> Named:
        from deepspeed.utils import safe_get_full_fp32_param

        named: Named = {}
        for name, p in zip(self.names, parameters, strict=True):
            master = safe_get_full_fp32_param(p)
            named[name] = (master if master is not None else p).detach()
        return named


Reader = Whole | Flat | Engine


def reader_for(optimizer: torch.optim.Optimizer, parameters: Sequence[nn.Parameter],
               names: Sequence[str]) -> Reader:
    sharding = sharding_of(optimizer, parameters)
    if sharding == "fsdp1":
        return Flat.of(parameters, names)
    return Whole(list(names), sharding)
