"""Finding the user's ``make_setup`` and refusing what cannot be checked fairly.

Everything here runs before any rank starts (``--nproc``) and again in every rank,
so bad input is one line and exit code 2 whichever way the check was launched.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness.check import batches
from harness.check.chunked import checked_terms, inconsistency_message, not_chunkable
from harness.check.precision import lowest
from harness.check.setup import Setup, make_optimizer
from harness.errors import UsageError
from harness.tolerances import check_tolerance, close

#: Modules whose training-mode forward draws random numbers. A big batch and its pieces
#: draw different masks whatever the seed, so no comparison of them can be fair: refused.
RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                  nn.FeatureAlphaDropout)


def _import(module_name: str, target: str) -> Any:
    # The working directory first, as `python -m` would: users name their own modules.
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 -- any import failure is the user's bad input
        last = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        where = f" ({Path(last.filename).name}:{last.lineno})" if last else ""
        raise UsageError(f"{target}: module {module_name!r} does not import: "
                         f"{type(error).__name__}: {error}{where}; allowed: a module importable "
                         "from the current folder or the Python path") from None


def called(function, what: str) -> Any:
    """``function()``, its failure one line of bad input. SystemExit too: a factory that
    calls sys.exit() (a missing file, a failed argument parse) otherwise ends the check
    silently with the factory's code."""
    try:
        return function()
    except (Exception, SystemExit) as error:  # noqa: BLE001 -- the user's code failing
        # An error that already names what is allowed (a Setup field of the wrong type)
        # says it once.
        allowed = "" if "allowed:" in str(error) else ("; allowed: code that runs on this "
                                                        "machine as it is")
        raise UsageError(f"{what} failed: {type(error).__name__}: {error}{allowed}") from None


def load_setup(target: str) -> Setup:
    """Call ``module:factory`` and return its Setup, named after the factory if unnamed."""
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise UsageError(f"{target!r} is not module.path:factory; e.g. examples.mlp:make_setup")
    module = _import(module_name, target)
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise UsageError(f"{target}: module {module_name!r} has no {factory_name!r}; allowed: "
                         "a function in it that returns a harness.check.Setup")
    if not callable(factory):
        raise UsageError(f"{target}: {factory_name!r} is a {type(factory).__name__}, not a "
                         "function; allowed: a function that returns a harness.check.Setup")
    setup = called(factory, f"{target}: calling {factory_name}()")
    if not isinstance(setup, Setup):
        raise UsageError(f"{target}: {factory_name}() returned a {type(setup).__name__}, not "
                         "a harness.check.Setup; allowed: Setup(make_model=..., batch=..., "
                         "loss=...)")
    if not setup.name:
        from dataclasses import replace

        setup = replace(setup, name=factory_name)
    return setup


def check_model(model: Any, target: str) -> None:
    """A module, on the CPU or a CUDA device, with no training-mode randomness."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"{target}: make_model() returned a {type(model).__name__}; allowed: "
                         "a torch.nn.Module")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type not in ("cpu", "cuda"):
            raise UsageError(f"{target}: make_model() put {name!r} on {tensor.device}; allowed: "
                             "the CPU or a CUDA device (each rank moves its copy to its own "
                             "device)")
    for name, module in model.named_modules():
        if isinstance(module, RANDOM_MODULES) and module.p > 0:
            raise UsageError(
                f"{target}: module {name or 'model'!r} is {type(module).__name__}(p="
                f"{module.p}), random in training mode: a big batch and its pieces draw "
                "different masks, so no comparison is fair; allowed: models without "
                "train-mode randomness (set p=0, or build the model without dropout)")
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(f"{target}: make_model() has no trainable parameter; allowed: a "
                         "model with parameters that require gradients")


def check_batches(setup: Setup, target: str, splits: list[tuple[int, int]],
                  drop_last: bool) -> None:
    """Every global batch holds tensors that split into every N x k of the matrix."""
    for step in range(setup.steps):
        where = f"{target}: batch({step})"
        try:
            batch = setup.batch(step)
        except Exception as error:  # noqa: BLE001
            raise UsageError(f"{where} failed: {type(error).__name__}: {error}") from None
        samples = batches.sample_count(batch, where)
        for world_size, accum_steps in splits:
            batches.pieces_needed(samples, world_size, accum_steps, drop_last, where)


def check_one_piece(setup: Setup, model: nn.Module, target: str, pieces: int,
                    dtype: torch.dtype, say: Callable[[str], None]) -> None:
    """The loss on the first of ``pieces`` pieces of batch(0), and the optimizer over the
    model's trainable parameters, checked before any rank starts: otherwise a loss of
    the wrong type or an optimizer the check cannot step fails every case at once as
    "rank N failed". (The ranks check the reference's loss and optimizer the same way.)
    What the check casts, and a loss that computes in a lower precision, are said."""
    batch = setup.batch(0)
    piece = batches.take(batch, 0, max(1, batches.sample_count(batch, "batch(0)") // pieces))
    _say_casts(model, piece, dtype, target, say)
    _check_precision(setup, model, piece, dtype, target, say)
    model = model.to(dtype=dtype)
    piece = batches.prepared(piece, dtype, torch.device("cpu"))
    loss = called(lambda: setup.loss(model, piece), f"{target}: loss(model, piece)")
    check_loss(loss, target)
    if setup.loss_terms is not None:
        check_loss_terms(setup, model, piece, loss, target, say)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = called(lambda: make_optimizer(setup, trainable), f"{target}: make_optimizer()")
    check_optimizer(optimizer, trainable, target)
    check_scheduler(setup, trainable, target)


def _say_casts(model: nn.Module, piece: Any, dtype: torch.dtype, target: str,
               say: Callable[[str], None]) -> None:
    """Name the casts that change what is computed: from bfloat16 or float16 (the model is
    then checked in the run's type, not the precision it trains in), or down to a type of
    fewer bits. float32 to the default float64 is the check's own rule, not said."""
    for what, tensors in (("make_model()", [*model.parameters(), *model.buffers()]),
                          ("batch(0)", batches.tensors_of(piece))):
        cast = sorted({str(t.dtype).removeprefix("torch.") for t in tensors
                       if t.is_floating_point() and t.dtype != dtype
                       and (t.dtype in LOW_PRECISION or t.dtype.itemsize > dtype.itemsize)})
        if cast:
            say(f"{target}: {what} gives {', '.join(cast)} tensors, cast to "
                f"{str(dtype).removeprefix('torch.')} (--dtype) for the check")


#: Floating types whose rounding (bfloat16: 2**-8 ~ 4e-3) is above every check tolerance.
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _check_precision(setup: Setup, model: nn.Module, piece: Any, dtype: torch.dtype,
                     target: str, say: Callable[[str], None]) -> None:
    """Whether the model's modules output bfloat16 or float16 when the model and the batch
    are float32 (autocast on the CPU casts float32, never float64): their rounding would
    read as a split that differs at float32; at float64 autocast casts nothing."""
    seen: set[torch.dtype] = set()

    def record(_module, _inputs, output) -> None:
        seen.update(t.dtype for t in batches.tensors_of(output) if t.dtype in LOW_PRECISION)

    probe = copy.deepcopy(model).to(dtype=torch.float32)
    hooks = [module.register_forward_hook(record) for module in probe.modules()]
    try:
        with torch.no_grad():
            called(lambda: setup.loss(probe, batches.prepared(piece, torch.float32,
                                                              torch.device("cpu"))),
                   f"{target}: loss(model, piece)")
    finally:
        for hook in hooks:
            hook.remove()
    if not seen:
        return
    low = ", ".join(sorted(str(d).removeprefix("torch.") for d in seen))
    if dtype != torch.float64:
        raise UsageError(f"{target}: the model computes in {low} when given float32 (autocast?): "
                         f"its rounding (~4e-3) is above the float32 tolerance, so the check "
                         "would blame it on the split; allowed: --dtype float64 (autocast then "
                         "casts nothing and the rows judge the recipe's arithmetic)")
    say(f"{target}: the model computes in {low} when given float32 (autocast?); at float64 "
        "autocast casts nothing: the rows judge the recipe's arithmetic, not that rounding")


def check_loss_terms(setup: Setup, model: nn.Module, piece: Any, loss: torch.Tensor,
                     target: str, say: Callable[[str], None]) -> None:
    """``loss_terms`` on the piece ``loss`` was computed on: its sum over its count must be
    that loss, within the tolerance of the lowest precision either was computed in (a
    count of 0 leaves nothing to compare). Where the model's modules alone show that no
    chunks can add up to the big batch, the whole-batch reference runs: said."""
    total, count = checked_terms(called(lambda: setup.loss_terms(model, piece),
                                        f"{target}: loss_terms(model, piece)"), target)
    precision = lowest([next(model.parameters()).dtype, loss.dtype, total.dtype])
    mean, expected = float(total.detach()) / count if count else 0.0, float(loss.detach())
    if count and not close(mean, expected, check_tolerance(precision)):
        raise UsageError(inconsistency_message(target, mean, expected, precision))
    reason = not_chunkable(model)
    if reason is not None:
        say(f"{target}: Setup.loss_terms cannot spread the big-batch reference: {reason}; "
            "every rank computes it on the whole global batch")


def check_loss(loss: Any, target: str) -> None:
    """A scalar tensor with a graph to backpropagate."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return
    if isinstance(loss, torch.Tensor):
        shown = f"a tensor of shape {tuple(loss.shape)}" + (
            "" if loss.requires_grad else " that requires no gradient")
    else:
        shown = f"a {type(loss).__name__}"
    raise UsageError(f"{target}: loss(model, batch) returned {shown}; allowed: a scalar "
                     "tensor computed from the model's output (backward() runs on it)")


def check_optimizer(optimizer: Any, trainable: list[nn.Parameter], target: str) -> None:
    """A torch optimizer whose step() needs no closure, over exactly the parameters given."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"{target}: make_optimizer() returned a {type(optimizer).__name__}; "
                         "allowed: a torch.optim.Optimizer")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise UsageError(f"{target}: {type(optimizer).__name__}.step() needs a closure (it "
                         "re-evaluates the loss), which no training step of pieces can give; "
                         "allowed: optimizers whose step() takes no argument (SGD, Adam, ...)")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    given = {id(p) for p in trainable}
    if held != given:
        raise UsageError(f"{target}: make_optimizer(params) holds {len(held - given)} tensor(s) "
                         f"that are not the model's and misses {len(given - held)} of its "
                         f"{len(given)} trainable parameter(s) (an optimizer over another "
                         "model's parameters?); allowed: an optimizer over the params it is "
                         "given")


def check_scheduler(setup: Setup, trainable: list[nn.Parameter], target: str) -> None:
    """A scheduler whose step() takes no argument: the check steps it after every
    optimizer step, as a loop does, and has no metric to give it (a loss would differ from
    case to case, and from the big batch's)."""
    if setup.make_scheduler is None:
        return
    optimizer = called(lambda: make_optimizer(setup, trainable), f"{target}: make_optimizer()")
    scheduler = called(lambda: setup.make_scheduler(optimizer), f"{target}: make_scheduler()")
    allowed = ("allowed: a scheduler whose step() takes no argument (LambdaLR, StepLR, "
               "CosineAnnealingLR, OneCycleLR, ...), or make_scheduler=None")
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise UsageError(f"{target}: make_scheduler() returned a {type(scheduler).__name__}, "
                         f"which has no step(); {allowed}")
    needed = [name for name, parameter in inspect.signature(step).parameters.items()
              if parameter.default is inspect.Parameter.empty
              and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                         inspect.Parameter.VAR_KEYWORD)]
    if needed:
        raise UsageError(f"{target}: make_scheduler() returned a {type(scheduler).__name__}, "
                         f"whose step() needs {', '.join(map(repr, needed))}, which the check "
                         f"cannot give (it steps the scheduler after every optimizer step); "
                         f"{allowed}")


def validated_setup(target: str, splits: list[tuple[int, int]], drop_last: bool,
                    dtype: torch.dtype, *, batches_too: bool = True, piece_too: bool = True,
                    say: Callable[[str], None] = lambda _: None) -> Setup:
    """The Setup behind ``target``, with its batches checked (``batches_too``) and one
    piece of a model of its own trained (``piece_too``: a model more, which the ranks
    spare themselves: their reference checks its own loss and optimizer), notices handed
    to ``say``. Each model the ranks build is checked as it is built:
    :func:`prepared_model`."""
    setup = load_setup(target)
    if batches_too:
        check_batches(setup, target, splits, drop_last)
    if piece_too:
        pieces = max(n * k for n, k in splits)
        check_one_piece(setup, built_model(setup, target), target, pieces, dtype, say)
    return setup


def built_model(setup: Setup, target: str = "make_model") -> nn.Module:
    """``make_model()``, checked; its failure (a missing checkpoint, a device this machine
    lacks) one line of bad input."""
    model = called(setup.make_model, f"{target}: make_model()")
    check_model(model, target)
    return model


def prepared_model(setup: Setup, dtype: torch.dtype, device: torch.device,
                   target: str = "make_model") -> nn.Module:
    """A fresh, checked model in the run's dtype (floating tensors only) on its device."""
    return built_model(setup, target).to(device=device, dtype=dtype)


def copy_of(template: nn.Module, setup: Setup, dtype: torch.dtype,
            device: torch.device) -> nn.Module:
    """A model at ``template``'s state, without building and initialising one more (a
    100M-parameter ``make_model`` spends seconds drawing weights it would overwrite).
    A model that cannot be deep-copied is built anew and loaded with the template's state."""
    try:
        return copy.deepcopy(template)
    except Exception:  # noqa: BLE001 -- any module deepcopy refuses: the slower way
        model = setup.make_model().to(device=device, dtype=dtype)
        model.load_state_dict(template.state_dict())
        return model


def validated_setups(targets: Sequence[str], splits: list[tuple[int, int]], drop_last: bool,
                     dtype: torch.dtype, *, batches_too: bool = True, piece_too: bool = True,
                     say: Callable[[str], None] = lambda _: None) -> list[tuple[str, Setup]]:
    """Each target's :func:`validated_setup`, said as it loads (a factory may load for
    minutes: the user sees what is being waited for); their names tell their rows
    apart, so must differ."""
    setups = []
    for target in targets:
        say(f"loading {target}")
        setups.append((target, validated_setup(target, splits, drop_last, dtype,
                                               batches_too=batches_too, piece_too=piece_too,
                                               say=say)))
    names = [setup.name for _, setup in setups]
    for name in names:
        if names.count(name) > 1:
            raise UsageError(f"two targets give setups named {name!r}; allowed: setups with "
                             "different names (Setup.name), each target once")
    return setups
