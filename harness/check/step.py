"""What a real step does around ``optimizer.step()``: autocast, a GradScaler, the user's
``before_step`` (clipping) and an LR scheduler, done the same way by the big-batch
reference and by every case, so that the comparison covers the step people run.

Nothing here makes a pass over the parameters of its own: the scaler's unscale and the
user's clip are the passes the step itself makes.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from harness.check.setup import MicroStep, Setup
from harness.errors import UsageError


def run_dtype(setup: Setup, dtype: torch.dtype) -> torch.dtype:
    """The model's floating type: float32 under autocast, which never casts float64
    tensors (a float64 model under autocast would run in float64 and test nothing)."""
    return torch.float32 if setup.autocast is not None and dtype == torch.float64 else dtype


def not_finite(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` holds a NaN or an infinity. A NaN compares unequal to everything,
    so without this test it reads as randomness or as a split that differs."""
    if tensor is None or tensor.numel() == 0:
        return False
    # Its smallest and largest elements, which a NaN makes NaN and an infinity infinite:
    # a reduction that allocates nothing the tensor's size (torch.isfinite allocates a
    # mask of it, and faulting in those pages costs more than the reduction on a large
    # model: 20x on a 2-core VM).
    low, high = torch.aminmax(tensor.detach())
    return not bool(torch.isfinite(low) & torch.isfinite(high))


def check_step_device(setup: Setup, target: str, device: torch.device) -> None:
    """Refuse what the device cannot run, before any rank starts. Asked of the device
    itself: a torch that cannot autocast to a type on a device, or scale there, warns
    and runs without it, which would check a step other than the one described."""
    if setup.autocast is not None and not _autocasts(device, setup.autocast):
        name = str(setup.autocast).removeprefix("torch.")
        raise UsageError(f"{target}: Setup.autocast=torch.{name} does not run on {device} "
                         f"with torch {torch.__version__}; allowed there: torch.bfloat16 or "
                         "None")
    if setup.grad_scaler and not _scales(device):
        raise UsageError(f"{target}: Setup.grad_scaler=True does not run on {device} with "
                         f"torch {torch.__version__}; allowed there: grad_scaler=False")


def _autocasts(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a matmul under ``torch.autocast(device, dtype)`` computes in ``dtype``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the refusal says it instead
            with torch.autocast(device.type, dtype=dtype):
                ones = torch.ones(2, 2, device=device)
                return (ones @ ones).dtype == dtype
    except (RuntimeError, ValueError):
        return False


def _scales(device: torch.device) -> bool:
    """Whether a GradScaler on ``device`` is enabled (it disables itself, with a warning,
    where it cannot run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.amp.GradScaler(device.type).is_enabled()


#: Functions that edit gradients, which a loop calls once per window: (module, attribute,
#: what the fix calls it). clip_grad_norm_ calls ``_clip_grads_with_norm_`` through its
#: module, so that one is seen however the user imported clip_grad_norm_.
GRADIENT_EDITS = (
    (torch.nn.utils.clip_grad, "_clip_grads_with_norm_", "clip_grad_norm_"),
    (torch.nn.utils, "clip_grad_value_", "clip_grad_value_"),
    (torch.nn.utils.clip_grad, "clip_grad_value_", "clip_grad_value_"),
    (torch.amp.GradScaler, "scale", "GradScaler"),
    (torch.amp.GradScaler, "unscale_", "GradScaler"),
    # Not a gradient edit, but a loop's once-per-step call all the same.
    (torch.optim.lr_scheduler.LRScheduler, "step", "an LR scheduler's step()"),
)


#: The sets the active watches record into, innermost last.
_WATCHES: list[set[str]] = []


@functools.cache
def _recording(function: Any, name: str) -> Any:
    """``function``, recording ``name`` into the innermost watch: built once per function,
    so that a watch per micro-step costs a few attribute swaps."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        if _WATCHES:
            _WATCHES[-1].add(name)
        return function(*args, **kwargs)
    return call


@contextlib.contextmanager
def watching_gradient_edits(seen: set[str]) -> Iterator[None]:
    """While active, a call of any of :data:`GRADIENT_EDITS` adds its name to ``seen``
    (the call itself runs unchanged)."""
    originals = [(owner, attribute, getattr(owner, attribute, None))
                 for owner, attribute, _ in GRADIENT_EDITS]
    _WATCHES.append(seen)
    try:
        for (owner, attribute, original), (_, _, name) in zip(originals, GRADIENT_EDITS,
                                                              strict=True):
            if original is not None:
                setattr(owner, attribute, _recording(original, name))
        yield
    finally:
        for owner, attribute, original in originals:
            if original is not None:
                setattr(owner, attribute, original)
        _WATCHES.pop()


class WholeStep:
    """One model's step: its forwards under autocast, its backwards through the scaler,
    then unscale, ``before_step``, the optimizer step (skipped by the scaler on a
    non-finite gradient) and the scheduler's step."""

    def __init__(self, setup: Setup, module: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        self.setup, self.module, self.optimizer, self.device = setup, module, optimizer, device
        self.scheduler: Any = (setup.make_scheduler(optimizer)
                               if setup.make_scheduler is not None else None)
        self.scaler = torch.amp.GradScaler(device.type) if setup.grad_scaler else None
        #: Floating types of the losses backpropagated so far: a loss computed in float32
        #: (e.g. logits cast with ``.float()``) rounds like float32 whatever the model's type.
        self.loss_dtypes: set[torch.dtype] = set()
        #: Gradient edits (a clip, a scaler) the user's forward code made: a loop makes
        #: them once per window, after the backward passes, never inside a micro-step.
        self.edits_in_forward: set[str] = set()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around the user's loss or micro_step: autocast, and a watch for edits."""
        autocast = (torch.autocast(self.device.type, dtype=self.setup.autocast)
                    if self.setup.autocast is not None else contextlib.nullcontext())
        with autocast, watching_gradient_edits(self.edits_in_forward):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        self.loss_dtypes.add(loss.dtype)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def before_step(self, where: MicroStep) -> None:
        """After the window's last backward: the gradients the user's code sees unscaled."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.setup.before_step is not None:
            self.setup.before_step(self.module, self.optimizer, where)

    def skips(self, grads: Iterable[torch.Tensor | None]) -> bool:
        """After :meth:`before_step`: whether the GradScaler will skip this step, as it
        does where a gradient, unscaled, is not finite (never without a scaler)."""
        return self.scaler is not None and any(map(not_finite, grads))

    def step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
