"""An independent probe of a trainer's first optimizer step, in plain torch: nothing of the
harness is imported. On ``PYTHONPATH`` with ``TRAINER_PROBE_OUT`` set, every process of
the trainer records, until its first ``optimizer.step()``:

- the model (the first module with parameters called outside any other module's forward)
  as that forward found it (``initial``: float64 copies);
- every forward of that model, its tensor inputs (``forwards``: args and kwargs);
- every ``F.cross_entropy`` call's targets, with the forward they followed (``targets``);
- after every backward, the model's gradient accumulated so far (``backwards``);
- the gradient the step was handed (``grads``, by parameter name, float64), taken on entry
  to the first ``clip_grad_norm_`` where the trainer clips, else on entry to the step, else
  (a step that runs its closure) after it;
- the optimizer's class and each parameter group's hyperparameters (every number but its
  parameters: ``lr``, ``weight_decay``, ...) as the first step found them (``optimizer``,
  ``groups``), and that step's update (``updates``: per group, each of its parameters
  after the step minus before, float64);

then writes them, with the world size its process group (else ``WORLD_SIZE``) has, to
``rank<R>.pt`` in that folder (R its rank in the process group) and
ends the process (exit code 0).
tests/test_trainers_findings.py recomputes the big-batch gradient from these.
"""

import os

_OUT = os.environ.get("TRAINER_PROBE_OUT")
if _OUT:
    import torch
    import torch.nn.functional as F
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    _state = {"depth": 0, "model": None, "initial": None, "forwards": [], "targets": [],
              "backwards": [], "grads": None}

    def _tensors(value):
        """Tensors in ``value`` (nested lists, tuples, dicts), detached copies, same shape."""
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, list | tuple):
            return type(value)(_tensors(item) for item in value)
        if isinstance(value, dict):
            return {key: _tensors(item) for key, item in value.items()}
        return None

    _call = torch.nn.Module.__call__

    def _recorded_call(module, *args, **kwargs):
        """Every module call: the first outermost one (inside no other module's forward)
        under autograd is the model's; its calls are the trainer's forwards."""
        # A module without parameters (a torchvision transform, called on the loader's
        # images where it has no workers) is not the model, nor one on the meta device
        # (LitGPT counts its FLOPs on a meta copy).
        first = next(module.parameters(), None)
        if _state["depth"] == 0 and torch.is_grad_enabled() and _state["model"] is None \
                and first is not None and not first.is_meta:
            _state["model"] = module
            _state["initial"] = {name: tensor.detach().to(torch.float64).clone()
                                 for name, tensor in module.state_dict().items()
                                 if tensor.is_floating_point()}
        if _state["depth"] == 0 and module is _state["model"] and torch.is_grad_enabled():
            _state["forwards"].append({"args": _tensors(list(args)),
                                       "kwargs": _tensors(dict(kwargs))})
        _state["depth"] += 1
        try:
            return _call(module, *args, **kwargs)
        finally:
            _state["depth"] -= 1

    torch.nn.Module.__call__ = _recorded_call

    _cross_entropy = F.cross_entropy

    def _recorded_cross_entropy(input, target, *args, **kwargs):
        _state["targets"].append({"forward": len(_state["forwards"]) - 1,
                                  "target": target.detach().clone(),
                                  "ignore_index": kwargs.get("ignore_index", -100)})
        return _cross_entropy(input, target, *args, **kwargs)

    F.cross_entropy = _recorded_cross_entropy
    torch.nn.functional.cross_entropy = _recorded_cross_entropy

    def _take_grads():
        if _state["grads"] is None and _state["model"] is not None:
            _state["grads"] = {name: param.grad.detach().to(torch.float64).clone()
                               for name, param in _state["model"].named_parameters()
                               if param.grad is not None}

    _backward = torch.autograd.backward

    def _recorded_backward(*args, **kwargs):
        """Every backward (Tensor.backward calls this one), then the model's gradient as it
        accumulated so far: one snapshot per micro-step."""
        result = _backward(*args, **kwargs)
        if _state["model"] is not None and _state["grads"] is None:
            _state["backwards"].append({
                name: param.grad.detach().to(torch.float64).clone()
                for name, param in _state["model"].named_parameters()
                if param.grad is not None})
        return result

    torch.autograd.backward = _recorded_backward

    _clip = torch.nn.utils.clip_grad_norm_

    def _recorded_clip(*args, **kwargs):
        _take_grads()
        return _clip(*args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = _recorded_clip

    def _before_step(optimizer, args, kwargs):
        # A step given a closure (Lightning) runs its window's last backward inside it: the
        # gradient on entry lacks that micro-step (the step's post-hook takes it).
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is None and any(param.grad is not None for group in optimizer.param_groups
                                   for param in group["params"]):
            _take_grads()
        _state["optimizer"] = type(optimizer).__name__
        _state["groups"] = [{key: value for key, value in group.items() if key != "params"}
                            for group in optimizer.param_groups]
        _state["stepped"] = optimizer
        _state["before"] = [[param.detach().to(torch.float64).clone() for param in group["params"]]
                            for group in optimizer.param_groups]

    def _after_step(optimizer, args, kwargs):
        # A step given a closure (Lightning) runs the forward and backward inside it: the
        # gradient is there only now, as the step left it (it reads .grad, never writes it).
        _take_grads()
        # Lightning starts its other ranks itself, without RANK: ask the process group.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else int(os.environ.get("RANK", "0"))
        world = torch.distributed.get_world_size() if distributed else \
            int(os.environ.get("WORLD_SIZE", "1"))
        saved = {key: _state.get(key) for key in (
            "initial", "forwards", "targets", "backwards", "grads", "optimizer", "groups")}
        if optimizer is _state.get("stepped"):
            saved["updates"] = [
                [param.detach().to(torch.float64) - before
                 for param, before in zip(group["params"], befores, strict=True)]
                for group, befores in zip(optimizer.param_groups, _state["before"], strict=True)]
        saved["world_size"] = world
        torch.save(saved, os.path.join(_OUT, f"rank{rank}.pt"))
        os._exit(0)

    register_optimizer_step_pre_hook(_before_step)
    register_optimizer_step_post_hook(_after_step)
