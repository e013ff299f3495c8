"""What ``grad-check run`` runs inside each of the user's processes, before their script.

``startup/sitecustomize.py`` installs a :class:`Capture` when :data:`FOLDER_VARIABLE`
names a folder; the user's code is not changed. Through torch's global hooks and a few
wrapped functions it sees:

- every optimizer the script steps (torch's global step hooks), known by the parameters it
  holds (one re-created over them is the same optimizer); a wrapper's step that calls an
  inner optimizer's counts once, for the wrapper (ZeroRedundancyOptimizer; DeepSpeed's
  engine: engines.py). For each of its first S steps: the window's gradient before
  anything edits it (on entry to a clip, after ``GradScaler.unscale_``, at DeepSpeed's
  boundary, else as ``step()`` receives it), how far a clip scaled it, the learning rates
  and the parameters after the step, named as the model names them however sharded
  (sharded.py, engines.py). The reference's first run writes each point, every rank its
  shard; every other run compares each rank's shard with the reference's matching slice,
  the ranks' sums combined (points.py); ranks holding whole copies write digests of them;
- every training forward (samples.py: an outermost call of a module with parameters,
  autograd on, in training mode, on data, not recomputed in a backward): a fingerprint of
  each sample it fed and the labels counted (the model's ``labels``, else those its loss's
  integer targets count: wrappers.py ``wrap_losses``);
- the floating types that ran: parameters, gradients, losses, and every operation in the
  graph behind each loss (graph.py: autocast entered inside ``forward``, a layer cast by
  hand).

The capture never raises inside the user's code: what it cannot read it records as
unknown. Once every optimizer alive has taken S steps, every rank writes its summary,
waits for the others' (so that none is still inside a collective of step S), and the
process ends with exit code 0 (``--keep-going``: the script goes on; the summary is
written at exit). A setup that cannot be captured is refused by name, exit code 2, with
one line for the launcher.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import socket
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from harness.errors import USAGE_EXIT
from harness.grad_check.script import ending, engines, naming, points, samples, wire, wrappers
from harness.grad_check.script.graph import graph_dtypes
from harness.grad_check.script.guard import failed
from harness.grad_check.script.naming import owner, parameter_names
from harness.grad_check.script.never_raising import Refused, never_raising
from harness.grad_check.script.sharded import reader_for
from harness.grad_check.script.tracked import (
    Tracked,
    Window,
    captured_enough,
    identity_of,
    oldest_window,
)


class Capture:
    """The capture of one process: rank ``RANK`` of ``WORLD_SIZE`` (0 of 1 without them)."""

    def __init__(self, folder: Path, steps: int, keep_going: bool, timeout: float,
                 micro_batch: int | None = None, against: Path | None = None) -> None:
        self.folder, self.steps, self.keep_going, self.timeout = (folder, steps, keep_going,
                                                                  timeout)
        self.micro_batch = micro_batch
        self.rank = int(os.environ.get("RANK", "0"))
        #: Where each point goes: written (the reference's first run) or compared.
        self.points = points.Points(folder, against, self.rank)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.tracked: list[Tracked] = []
        #: Optimizers constructed and still alive, with where their first window starts.
        self.constructed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        #: Identities (parameter sets) seen stepping inside another optimizer's step, and
        #: the optimizers themselves (DeepSpeed steps one with a group at a time).
        self.inner: set[frozenset[int]] = set()
        self.inner_optimizers: weakref.WeakSet = weakref.WeakSet()
        #: DeepSpeed's boundary step being taken, if any.
        self.engine: engines.EngineStep | None = None
        self.window = Window()
        self.step_depth = self.forward_depth = self.backward_depth = 0
        self.facts: dict[str, set[str]] = {"batchnorm": set(), "dropout": set()}
        self.dtypes: set[str] = set()
        #: The types of the parameters stepped: a float64 model whose loss alone casts to
        #: float32 can round no further than that cast.
        self.model_dtypes: set[str] = set()
        self.unknown: set[str] = set()
        self.records: list[wire.StepRecord] = []
        self.written = False

    # ------------------------------------------------------------------ hooks
    def install(self) -> None:
        register_optimizer_step_pre_hook(self.before_step)
        register_optimizer_step_post_hook(self.after_step)
        register_module_forward_pre_hook(self.entering_module)
        register_module_forward_hook(self.leaving_module, with_kwargs=True, always_call=True)
        wrappers.wrap_construction(self)
        wrappers.wrap_backward(self)
        wrappers.wrap_clipping(self)
        wrappers.wrap_data_loading(self)
        wrappers.wrap_losses(self)
        engines.wrap_engine(self)
        original_hook = sys.excepthook

        def excepthook(kind, error, traceback):
            ending.record_error(self.folder, self.rank, failed(error, traceback))
            original_hook(kind, error, traceback)

        sys.excepthook = excepthook
        atexit.register(self.write_summary)

    # ------------------------------------------------------------------ events
    # What the wrapped functions of torch and of the frameworks (wrappers.py, engines.py)
    # tell the capture; nothing else of the capture is theirs to touch.
    def on_construct(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer was constructed: its first window starts at the next forward."""
        with contextlib.suppress(TypeError):  # an object that cannot be weakly held
            self.constructed[optimizer] = self.window.forwards

    @contextlib.contextmanager
    def on_backward(self, tensors: Any) -> Iterator[None]:
        """A backward of ``tensors`` runs inside: a forward in it recomputes (activation
        checkpointing) rather than feeds new samples."""
        self.saw_backward(tensors)
        self.backward_depth += 1
        try:
            yield
        finally:
            self.backward_depth -= 1

    @contextlib.contextmanager
    def on_clip(self, text: str, held: list[nn.Parameter]) -> Iterator[None]:
        """A clip of ``held`` runs inside; the outermost (clip_grad_norm_ calls
        clip_grads_with_norm_) keeps the window's gradient first, and again where a clip
        of the same window came before (wrappers.py ``clipping``)."""
        outermost = not self.window.clipping
        if outermost:
            self.before_editing(held, again=self.window.clip_calls({id(p) for p in held}) > 0)
            self.window.clipped(text, held)
        self.window.clipping = True
        try:
            yield
        finally:
            self.window.clipping = not outermost

    def could_not(self, what: str) -> None:
        """Something the capture could not read or wrap: the summary says so."""
        self.unknown.add(what)

    @never_raising
    def before_editing(self, parameters: Iterable[nn.Parameter], again: bool = False) -> None:
        """Keep each gradient as it is now, where this window has not kept it yet (``again``:
        in place of what it kept)."""
        if self.recording:
            self.window.keep_gradients(parameters, again)

    @never_raising
    def loaded(self, indices: Any) -> None:
        """A batch of the dataset's ``indices`` handed to the script."""
        if self.recording:
            self.window.loaded(indices)

    @property
    def recording(self) -> bool:
        return not self.written

    @never_raising
    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple,
                    kwargs: dict) -> tuple[tuple, dict] | None:
        """Before the outermost step: the gradients, or, where the step is given a closure
        (Lightning passes one that runs the last micro-step's backward and the clipping),
        a closure that reads them once it has run."""
        self.step_depth += 1
        key = identity_of(optimizer)
        if self.step_depth > 1:
            self.inner.add(key)
            with contextlib.suppress(TypeError):
                self.inner_optimizers.add(optimizer)
            if self.engine is not None:
                self.engine.received(optimizer)
            return None
        if not self.recording:
            return None
        tracked = self._tracked(optimizer, key)
        if tracked.steps >= self.steps:  # captured already: the script goes on (--keep-going)
            return None
        return wrappers.reading_after_closure(
            args, kwargs, functools.partial(self.read_gradients, tracked, optimizer))

    @never_raising
    def read_gradients(self, tracked: Tracked, optimizer: torch.optim.Optimizer,
                       clip: str | None = None) -> None:
        """The window's gradient, before any clip: digested, written or compared shard by
        shard (points.py). ``clip``: the optimizer's own (DeepSpeed's), whose received
        norm comes later."""
        received = [p.grad for p in tracked.parameters]
        before = [self.window.kept.get(id(p), grad)
                  for p, grad in zip(tracked.parameters, received, strict=True)]
        specs, pieces, kept = tracked.read(before, "grad", self.rank)
        self.dtypes.update(str(p.dtype) for p in tracked.parameters)
        self.model_dtypes.update(str(p.dtype) for p in tracked.parameters)
        self.dtypes.update(str(dtype) for _, _, dtype, present in specs if present)
        record = tracked.open_record(self.window, optimizer)
        clips = record.clips + ([clip] if clip else [])
        tracked.record = replace(
            record, grad_digests=kept, kept_bytes=self.window.kept_bytes(), clips=clips,
            before_norm=points.norm(pieces, tracked.sharded) if clips else None,
            received_norm=points.norm(tracked.read(received, "grad", self.rank)[1],
                                      tracked.sharded) if clips and not clip else None,
            non_finite={"grad": points.not_finite(pieces)},
            compared={"grad": self.points.done(tracked.index, tracked.steps, "grad", specs,
                                               pieces, tracked.sharded)})

    @never_raising
    def after_step(self, optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
        self.step_depth -= 1
        if self.step_depth > 0 or not self.recording:
            return
        tracked = self.tracked_by(identity_of(optimizer))
        if tracked is not None:
            self.finish_step(tracked)

    def finish_step(self, tracked: Tracked) -> None:
        """The parameters after a step: digested, written or compared; the window closed
        (a step not captured closes its window too)."""
        captured = tracked.record is not None
        if captured:
            specs, pieces, kept = tracked.read(tracked.parameters, "params", self.rank)
            tracked.record = replace(tracked.record, params_digests=kept, non_finite={
                **tracked.record.non_finite, "params": points.not_finite(pieces)}, compared={
                **tracked.record.compared, "params": self.points.done(
                    tracked.index, tracked.steps, "params", specs, pieces, tracked.sharded)})
            self.records.append(tracked.close_record(self.window))
        else:
            tracked.since = self.window.forwards
        self.window.forget(tracked.parameters, oldest_window(self.tracked, self.constructed,
                                                            self.window.forwards))
        if not captured:
            return
        if not self.keep_going and captured_enough(self.tracked, self.constructed, self.inner,
                                                   self.inner_optimizers, self.steps):
            self.stop()
        ending.keep_partial(self.summary(), self.folder, self.rank)  # a later crash keeps it

    def entering_module(self, _module: nn.Module, _args) -> None:
        self.forward_depth += 1

    def leaving_module(self, module: nn.Module, args: tuple, *rest) -> None:
        """After a module's call; ``rest`` is (kwargs, result), or (result,) where the
        call raised (torch then calls the hook without the keyword arguments)."""
        self.forward_depth = max(0, self.forward_depth - 1)
        if len(rest) == 2 and isinstance(rest[0], dict) and self.recording:
            self.saw_module(module, args, rest[0], rest[1])  # a call that raised fed nothing

    @never_raising
    def saw_module(self, module: nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
        output = samples.first_tensor(result)
        if self.forward_depth > 0:
            return
        fed = self.window.forwards
        if torch.is_grad_enabled() and samples.trains(module) and self.backward_depth == 0:
            self.saw_forward(module, args, kwargs)
        self.window.forward_ended(fed=self.window.forwards > fed)
        if isinstance(output, torch.Tensor) and samples.readable(output):
            self.window.produced(output)

    def saw_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """An outermost training forward: its samples and its counted labels, where its
        input is data (not another module's output) the capture can read."""
        first = samples.first_tensor((args, kwargs), self.micro_batch)
        if (first is None or not samples.is_data(first) or not samples.readable(first)
                or self.window.is_activation(first)):
            return
        held = self.window.parameters_of(module)
        if not held:
            return
        self.window.forwarded(held, samples.samples_of(first, kwargs, self.micro_batch),
                              samples.labelled_count(kwargs))

    @never_raising
    def saw_loss_targets(self, target: Any, ignored: int) -> None:
        """A training loss's targets: the labels it counts (those not ``ignored``)."""
        if (self.recording and torch.is_grad_enabled() and not self.backward_depth
                and not torch.compiler.is_compiling()):
            count = samples.counted_targets(target, ignored)
            if count is not None:
                self.window.loss_counted(count, inside_forward=self.forward_depth > 0)

    @never_raising
    def saw_backward(self, tensors) -> None:
        """The type of each loss backpropagated and of every operation behind it (graph.py):
        a float32 loss of a float64 model rounds like float32, a layer cast to bfloat16 by
        hand like bfloat16, and the rows are judged at what they can round to."""
        if not self.recording or self.backward_depth:
            return
        roots = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors or ())
        for tensor in roots:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self.dtypes.add(str(tensor.dtype))
        self.dtypes |= graph_dtypes(roots)

    # ------------------------------------------------------------------ optimizers
    def tracked_by(self, key: frozenset[int]) -> Tracked | None:
        return next((tracked for tracked in self.tracked if tracked.key == key), None)

    def _tracked(self, optimizer: torch.optim.Optimizer, key: frozenset[int]) -> Tracked:
        """The optimizer's identity, named and its initial parameters kept at its first
        step (an optimizer re-created over the same parameters is the same one)."""
        tracked = self.tracked_by(key)
        if tracked is not None:
            return tracked
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        model = owner(parameters)
        groups = [g for g, group in enumerate(optimizer.param_groups) for _ in group["params"]]
        names = parameter_names(parameters, model, groups)
        if any(n.startswith("param_groups.") for n in names) and engines.engine_alive():
            raise Refused(engines.OUTSIDE_THE_ENGINE)
        return self.track(type(optimizer).__name__, key, parameters,
                           reader_for(optimizer, parameters, names), model,
                           self.constructed.get(optimizer, 0))

    def track(self, kind: str, key: frozenset[int], parameters: list[nn.Parameter],
               reader: Any, model: nn.Module | None, since: int) -> Tracked:
        """A new optimizer, its initial parameters written (by the reference's first run)."""
        tracked = Tracked(len(self.tracked), kind, key, parameters, reader, since)
        self.tracked.append(tracked)
        if model is not None:
            for name, found in naming.model_facts(model).items():
                self.facts[name] |= found
        specs, pieces, _ = tracked.read(parameters, "initial", self.rank)
        self.points.done(tracked.index, 0, "initial", specs, pieces, tracked.sharded)
        return tracked

    # ------------------------------------------------------------------ DeepSpeed
    def on_engine_step(self, engine: Any, step: Callable[[], Any]) -> Any:
        """DeepSpeed's boundary step (engines.py): one step of one optimizer, the engine's
        model read before and after it; the torch optimizer stepped inside it is inner."""
        self.step_depth += 1
        self.engine = engines.EngineStep(engine, engines.before_step(self, engine))
        try:
            result = step()
        finally:
            self.step_depth -= 1
            done, self.engine = self.engine, None
        if self.step_depth == 0 and done.tracked is not None:
            engines.after_step(self, done)
        return result

    # ------------------------------------------------------------------ the end
    def summary(self) -> wire.RankSummary:
        return wire.RankSummary(
            self.rank, self.world_size,
            sorted(name for name, module in wire.FRAMEWORK_MODULES.items()
                   if module in sys.modules),
            [tracked.summary() for tracked in self.tracked], list(self.records),
            sorted(self.dtypes), sorted(self.model_dtypes), sorted(self.unknown),
            sorted(self.facts["batchnorm"]), sorted(self.facts["dropout"]), socket.gethostname())

    def write_summary(self) -> None:
        """Once, where this process stepped an optimizer: a process that never did (a
        DataLoader worker, a launcher of the script) must not stand for the rank."""
        if self.written or not self.tracked:
            return
        self.written = True
        ending.write_final(self.summary(), self.folder, self.rank)

    def stop(self) -> None:
        """After step S: the summary, the other ranks', then the end of the process."""
        self.write_summary()
        self.exit(0 if ending.wait_for_every_summary(self.folder, self.rank, self.world_size,
                                                     self.steps, self.timeout) else 1)

    def record_line(self, line: str) -> None:
        ending.record_line(self.folder, self.rank, line)

    def refuse(self, line: str) -> None:
        self.record_line(line)
        self.exit(USAGE_EXIT)

    exit = staticmethod(ending.exit_now)
