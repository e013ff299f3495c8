"""How the capture reads an optimizer's tensors, by the model's names, however they are
sharded, and how rows name that sharding.

A reader knows, for what one optimizer holds (its parameters, or their gradients):

- ``specs``: each whole tensor's name, shape and type, without gathering anything;
- ``pieces``: the pieces this rank holds (harness/check/shards.py ``Piece``), each a run
  of a whole tensor's flattened elements: every rank's pieces together make each tensor
  once (where the ranks hold whole copies, rank 0's alone).

The readers:

- :class:`Whole`: the model's own parameters, whole (one process, DDP,
  ZeroRedundancyOptimizer, whose wrapper's step holds them all: rank 0's), or FSDP2's
  DTensors, each rank's ``Shard(0)`` rows its piece (any other placement gathered with
  ``full_tensor()``);
- :class:`Flat`: FSDP1 with ``use_orig_params=False`` hands the optimizer one
  FlatParameter per wrapped module, this rank's shard of the module's parameters
  flattened and concatenated; its layout (``_shard_param_infos``, ``_shapes``, ``_fqns``
  under the module's prefix) says which part of which tensor each piece of the shard is.
  With ``use_orig_params=True`` the optimizer holds those parts, one per parameter;
- ``Engine`` (harness/grad_check/script/engines.py): DeepSpeed's partitions.

A gather (a DTensor not sharded by rows) is a collective: every rank reads the same
optimizer's tensors in the same order.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.check.shards import Piece

#: How rows name the sharding of an optimizer's step (the ``sharding`` column).
SHARDINGS = ("none", "ddp", "fsdp1", "fsdp2", "zero-redundancy", "zero0", "zero1", "zero2",
             "zero3")
#: The attribute a FlatParameter answers to (its type reads as ``Parameter``).
FLAT = "_is_flat_param"
#: The name FSDP1 registers each FlatParameter under, on the module it wraps.
FLAT_NAME = "_flat_param"

#: A whole tensor's name, shape, type, and whether it is there (a gradient may not be).
Spec = tuple[str, tuple[int, ...], torch.dtype, bool]


def rows_of(tensor: torch.Tensor, name: str, rank: int) -> list[Piece]:
    """This rank's piece of ``tensor``: a DTensor's rows where it is sharded on its first
    dimension over one mesh dimension, else the whole tensor, from rank 0 alone (every
    rank holds it, or gathers it: a collective)."""
    placements = getattr(tensor, "placements", None)
    if placements is not None:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0:
            _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                              placements)
            local = tensor.to_local().detach()
            return [Piece(name, offset[0] * math.prod(tensor.shape[1:]), local.reshape(-1))]
        tensor = tensor.full_tensor()
    return [Piece(name, 0, tensor.detach().reshape(-1))] if rank == 0 else []


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

    @property
    def sharded(self) -> bool:
        """FSDP2's DTensors: each rank its own rows; else every rank a whole copy."""
        return self.sharding == "fsdp2"

    def specs(self, parameters: Sequence[nn.Parameter], tensors: Sequence[torch.Tensor | None],
              point: str = "") -> list[Spec]:
        return [(name, tuple(t.shape), t.dtype, True) if t is not None
                else (name, (), torch.float32, False)
                for name, t in zip(self.names, tensors, strict=True)]

    def pieces(self, parameters: Sequence[nn.Parameter], tensors: Sequence[torch.Tensor | None],
               rank: int, point: str = "") -> list[Piece]:
        return [piece for name, t in zip(self.names, tensors, strict=True) if t is not None
                for piece in rows_of(t, name, rank)]


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
    #: Where each piece starts in its tensor's flattened elements.
    starts: tuple[int, ...]

    def shard_pieces(self, local: torch.Tensor | None, rank: int) -> list[Piece]:
        """The pieces of this rank's shard ``local`` (rank 0's alone where every rank holds
        the whole flat tensor)."""
        if local is None or (not self.sharded and rank != 0):
            return []
        flat = local.detach().reshape(-1)
        return [Piece(name, start, flat[where[0]:where[0] + where[1]])
                for name, where, start in zip(self.names, self.pieces, self.starts, strict=True)
                if where is not None and where[1]]

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
    numels = tuple(getattr(flat, "_numels_with_padding", None) or flat._numels)
    group = handle.process_group
    sharded = (handle.uses_sharded_strategy and dist.is_initialized()
               and dist.get_world_size(group) > 1)
    infos = flat._shard_param_infos
    pieces = tuple((info.offset_in_shard, info.numel_in_shard) if info.in_shard else None
                   for info in infos)
    starts = tuple(info.intra_param_start_idx if info.in_shard else 0 for info in infos)
    return Layout(tuple(n or prefix + fqn for n, fqn in zip(own, fqns, strict=True)),
                  tuple(flat._shapes), numels,
                  tuple(getattr(flat, "_is_padding_mask", [False] * len(numels))),
                  flat._unpadded_unsharded_size.numel(), group, sharded,
                  flat._sharded_size.numel(), flat.dtype, pieces, starts)


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

    def specs(self, tensors: Sequence[torch.Tensor | None]) -> list[Spec]:
        if self.layout is None:
            tensor = tensors[self.positions[0]]
            return Whole([self.name]).specs((), [tensor])
        here = [tensors[position] for position in self.positions]
        dtype = next((t.dtype for t in here if t is not None), self.layout.dtype)
        return [(name, tuple(shape), dtype, True)
                for name, shape in zip(self.layout.names, self.layout.shapes, strict=True)]

    def pieces(self, tensors: Sequence[torch.Tensor | None], rank: int) -> list[Piece]:
        if self.layout is None:
            return Whole([self.name]).pieces((), [tensors[self.positions[0]]], rank)
        if not self.slots:
            return self.layout.shard_pieces(tensors[self.positions[0]], rank)
        layout = self.layout
        return [Piece(layout.names[slot], layout.starts[slot], tensor.detach().reshape(-1))
                for position, slot in zip(self.positions, self.slots, strict=True)
                if (tensor := tensors[position]) is not None and layout.pieces[slot]
                and (layout.sharded or rank == 0)]


@dataclass
class Flat:
    """FSDP1's parameters read whole: FlatParameters (``use_orig_params=False``) split
    into the tensors they hold, original parameters (``use_orig_params=True``: each a
    piece of its FlatParameter's shard on each rank) gathered by their FlatParameter's
    layout, among whole parameters."""

    parts: list[Part]
    sharding: str = "fsdp1"
    sharded: bool = True

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

    def specs(self, parameters: Sequence[nn.Parameter], tensors: Sequence[torch.Tensor | None],
              point: str = "") -> list[Spec]:
        return [spec for part in self.parts for spec in part.specs(tensors)]

    def pieces(self, parameters: Sequence[nn.Parameter], tensors: Sequence[torch.Tensor | None],
               rank: int, point: str = "") -> list[Piece]:
        return [piece for part in self.parts for piece in part.pieces(tensors, rank)]


def reader_for(optimizer: torch.optim.Optimizer, parameters: Sequence[nn.Parameter],
               names: Sequence[str]) -> Whole | Flat:
    sharding = sharding_of(optimizer, parameters)
    if sharding == "fsdp1":
        return Flat.of(parameters, names)
    return Whole(list(names), sharding)
