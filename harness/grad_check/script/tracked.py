"""The capture's bookkeeping: each optimizer it tracks, and the window of micro-steps
that each optimizer's next step ends (the forwards fed since its last step, the gradients
kept before a clip or an unscale edits them, the clips called)."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from harness.check.compare import sampled_fingerprint
from harness.check.shards import Piece
from harness.grad_check.script.wire import OptimizerRecord, StepRecord


def digests(tensors: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """A sampled fingerprint of each tensor: ranks holding the same tensors get the same
    numbers, and the tensors where two ranks differ show by name."""
    return {name: sampled_fingerprint([tensor]) for name, tensor in tensors.items()}


def learning_rates(optimizer: torch.optim.Optimizer) -> list[float]:
    rates = []
    for group in optimizer.param_groups:
        try:
            rates.append(float(group.get("lr", math.nan)))
        except (TypeError, ValueError):
            rates.append(math.nan)
    return rates


def identity_of(optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """An optimizer is known by the trainable parameters it holds."""
    return frozenset(id(p) for group in optimizer.param_groups for p in group["params"]
                     if getattr(p, "requires_grad", False))


@dataclass
class Forward:
    """One training forward: the parameters its module holds, the samples it fed and the
    labelled tokens it counted."""

    held: frozenset[int]
    samples: list[list[str]]
    count: int | None
    #: The labels the losses computed from this forward counted (None: no loss counted).
    loss_count: int | None = None

    @property
    def labels(self) -> int | None:
        """The labels this forward's loss averaged: the model's ``labels`` where it took
        them, else what the losses computed from its output counted."""
        return self.count if self.count is not None else self.loss_count


@dataclass
class Window:
    """What happened since the optimizers' last steps."""

    #: Forwards seen so far, numbered from 0 (a key of :attr:`events`).
    forwards: int = 0
    events: dict[int, Forward] = field(default_factory=dict)
    #: Gradients kept before a clip or an unscale edited them, by parameter id.
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Each clip called, with the parameters it was given.
    clips: list[tuple[str, set[int]]] = field(default_factory=list)
    #: Inside a clip (one clip calls another: the outermost is the script's).
    clipping: bool = False
    #: Each batch a DataLoader handed the script: (the forward it came before, its dataset
    #: indices).
    batches: list[tuple[int, list[int]]] = field(default_factory=list)
    held_by: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    #: The outputs of outermost module calls still alive: a later call whose input shares
    #: one's memory (``features.detach()``) is fed an activation, not data.
    outputs: list[weakref.ref] = field(default_factory=list)

    def produced(self, output: torch.Tensor) -> None:
        self.outputs = [ref for ref in self.outputs if ref() is not None]
        with contextlib.suppress(TypeError, RuntimeError):
            self.outputs.append(weakref.ref(output))

    def is_activation(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares its memory with a live output of a module call."""
        with contextlib.suppress(RuntimeError):
            pointer = tensor.untyped_storage().data_ptr()
            return any(output is not None and output.untyped_storage().data_ptr() == pointer
                       for output in (ref() for ref in self.outputs))
        return False

    def parameters_of(self, module: nn.Module) -> frozenset[int]:
        held = self.held_by.get(module)
        if held is None:
            held = frozenset(id(p) for p in module.parameters())
            self.held_by[module] = held
        return held

    #: Labels counted by losses inside the outermost forward in progress (a model that
    #: computes its loss itself), not yet given to that forward's record.
    counted_inside: int | None = None

    def forwarded(self, held: frozenset[int], fed: list[list[str]], count: int | None) -> None:
        self.events[self.forwards] = Forward(held, fed, count, self.counted_inside)
        self.forwards += 1

    def loss_counted(self, count: int, inside_forward: bool) -> None:
        """A loss counted ``count`` labels: inside a forward, that forward's; after it, the
        last forward's (a loss computed from its output)."""
        if inside_forward:
            self.counted_inside = (self.counted_inside or 0) + count
        elif self.forwards - 1 in self.events:
            event = self.events[self.forwards - 1]
            event.loss_count = (event.loss_count or 0) + count

    def forward_ended(self, fed: bool) -> None:
        """An outermost module call ended; ``fed``: it was a training forward, which took
        the labels counted inside it (a model that computes its loss). One that fed
        nothing is a loss module (nn.CrossEntropyLoss, torchtune's chunked loss): what it
        counted is the last forward's."""
        counted, self.counted_inside = self.counted_inside, None
        if counted is not None and not fed:
            self.loss_counted(counted, inside_forward=False)

    def loaded(self, indices: Any) -> None:
        """A batch's dataset indices (a sampler that yields one index: a batch of one;
        an iterable dataset's, which has none, is not kept)."""
        found = [indices] if isinstance(indices, int) else indices
        if isinstance(found, (list, tuple)) and all(isinstance(i, int) for i in found):
            self.batches.append((self.forwards, list(found)))

    def indices_since(self, since: int) -> list[int]:
        return [index for at, batch in self.batches if at >= since for index in batch]

    def keep_gradients(self, parameters: Iterable[nn.Parameter], again: bool = False) -> None:
        """Each gradient as it is now, where this window has not kept it yet (``again``:
        in its place, at a clip that follows another in the window)."""
        for parameter in parameters:
            if parameter.grad is not None and (again or id(parameter) not in self.kept):
                self.kept[id(parameter)] = parameter.grad.detach().clone()

    def clip_calls(self, key: Iterable[int]) -> int:
        """How many clips of this window any one of the parameters went through: more than
        one where the script clips every micro-step."""
        return max((sum(1 for _, held in self.clips if parameter in held)
                    for parameter in key), default=0)

    def kept_bytes(self) -> int:
        """The memory the kept gradients take in this process (a DTensor's: its shard's)."""
        local = [getattr(t, "to_local", lambda t=t: t)() for t in self.kept.values()]
        return sum(t.numel() * t.element_size() for t in local)

    def clipped(self, text: str, parameters: Iterable[nn.Parameter]) -> None:
        self.clips.append((text, {id(p) for p in parameters}))

    def clips_of(self, key: frozenset[int]) -> list[str]:
        return [text for text, held in self.clips if held & key]

    def forget(self, parameters: Iterable[nn.Parameter], oldest: int) -> None:
        """An optimizer stepped: its gradients and clips are done with, and forwards
        before ``oldest`` (the earliest window still open) are no longer needed."""
        ids = {id(p) for p in parameters}
        for key in ids:
            self.kept.pop(key, None)
        self.clips = [(text, held - ids) for text, held in self.clips if held - ids]
        for index in [index for index in self.events if index < oldest]:
            del self.events[index]
        self.batches = [(at, batch) for at, batch in self.batches if at >= oldest]


@dataclass
class Tracked:
    """One optimizer, known by its parameters; ``since``: the first forward of its window;
    ``reader`` (harness/grad_check/script/sharded.py): how its tensors are read whole, by
    name, whatever shards them."""

    index: int
    kind: str
    key: frozenset[int]
    parameters: list[nn.Parameter]
    reader: Any
    since: int = 0
    steps: int = 0
    record: StepRecord | None = None

    def open_record(self, window: Window, optimizer: torch.optim.Optimizer) -> StepRecord:
        """The record of the step about to be taken: its window's forwards, clips and
        learning rates."""
        fed = [event for index, event in sorted(window.events.items())
               if index >= self.since and event.held & self.key]
        self.record = StepRecord(
            optimizer=self.index, step=self.steps,
            samples=[sample for event in fed for sample in event.samples], forwards=len(fed),
            per_forward=[len(event.samples) for event in fed],
            counts=[event.labels for event in fed if event.labels is not None],
            lrs=learning_rates(optimizer), clips=window.clips_of(self.key),
            clip_calls=window.clip_calls(self.key), indices=window.indices_since(self.since))
        return self.record

    def close_record(self, window: Window) -> StepRecord:
        record, self.record = self.record, None
        self.steps += 1
        self.since = window.forwards
        return record

    @property
    def names(self) -> list[str]:
        return list(self.reader.names)

    def read(self, tensors: Sequence[torch.Tensor | None], point: str,
             rank: int) -> tuple[list, list, dict[str, float] | None]:
        """The whole tensors' specs, this rank's pieces, and, where every rank holds
        whole copies, their digests (None where each holds its own shard)."""
        specs = self.reader.specs(self.parameters, tensors, point)
        if not self.sharded:  # rank 0's whole tensors stand for every rank's
            pieces = [Piece(name, 0, t.detach().reshape(-1)) for name, t
                      in zip(self.names, tensors, strict=True) if t is not None]
            return specs, pieces, digests(dict(zip(self.names, tensors, strict=True)))
        return specs, self.reader.pieces(self.parameters, tensors, rank, point), None

    @property
    def sharded(self) -> bool:
        """Whether each rank holds its own shard of the tensors (not a whole copy)."""
        return bool(self.reader.sharded)

    def summary(self) -> OptimizerRecord:
        return OptimizerRecord(self.kind, self.names, self.steps, self.reader.sharding)


def oldest_window(tracked: Sequence[Tracked], constructed: weakref.WeakKeyDictionary,
                  forwards: int) -> int:
    """The first forward any optimizer's next step may still count: the windows of those
    tracked, and of those ``constructed`` that have not stepped yet."""
    starts = [optimizer.since for optimizer in tracked]
    keys = {optimizer.key for optimizer in tracked}
    starts += [since for optimizer, since in list(constructed.items())
               if identity_of(optimizer) not in keys]
    return min(starts, default=forwards)


def captured_enough(tracked: Sequence[Tracked], constructed: weakref.WeakKeyDictionary,
                    inner: set[frozenset[int]], inner_optimizers: weakref.WeakSet,
                    steps: int) -> bool:
    """Every optimizer alive (not one stepped inside another's step) has taken ``steps``
    steps: one that never steps lets the script run to its end."""
    done = {optimizer.key for optimizer in tracked if optimizer.steps >= steps}
    if len(done) < len(tracked):
        return False
    alive = [optimizer for optimizer in list(constructed) if optimizer not in inner_optimizers]
    return all(key in done or key in inner or not key for key in map(identity_of, alive))
