"""What ``grad-check run`` runs inside each of the user's processes, before their script.

``startup/sitecustomize.py`` installs a :class:`Capture` when :data:`FOLDER_VARIABLE`
names a folder; the user's code is not changed. Through torch's global hooks it sees:

- every ``optimizer.step()`` (``register_optimizer_step_pre_hook`` / ``_post_hook``):
  the gradients as the optimizer receives them (after the loop's clipping and
  unscaling), and the parameters after the step, for the first S steps. Names come
  from the innermost module that holds the optimizer's parameters (a DDP, compile or
  Lightning wrapper around it adds nothing to them); FSDP2's DTensors are gathered
  whole. Rank 0 writes the tensors, one file per step and point, so that at most one
  copy of the gradients is held at a time; every rank writes a fingerprint of them, so
  that ranks that disagree show;
- every outermost call of a module with parameters (a model, not a loss module) with
  autograd on (``register_module_forward_pre_hook`` and a forward hook given the
  keyword arguments): a fingerprint of each sample, row
  by row, of its first tensor argument (the tokens its ``attention_mask`` keeps, where
  it has one: padding differs between splits, samples do not), and the tokens its
  ``labels`` count (those not -100);
- every ``backward``: the loss's type.

After step S every rank writes its summary, waits for the others' (so that none is
still inside a collective of step S), and the process ends with exit code 0
(``--keep-going``: the script goes on; the summary is written at exit). A setup that
cannot be captured is refused by name, exit code 2, with one line for the launcher.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import hashlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
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

from harness.check.compare import sampled_fingerprint
from harness.check.fix import batchnorm_tensors
from harness.errors import USAGE_EXIT, error_file
from harness.grad_check.script.guard import failing_line

#: The folder a run's captures go to; the capture is installed only where it is set.
FOLDER_VARIABLE = "GRAD_CHECK_CAPTURE"
#: Optimizer steps to capture (S).
STEPS_VARIABLE = "GRAD_CHECK_STEPS"
#: "1": let the script run to its end after step S.
KEEP_GOING_VARIABLE = "GRAD_CHECK_KEEP_GOING"
#: Seconds a rank waits at step S for the other ranks' summaries.
TIMEOUT_VARIABLE = "GRAD_CHECK_TIMEOUT"
#: Module attributes that wrappers put between a model and its parameters' names.
WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
#: Labels of this value are not counted (cross-entropy's default ``ignore_index``).
IGNORE_INDEX = -100
#: Seconds between looks for the other ranks' summaries.
POLL_S = 0.01


def summary_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.pt"


def tensors_file(folder: Path, step: int, point: str) -> Path:
    """Rank 0's tensors: ``initial`` (the parameters before step 0), or step's ``grad``
    or ``params``."""
    return folder / (f"{point}.pt" if point == "initial" else f"step{step}.{point}.pt")


class Refused(Exception):
    """A setup the capture cannot read: the message says which and what is allowed."""


def save_atomically(value: Any, path: Path) -> None:
    """``torch.save`` under a temporary name, then renamed: a reader never sees half."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(value, temporary)
    os.replace(temporary, path)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP2 (DTensor) shard, gathered from every rank (a collective:
    every rank calls it, in the same order); any other tensor as it is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def stripped(name: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def owner(parameters: list[nn.Parameter]) -> nn.Module | None:
    """The model the optimizer's parameters belong to, the same however it is wrapped: of
    the live modules that hold all of them, the outermost, then, while it wraps a single
    child that holds them all too (DDP's ``module``, torch.compile's ``_orig_mod``, a
    framework's wrapper, a LightningModule around its one network), that child. Where no
    module holds them all, the one that holds the most. Found once, among every module
    alive: the optimizer knows its tensors, not their module."""
    wanted = {id(p) for p in parameters}
    parents: dict[int, list[nn.Module]] = {}
    found: list[nn.Module] = []
    # type(), not isinstance(): a deprecated object of torch answers isinstance with a warning.
    for module in (o for o in gc.get_objects() if issubclass(type(o), nn.Module)):
        for child in module._modules.values():
            if child is not None:
                parents.setdefault(id(child), []).append(module)
        if any(p is not None and id(p) in wanted for p in module._parameters.values()):
            found.append(module)
    held: dict[int, int] = {}  # every holder and its ancestors: how many they hold
    by_id: dict[int, nn.Module] = {}
    while found:
        module = found.pop()
        if id(module) not in held:
            held[id(module)] = len(wanted & {id(p) for p in module.parameters()})
            by_id[id(module)] = module
            found += parents.get(id(module), [])
    if not held:
        return None
    whole = {key for key, count in held.items() if count == len(wanted)}
    if not whole:
        return by_id[max(held, key=lambda key: (held[key], type(by_id[key]).__name__))]
    outermost = [by_id[key] for key in whole
                 if not any(id(parent) in whole for parent in parents.get(key, []))]
    models = {id(model): model for model in (unwrapped(m, whole) for m in outermost)}
    return min(models.values(), key=lambda model: (sum(1 for _ in model.parameters()),
                                                   type(model).__name__))


def unwrapped(module: nn.Module, whole: set[int]) -> nn.Module:
    """``module``'s single child, and so on, for as long as that child holds them all."""
    while True:
        children = [child for child in module._modules.values() if child is not None]
        if len(children) != 1 or id(children[0]) not in whole:
            return module
        module = children[0]


def sample_rows(first: torch.Tensor, mask: torch.Tensor | None) -> Iterator[torch.Tensor]:
    """Each sample of ``first`` (its rows), only the positions ``mask`` keeps where given."""
    rows = first.detach().cpu()
    rows = rows.reshape(1) if rows.dim() == 0 else rows
    kept = mask.detach().cpu().bool() if mask is not None else None
    for i in range(rows.shape[0]):
        yield rows[i][kept[i]] if kept is not None else rows[i]


def row_fingerprint(row: torch.Tensor) -> str:
    data = row.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value``, depth first through tuples, lists and dicts (a
    framework's wrapper may be called with the whole batch, ``[x, y]``)."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value
    if isinstance(items, (tuple, list)) or isinstance(value, dict):
        for item in items:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def matching_mask(first: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """The call's ``attention_mask`` where it masks ``first`` position by position."""
    mask = kwargs.get("attention_mask")
    if (isinstance(mask, torch.Tensor) and first.dim() >= 2 and mask.dim() == 2
            and tuple(mask.shape) == tuple(first.shape[:2])):
        return mask
    return None


class Capture:
    """The capture of one process: rank ``RANK`` of ``WORLD_SIZE`` (0 of 1 without them)."""

    def __init__(self, folder: Path, steps: int, keep_going: bool, timeout: float) -> None:
        self.folder, self.steps, self.keep_going, self.timeout = (folder, steps, keep_going,
                                                                  timeout)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        #: Optimizer steps finished, counted at the outermost step (a wrapper's step that
        #: calls the wrapped optimizer's counts once).
        self.done = 0
        self.step_depth = 0
        self.forward_depth = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.parameters: list[nn.Parameter] = []
        self.names: list[str] = []
        self.facts: dict[str, Any] = {}
        self.dtypes: set[str] = set()
        self.records: list[dict[str, Any]] = []
        self.current = self._fresh_record()
        self.written = False

    # ------------------------------------------------------------------ hooks
    def install(self) -> None:
        register_optimizer_step_pre_hook(self.before_step)
        register_optimizer_step_post_hook(self.after_step)
        register_module_forward_pre_hook(self.entering_module)
        register_module_forward_hook(self.leaving_module, with_kwargs=True, always_call=True)
        original_backward = torch.autograd.backward

        def backward(tensors, *args, **kwargs):
            self.saw_backward(tensors)
            return original_backward(tensors, *args, **kwargs)

        # Tensor.backward() calls torch.autograd.backward too.
        torch.autograd.backward = backward
        original_hook = sys.excepthook

        def excepthook(kind, error, traceback):
            self.record_line(failing_line(error, traceback))  # with the failing file:line
            original_hook(kind, error, traceback)

        sys.excepthook = excepthook
        atexit.register(self.write_summary)

    @property
    def recording(self) -> bool:
        return self.done < self.steps

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple,
                    kwargs: dict) -> tuple[tuple, dict] | None:
        """Before the outermost step: the gradients, or, where the step is given a closure
        (Lightning passes one that runs the last micro-step's backward and the clipping),
        a closure that reads them once it has run."""
        self.step_depth += 1
        if self.step_depth > 1 or not self.recording:
            return None
        try:
            if self.optimizer is None:
                self._first_step(optimizer)
            elif optimizer is not self.optimizer:
                raise Refused(f"the script steps two optimizers ({type(self.optimizer).__name__}"
                              f" and {type(optimizer).__name__}); allowed: scripts that step "
                              "one optimizer")
        except Refused as refusal:
            self.refuse(str(refusal))
        # args[0] is the optimizer itself, args[1] a positional closure.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.read_gradients()
            return None
        called = []

        def closure_then_gradients():
            loss = closure()
            if not called:  # an optimizer that calls it again (LBFGS) moved on from there
                called.append(True)
                self.read_gradients()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_gradients}
        return (args[0], closure_then_gradients, *args[2:]), kwargs

    def read_gradients(self) -> None:
        """The gradients the optimizer receives: fingerprinted, and written by rank 0."""
        grads = [p.grad for p in self.parameters]
        self.dtypes.update(str(p.dtype) for p in self.parameters)
        self.dtypes.update(str(g.dtype) for g in grads if g is not None)
        gathered = {name: None if g is None else whole(g).detach()
                    for name, g in zip(self.names, grads, strict=True)}
        self.current["grad_fingerprint"] = sampled_fingerprint(gathered.values())
        if self.rank == 0:
            save_atomically(gathered, tensors_file(self.folder, self.done, "grad"))

    def after_step(self, optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
        self.step_depth -= 1
        if self.step_depth > 0 or not self.recording or optimizer is not self.optimizer:
            return
        params = self._parameters_now()
        self.current["params_fingerprint"] = sampled_fingerprint(params.values())
        if self.rank == 0:
            save_atomically(params, tensors_file(self.folder, self.done, "params"))
        self.records.append(self.current)
        self.current = self._fresh_record()
        self.done += 1
        if self.done == self.steps and not self.keep_going:
            self.stop()

    def entering_module(self, _module: nn.Module, _args) -> None:
        self.forward_depth += 1

    def leaving_module(self, module: nn.Module, args: tuple, kwargs: dict, _result) -> None:
        self.forward_depth -= 1
        # A model, not a loss module (nn.MSELoss holds no parameters): its first argument
        # is the model's output, whose rounding depends on the batch it came from.
        if (self.forward_depth == 0 and self.recording and torch.is_grad_enabled()
                and next(module.parameters(), None) is not None):
            self.saw_batch(args, kwargs)

    def saw_batch(self, args: tuple, kwargs: dict) -> None:
        """An outermost training forward: its samples, its counted labels, autocast."""
        first = first_tensor((args, kwargs))
        if first is not None:
            self.current["samples"] += [row_fingerprint(row) for row in
                                        sample_rows(first, matching_mask(first, kwargs))]
        labels = kwargs.get("labels")
        if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
            self.current["counts"].append(int((labels != IGNORE_INDEX).sum()))
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                self.dtypes.add(str(torch.get_autocast_dtype(device)))

    def saw_backward(self, tensors) -> None:
        """The type of each loss backpropagated: a float32 loss of a float64 model rounds
        like float32, and its rows are judged at float32's tolerance."""
        if not self.recording:
            return
        for tensor in (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self.dtypes.add(str(tensor.dtype))

    # ------------------------------------------------------------------ steps
    def _first_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Name the optimizer's parameters, refuse what cannot be read, keep the initial
        parameters."""
        self.optimizer = optimizer
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        refuse_flat_parameters(self.parameters)
        model = owner(self.parameters)
        by_id = ({id(p): stripped(name) for name, p in model.named_parameters()}
                 if model is not None else {})
        if len(by_id.keys() & {id(p) for p in self.parameters}) < len(self.parameters):
            refuse_moduleless_parameters()
        self.names = [by_id.get(id(p), f"param_groups.{g}.{i}")
                      for g, group in enumerate(optimizer.param_groups)
                      for i, p in enumerate(group["params"])]
        # What a fix is read from besides the tensors (harness/check/fix.py: Facts).
        self.facts = {
            "batchnorm": sorted(stripped(n) for n in batchnorm_tensors(model)) if model else [],
            "dropout": [stripped(name) for name, module in (model.named_modules() if model
                                                            else ())
                        if isinstance(module, nn.modules.dropout._DropoutNd)
                        and module.p > 0 and module.training],
        }
        initial = self._parameters_now()
        if self.rank == 0:
            save_atomically(initial, tensors_file(self.folder, 0, "initial"))

    def _parameters_now(self) -> dict[str, torch.Tensor]:
        return {name: whole(p).detach() for name, p in zip(self.names, self.parameters,
                                                           strict=True)}

    @staticmethod
    def _fresh_record() -> dict[str, Any]:
        return {"samples": [], "counts": [], "grad_fingerprint": None,
                "params_fingerprint": None}

    # ------------------------------------------------------------------ the end
    def summary(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "steps": self.done,
                "records": self.records, "names": self.names, "dtypes": sorted(self.dtypes),
                **self.facts}

    def write_summary(self) -> None:
        """Once, where this process stepped an optimizer: a process that never did (a
        DataLoader worker, a launcher of the script) must not stand for the rank."""
        if self.written or self.optimizer is None:
            return
        self.written = True
        save_atomically(self.summary(), summary_file(self.folder, self.rank))

    def stop(self) -> None:
        """After step S: the summary, the other ranks', then the end of the process (no
        collective of step S is still running anywhere once every summary exists)."""
        self.write_summary()
        deadline = time.monotonic() + self.timeout
        while not all(summary_file(self.folder, r).exists() for r in range(self.world_size)):
            if time.monotonic() > deadline:
                self.record_line(f"rank {self.rank} waited {self.timeout:g} s at step "
                                 f"{self.steps} for the other ranks' captures")
                self.exit(1)
            time.sleep(POLL_S)
        self.exit(0)

    def record_line(self, line: str) -> None:
        """The rank's one line for the launcher (the first one recorded is kept)."""
        path = error_file(self.folder, self.rank)
        with contextlib.suppress(OSError):
            if not path.exists():
                path.write_text(line + "\n")

    def refuse(self, line: str) -> None:
        self.record_line(line)
        self.exit(USAGE_EXIT)

    @staticmethod
    def exit(code: int) -> None:
        """End the process now: the script's own teardown (a process group, DataLoader
        workers, a framework's callbacks) would run collectives that other ranks, already
        gone, no longer answer."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def refuse_flat_parameters(parameters: Iterable[nn.Parameter]) -> None:
    if any(type(p).__name__ == "FlatParameter" for p in parameters):
        raise Refused("FullyShardedDataParallel (FSDP1) hands the optimizer flat parameters, "
                      "pieces of many tensors, which are not captured; allowed: FSDP2 "
                      "(torch.distributed.fsdp.fully_shard), whose parameters are gathered, "
                      "DDP, or one process")


def refuse_moduleless_parameters() -> None:
    """Parameters no module holds: positions name them, except DeepSpeed's flat copies,
    which differ from one split to the next."""
    if "deepspeed" in sys.modules:
        raise Refused("DeepSpeed hands the optimizer flat fp32 copies of the parameters "
                      "(ZeRO partitions, or bf16/fp16 master weights), which belong to no "
                      "module and are not captured; allowed: ZeRO stage 0 in float32")


def install_from_environment() -> Capture | None:
    """The capture this process's environment asks for (None where it asks for none)."""
    global INSTALLED
    folder = os.environ.get(FOLDER_VARIABLE)
    if not folder or INSTALLED is not None:
        return INSTALLED
    INSTALLED = Capture(Path(folder), int(os.environ.get(STEPS_VARIABLE, "2")),
                        os.environ.get(KEEP_GOING_VARIABLE) == "1",
                        float(os.environ.get(TIMEOUT_VARIABLE, "300")))
    INSTALLED.install()
    return INSTALLED


#: The capture installed in this process, if any.
INSTALLED: Capture | None = None
