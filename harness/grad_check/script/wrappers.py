"""The functions of torch the capture wraps, each to see one thing the global hooks do not:
an optimizer constructed, a backward running (and its loss's type), a clip or an unscale
about to edit the window's gradient (FSDP1's own ``clip_grad_norm_`` too, once its module
is imported: :func:`after_import`). Each wrapper calls the original with the same
arguments and returns what it returns."""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from harness.grad_check.script.events import CaptureEvents

#: The clips whose entry ends a window: the gradient is read before them.
CLIPS = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")


def wrap_construction(capture: CaptureEvents) -> None:
    """Every optimizer constructed, with the forward its first window starts at."""
    original = torch.optim.Optimizer.__init__

    @functools.wraps(original)
    def __init__(optimizer, *args, **kwargs):
        original(optimizer, *args, **kwargs)
        capture.on_construct(optimizer)

    torch.optim.Optimizer.__init__ = __init__


def reading_after_closure(args: tuple, kwargs: dict,
                          read: Callable[[], None]) -> tuple[tuple, dict] | None:
    """A step's arguments, with its closure (Lightning passes one that runs the last
    micro-step's backward and the clipping) made to ``read`` the gradients once it has
    run; None, after reading them now, where the step is given none."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: self
    if closure is None:
        read()
        return None
    called = []

    def closure_then_gradients():
        loss = closure()
        if not called:  # an optimizer that calls it again (LBFGS) moved on from there
            called.append(True)
            read()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_gradients}
    return (args[0], closure_then_gradients, *args[2:]), kwargs


def wrap_backward(capture: CaptureEvents) -> None:
    """A backward, to know its loss's type and that a forward inside it recomputes
    (activation checkpointing) rather than feeds new samples."""
    for name in ("backward", "grad"):
        original = getattr(torch.autograd, name)

        def during(*args, _original=original, **kwargs):
            with capture.on_backward(args[0] if args else kwargs.get(
                    "tensors", kwargs.get("outputs"))):
                return _original(*args, **kwargs)

        setattr(torch.autograd, name, functools.wraps(original)(during))


#: The losses whose integer targets say how many labels a loss averaged, with the position
#: of their ``ignore_index`` (torch.nn.functional's signatures; nn.CrossEntropyLoss and
#: NLLLoss call them).
LOSSES = {"cross_entropy": 4, "nll_loss": 4}


def wrap_losses(capture: CaptureEvents) -> None:
    """The labels each loss counts, where a script hands them to the loss rather than to
    the model (torchtune's and LitGPT's chunked cross-entropies, a loop's own loss): what
    a window of micro-batches of different token counts weighs by."""
    import torch.nn.functional as F  # noqa: N812

    for name, position in LOSSES.items():
        original = getattr(F, name)

        def counting(*args, _original=original, _position=position, **kwargs):
            target = args[1] if len(args) > 1 else kwargs.get("target")
            ignored = (args[_position] if len(args) > _position
                       else kwargs.get("ignore_index", -100))
            capture.saw_loss_targets(target, ignored)
            return _original(*args, **kwargs)

        setattr(F, name, functools.wraps(original)(counting))


def wrap_data_loading(capture: CaptureEvents) -> None:
    """The dataset indices of each batch a DataLoader hands the script, in the order it
    hands them: the sampler's draw, told apart from what loading made of it (a random
    augmentation gives the same indices other values). A multi-worker loader draws
    indices ahead of the batches it returns, in order (``in_order``), so each iterator
    keeps its drawn indices until the batch they are for comes out."""
    from collections import deque

    from torch.utils.data import dataloader

    kind = dataloader._BaseDataLoaderIter
    draw, reset, give = kind._next_index, kind._reset, kind.__next__

    def _next_index(iterator):
        indices = draw(iterator)
        iterator.__dict__.setdefault("_grad_check_drawn", deque()).append(indices)
        return indices

    def _reset(iterator, *args, **kwargs):
        iterator.__dict__["_grad_check_drawn"] = deque()  # a new epoch draws anew
        return reset(iterator, *args, **kwargs)

    def __next__(iterator):
        batch = give(iterator)
        drawn = iterator.__dict__.get("_grad_check_drawn")
        if drawn:
            capture.loaded(underlying(iterator._dataset, drawn.popleft()))
        return batch

    for name, function, original in (("_next_index", _next_index, draw),
                                     ("_reset", _reset, reset), ("__next__", __next__, give)):
        setattr(kind, name, functools.wraps(original)(function))


def underlying(dataset, indices):
    """The sampler's indices as the items of the dataset under any ``Subset``s (a script
    that gives each rank ``Subset(data, its share)`` draws 0..n-1 on every rank)."""
    from torch.utils.data import Subset

    while isinstance(dataset, Subset) and isinstance(indices, (list, tuple, int)):
        share = dataset.indices
        indices = (share[indices] if isinstance(indices, int)
                    else [share[index] for index in indices])
        dataset = dataset.dataset
    return indices


def wrap_clipping(capture: CaptureEvents) -> None:
    """The window's gradient is read on entry to the first clip, or once a GradScaler has
    unscaled it: what the loss made, before anything edits it."""
    from torch.nn.utils import clip_grad

    for name in CLIPS:
        original = getattr(clip_grad, name, None)
        if original is not None:
            wrapped = functools.wraps(original)(functools.partial(clipping, capture, name,
                                                                  original))
            setattr(clip_grad, name, wrapped)
            setattr(torch.nn.utils, name, wrapped)
    unscale = torch.amp.GradScaler.unscale_

    @functools.wraps(unscale)
    def unscale_(scaler, optimizer):
        result = unscale(scaler, optimizer)
        capture.before_editing(p for g in optimizer.param_groups for p in g["params"])
        return result

    torch.amp.GradScaler.unscale_ = unscale_
    after_import(capture, "torch.distributed.fsdp.fully_sharded_data_parallel",
                 lambda module: wrap_module_clip(capture, module.FullyShardedDataParallel))


def wrap_module_clip(capture: CaptureEvents, kind: type) -> None:
    """FSDP1's ``model.clip_grad_norm_(max_norm)``, which clips the shards itself."""
    original = kind.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(module, *args, **kwargs):
        return clipping(capture, "clip_grad_norm_",
                        lambda _held, *a, **k: original(module, *a, **k),
                        module.parameters(), *args, **kwargs)

    kind.clip_grad_norm_ = clip_grad_norm_


class _Patching(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds module ``name`` as the other finders do, and patches it once it has run."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch, self.loader = name, patch, None

    def find_spec(self, name, path, target=None):
        if name != self.name or self.loader is not None:
            return None
        for finder in sys.meta_path:
            spec = (finder.find_spec(name, path, target)
                    if finder is not self and hasattr(finder, "find_spec") else None)
            if spec is not None and spec.loader is not None:
                self.loader, spec.loader = spec.loader, self
                return spec
        return None

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        self.patch(module)


def after_import(capture: CaptureEvents, name: str, patch: Callable[[ModuleType], None]) -> None:
    """``patch(module)`` as soon as module ``name`` is imported (now, where it already is):
    a framework the script imports after the capture loaded. A patch that fails leaves
    the module as it is, and the capture says so (``unknown``)."""
    def guarded(module: ModuleType) -> None:
        try:
            patch(module)
        except Exception as error:  # noqa: BLE001 -- the user's import must go on
            capture.could_not(f"wrapping {name}: {type(error).__name__}: {error}")

    if name in sys.modules:
        guarded(sys.modules[name])
    else:
        sys.meta_path.insert(0, _Patching(name, guarded))


def clipping(capture: CaptureEvents, name: str, original, parameters, *args, **kwargs):
    """A clip of the script's: the window's gradient kept first (the outermost clip only:
    clip_grad_norm_ calls clip_grads_with_norm_). A clip that follows another in the same
    window (a script that clips every micro-step) keeps it again: the gradient judged is
    the one before the window's last clip, which every rank holds alike once DDP has
    reduced the last micro-step, not micro-step 0's local partial one."""
    held = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with capture.on_clip(clip_text(name, args, kwargs), held):
        return original(held, *args, **kwargs)


def clip_text(name: str, args: tuple, kwargs: dict) -> str:
    """``clip_grad_norm_(max_norm=1)``: the clip and its bound, as the script called it."""
    bound = {"clip_grad_norm_": "max_norm", "clip_grad_value_": "clip_value",
             "clip_grads_with_norm_": "max_norm"}[name]
    value = kwargs.get(bound, args[0] if args else None)
    with contextlib.suppress(TypeError, ValueError):
        value = f"{float(value):g}"
    return f"{name}({bound}={value})"


