"""The big-batch reference: the gradient of the loss on the whole global batch, then one
optimizer step, per step of the setup.

Without ``Setup.loss_terms`` every rank computes it itself, one backward on the whole
global batch (the ranks work at once, so it costs one big-batch step of wall time, not
N). With it the ranks share the work in chunks no larger than a micro-batch and exchange
their shares of the gradient (harness/check/chunked.py); either way every rank then
holds the whole gradient and steps its own reference optimizer. It is computed once per
step and shared by every case of the matrix, and each rank keeps only the tensors its
cases compare: at N = 2 half of the model, not all of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from harness.check import batches
from harness.check.chunked import (
    FORWARD_SEED,
    PROBE_SEED,
    Spread,
    chunked_backward,
    random_loss_message,
    seeded,
)
from harness.check.load import check_loss, check_optimizer, copy_of, prepared_model
from harness.check.setup import MicroStep, Setup, make_optimizer
from harness.check.step import WholeStep, not_finite
from harness.errors import UsageError
from harness.tolerances import close


@dataclass
class ReferenceStep:
    """What the big-batch reference held around one optimizer step, for the kept tensors."""

    #: The state (parameters and buffers) before the step: updates are measured from it.
    before: dict[str, torch.Tensor]
    #: ``param.grad`` right before ``optimizer.step()``; None where a parameter got none.
    grads: dict[str, torch.Tensor | None]
    #: Parameters and buffers right after the step.
    after: dict[str, torch.Tensor]
    #: The big-batch loss.
    loss: float
    #: Parameters the loss does not reach (no gradient in the reference), kept or not.
    unused: tuple[str, ...] = ()
    #: The first row (along dim 0) of each tensor kept in part; 0 for the others.
    first_rows: dict[str, int] = field(default_factory=dict)
    #: The floating type of the loss the user's function returned (float32 where it casts
    #: to float32 inside a float64 model): the precision the reference really had.
    loss_dtype: torch.dtype | None = None
    #: Whether the GradScaler skipped this step (a gradient not finite once unscaled).
    skipped: bool = False
    #: The learning rate of each parameter group as the step used it.
    lrs: tuple[float, ...] = ()


#: The part of a tensor a rank keeps of the reference: rows [first, stop) along dim 0
#: (its FSDP shards), or None for the whole tensor.
Rows = tuple[int, int] | None


def _part(tensor: torch.Tensor | None, rows: Rows, copy: bool) -> torch.Tensor | None:
    """The kept part of ``tensor``: the tensor itself (a copy if ``copy``), or a copy of
    its rows, so that the rest of it can be freed."""
    if tensor is None:
        return None
    tensor = tensor.detach()
    if rows is None:
        return tensor.clone() if copy else tensor
    return tensor[rows[0]:rows[1]].clone()


def state_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the trainable parameters and of the buffers, in module order."""
    params = [name for name, p in model.named_parameters() if p.requires_grad]
    buffers = [name for name, _ in model.named_buffers()]
    return params, buffers


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name. Not ``state_dict()``: it leaves out
    non-persistent buffers (a rotary embedding's ``inv_freq``), which a forward still reads
    and may change."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _probe_randomness(setup: Setup, model: nn.Module, window, loss: float, rtol: float,
                      target: str) -> None:
    """One more forward of the same batch under another seed; a different loss means the
    model or the loss draws random numbers in training mode: refused (see load.py)."""
    kept = {name: b.detach().clone() for name, b in model.named_buffers()}
    with torch.no_grad(), seeded(PROBE_SEED):
        again = float(setup.loss(model, window))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(kept[name])
    if not close(again, loss, rtol):
        raise UsageError(random_loss_message(target, loss, again))


def compute_reference(setup: Setup, dtype: torch.dtype, device: torch.device,
                      used_samples: tuple[int, ...] | None, rtol: float, target: str, *,
                      initial: nn.Module | None = None,
                      keeps: Mapping[str, Rows] | None = None,
                      spread: Spread | None = None) -> list[ReferenceStep]:
    """Every step of the reference on the first ``used_samples[step]`` of each global
    batch (all of them when None), from a copy of ``initial`` (left untouched: step 0's
    ``before`` is its tensors) or else from a model of its own; only the tensors (and
    rows) ``keeps`` names are kept, every tensor whole without it. With ``spread``, the
    gradient is computed in chunks of ``Setup.loss_terms`` spread over its ranks, which
    must all call this together (it raises NotChunked on every rank where the chunks do
    not add up to the big batch)."""
    model, optimizer, whole = _reference_training(setup, dtype, device, target, initial)
    param_names, buffer_names = state_names(model)
    if keeps is None:
        keeps = dict.fromkeys(named_state(model))
    kept_params = [name for name in param_names if name in keeps]
    kept_state = [*kept_params, *(name for name in buffer_names if name in keeps)]
    first_rows = {name: rows[0] for name, rows in keeps.items() if rows is not None}
    params = dict(model.named_parameters())
    steps = []
    for step in range(setup.steps):
        window = window_of(setup, step, used_samples, dtype, device)
        source, copy = (initial, False) if step == 0 and initial is not None else (model, True)
        state = named_state(source)
        before = {name: _part(state[name], keeps[name], copy) for name in state if name in keeps}
        if spread is None:
            loss_tensor = _loss_backward(setup, model, whole, window, target)
            loss, loss_dtype = float(loss_tensor.detach()), loss_tensor.dtype
        else:
            loss, loss_dtype = chunked_backward(setup, model, whole, window, spread, target,
                                                step, probing=step == 0)
        _refuse_not_finite(loss, whole, [params[name] for name in param_names], step, target)
        if step == 0 and spread is None:
            with whole.forward():
                _probe_randomness(setup, model, window, loss, rtol, target)
        unused = tuple(name for name in param_names if params[name].grad is None)
        whole.before_step(MicroStep(0, 1, 1, batches.sample_count(window, "batch"), window))
        # Copies, not the gradient tensors: an optimizer may edit .grad in place while it
        # steps (clipping in a step pre-hook, unscaling), which would rewrite the reference.
        grads = {name: _part(params[name].grad, keeps[name], copy=True) for name in kept_params}
        skipped = whole.skips(params[name].grad for name in param_names)
        lrs = tuple(float(group["lr"]) for group in optimizer.param_groups)
        whole.step()
        last = step == setup.steps - 1
        state = named_state(model)
        after = {name: _part(state[name], keeps[name], copy=not last) for name in kept_state}
        optimizer.zero_grad(set_to_none=True)
        steps.append(ReferenceStep(before, grads, after, loss, unused, first_rows,
                                   loss_dtype=loss_dtype, skipped=skipped, lrs=lrs))
    return steps


def _reference_training(setup: Setup, dtype: torch.dtype, device: torch.device, target: str,
                        initial: nn.Module | None
                        ) -> tuple[nn.Module, torch.optim.Optimizer, WholeStep]:
    """The reference's model (a copy of ``initial``, else one of its own), its optimizer
    over the trainable parameters, and the step that drives both."""
    model = (copy_of(initial, setup, dtype, device) if initial is not None
             else prepared_model(setup, dtype, device, target))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(setup, trainable)
    check_optimizer(optimizer, trainable, target)
    return model, optimizer, WholeStep(setup, model, optimizer, device)


def _loss_backward(setup: Setup, model: nn.Module, whole: WholeStep, window,
                   target: str) -> torch.Tensor:
    """The big-batch loss, its forward under a fixed seed (and the caller's random state
    left as it was), and its backward."""
    with seeded(FORWARD_SEED), whole.forward():
        loss = setup.loss(model, window)
    check_loss(loss, target)
    whole.backward(loss)
    return loss


def _refuse_not_finite(loss: float, whole: WholeStep, params: list[nn.Parameter],
                       step: int, target: str) -> None:
    """A non-finite loss or gradient has no equal to compare with: refused."""
    # Under a GradScaler a scaled gradient may overflow: the scaler skips that step.
    if not math.isfinite(loss) or (whole.scaler is None and any(
            not_finite(param.grad) for param in params)):
        raise UsageError(f"{target}: the loss (or gradient) is not finite in step {step} "
                         f"of the big-batch reference (loss {loss:.6g}); "
                         "allowed: a loss and gradients finite on every global batch")


def window_of(setup: Setup, step: int, used_samples: tuple[int, ...] | None,
              dtype: torch.dtype, device: torch.device):
    """Global batch ``step``, cut to ``used_samples[step]`` (--drop-last), in dtype, on
    device."""
    batch = setup.batch(step)
    if used_samples is not None:
        batch = batches.take(batch, 0, used_samples[step])
    return batches.prepared(batch, dtype, device)
