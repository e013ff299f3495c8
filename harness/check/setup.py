"""What a user hands the harness to check their own training step: a :class:`Setup`.

``make_setup()`` in the user's module returns one. The harness builds the model
once on every rank (the single-process reference and each case start from copies
of it), takes global
batch ``i`` from ``batch(i)``, splits it along the first dimension of every
tensor the way each strategy would (ranks x micro-steps), runs the user's loss
on each piece, and compares ``param.grad`` before the step and the parameters
after it with one process stepping once on the whole global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: A batch: a tensor, or a tuple/list/dict of tensors (and of anything else, passed as
#: is) whose tensors share their first dimension, the sample dimension that is split.
Batch = Any
#: ``loss(model, batch) -> scalar tensor``: the user's loss on a (micro-)batch,
#: computed the way their training loop computes it (mean over the micro-batch, a
#: token-level mean, ...).
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
#: ``loss_terms(model, batch) -> (sum, count)``: the user's loss on a (micro-)batch as the
#: sum of its terms (a scalar tensor with a graph) and how many terms there are (samples,
#: or tokens that are not ignored: a number or a scalar tensor), so that ``loss`` is
#: ``sum / count`` and the loss of a big batch is its pieces' sums over their counts.
LossTermsFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, Any]]
#: ``make_optimizer(params) -> torch.optim.Optimizer``.
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class MicroStep:
    """Where a micro-step sits: handed to a custom ``micro_step`` function."""

    #: Index of the micro-step in the accumulation window, 0..accum_steps-1.
    index: int
    #: Micro-steps per optimizer step (k).
    accum_steps: int
    #: Ranks (devices) the global batch is split across (N).
    world_size: int
    #: Samples in the whole global batch (N x k micro-batches).
    global_batch_size: int
    #: The whole global batch of this optimizer step (every rank's every micro-batch),
    #: already cast and placed like the micro-batch: what a real loop learns by
    #: all-reducing its counts, e.g. the window's token count. None where not known.
    window: Any = None


#: ``micro_step(model, micro_batch, where) -> loss tensor`` on which the harness calls
#: ``backward()``: the user's own recipe (e.g. dividing by k, or normalizing by the
#: window's token count). Without one the harness backpropagates ``loss(...) / k``.
MicroStepFn = Callable[[nn.Module, Batch, MicroStep], torch.Tensor]
#: ``before_step(model, optimizer, where) -> None``: what the loop does between the
#: window's last backward and ``optimizer.step()`` (e.g. ``clip_grad_norm_``). ``model``
#: is the module the loss was called on (DDP's or FSDP's wrapper, whose ``parameters()``
#: hold the reduced, under FSDP sharded, gradients); ``where`` is the window's last
#: micro-step.
BeforeStepFn = Callable[[nn.Module, torch.optim.Optimizer, MicroStep], None]
#: ``make_scheduler(optimizer) -> LR scheduler``, stepped right after every optimizer step.
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
#: Floating types ``Setup.autocast`` accepts (both run on CPU and CUDA; the check asks the
#: device before any rank starts: harness/check/step.py).
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Plain SGD: the update is then ``-lr * grad``, so a gradient error shows unchanged."""
    return torch.optim.SGD(params, lr=0.1)


def make_optimizer(setup: Setup, params) -> torch.optim.Optimizer:
    """The setup's optimizer over ``params`` (plain SGD without one)."""
    return (setup.make_optimizer or default_optimizer)(params)


@dataclass(frozen=True)
class Setup:
    """One user training step, as functions the harness can call on any rank.

    ``make_model`` must build the same initial weights on every rank (seed inside
    it): each rank builds one model, and its reference and cases start from copies.
    """

    #: () -> nn.Module, identical weights on every rank.
    make_model: Callable[[], nn.Module]
    #: i -> global batch i (the whole big batch of optimizer step i).
    batch: Callable[[int], Batch]
    #: The loss on a (micro-)batch: see :data:`LossFn`.
    loss: LossFn
    #: params -> optimizer; plain SGD(lr=0.1) when None.
    make_optimizer: OptimizerFactory | None = None
    #: A custom micro-step (see :data:`MicroStepFn`); None: ``loss / k``.
    micro_step: MicroStepFn | None = None
    #: Optimizer steps compared (each on its own global batch).
    steps: int = 1
    #: A name for the rows and the console table; the factory's name when empty.
    name: str = ""
    #: Keyword arguments for DistributedDataParallel under the ``ddp`` strategy (e.g.
    #: ``{"find_unused_parameters": True}``), so that a fix can be checked as it will run.
    ddp_options: dict[str, Any] = field(default_factory=dict)
    #: Between the window's backward passes and the optimizer step, in the reference and
    #: in every case alike (see :data:`BeforeStepFn`): clip here, once per window.
    before_step: BeforeStepFn | None = None
    #: optimizer -> LR scheduler, stepped after each optimizer step; None: constant lr.
    make_scheduler: SchedulerFactory | None = None
    #: ``torch.autocast`` dtype of every forward (the loss or micro_step): torch.bfloat16
    #: or torch.float16; None: no autocast. The model then runs in float32
    #: (autocast leaves float64 alone), and rows are judged at the autocast's precision.
    autocast: torch.dtype | None = None
    #: Scale the loss with a ``torch.amp.GradScaler`` (on the check's device, for float16):
    #: unscaled before ``before_step``, its step skipped on a non-finite gradient.
    grad_scaler: bool = False
    #: The loss as summed terms and their count (see :data:`LossTermsFn`); None: unknown.
    #: With it the big-batch reference is spread over the ranks in chunks no larger than a
    #: micro-batch (each rank holds one chunk's activations, not the global batch's),
    #: exactly: the big batch's loss is the chunks' summed terms over their summed counts.
    loss_terms: LossTermsFn | None = None

    def __post_init__(self) -> None:
        for name in ("make_model", "batch", "loss"):
            if not callable(getattr(self, name)):
                raise TypeError(f"Setup.{name} must be callable, got "
                                f"{type(getattr(self, name)).__name__}")
        for name in ("make_optimizer", "micro_step", "loss_terms"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"Setup.{name} must be callable or None, got "
                                f"{type(value).__name__}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"Setup.steps must be an integer >= 1, got {self.steps!r}")
        if not isinstance(self.ddp_options, dict):
            raise TypeError("Setup.ddp_options must be a dict of DistributedDataParallel "
                            f"keyword arguments, got {type(self.ddp_options).__name__}")
        _check_whole_step(self)


def _check_whole_step(setup: Setup) -> None:
    """The fields of what a step does around ``optimizer.step()``, each of its own type."""
    for name in ("before_step", "make_scheduler"):
        value = getattr(setup, name)
        if value is not None and not callable(value):
            raise TypeError(f"Setup.{name}={value!r} is a {type(value).__name__}; allowed: a "
                            "function, or None")
    if setup.autocast is not None and setup.autocast not in AUTOCAST_DTYPES:
        raise TypeError(f"Setup.autocast={setup.autocast!r} is not allowed; allowed: "
                        "torch.bfloat16, torch.float16, or None")
    if not isinstance(setup.grad_scaler, bool):
        raise TypeError(f"Setup.grad_scaler={setup.grad_scaler!r} is a "
                        f"{type(setup.grad_scaler).__name__}; allowed: True or False")
