"""The frameworks study's capture: the gradient is read before ``optimizer.step()``.

Plain SGD never writes ``.grad``, so it cannot tell a read before the step from
one after it. These optimizers edit ``.grad`` inside ``step()``, as unscaling and
clipping do: only a capture taken before the step sees what the framework handed
the optimizer.
"""

import torch

from harness.adapters.step_capture import (
    StepCapture,
    parameter_grads,
    parameter_values,
    watch_step,
)

#: What the optimizers below multiply ``.grad`` by inside ``step()``.
EDIT = 0.25


class EditingSGD(torch.optim.SGD):
    """SGD that scales ``.grad`` in place before updating, as an unscaling step does."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                param.grad.mul_(EDIT)
        return super().step(closure)


def model_with_gradient() -> tuple[torch.nn.Module, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    x = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    handed = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
    return model, handed


def captured(optimizer_of) -> tuple[StepCapture, torch.Tensor, torch.Tensor]:
    model, handed = model_with_gradient()
    optimizer = optimizer_of(model)
    capture = StepCapture()
    watch_step(optimizer, capture, parameter_grads(model), parameter_values(model))
    optimizer.step()
    return capture, handed, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_an_optimizer_that_edits_grad_in_step_is_captured_before_the_edit():
    capture, handed, after = captured(lambda model: EditingSGD(model.parameters(), lr=0.1))
    (step,) = capture.steps
    assert torch.equal(step.grad, handed)
    assert not torch.allclose(step.grad, handed * EDIT)
    assert torch.equal(step.params, after)
    assert step.lrs == (0.1,)


def test_a_clipping_step_pre_hook_is_captured_before_it_clips():
    def clip(optimizer, _args, _kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, max_norm=1e-3)

    def clipping_sgd(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.register_step_pre_hook(clip)
        return optimizer

    capture, handed, _ = captured(clipping_sgd)
    assert float(handed.norm()) > 1e-2, "the hook really clips this gradient"
    assert torch.equal(capture.steps[0].grad, handed)


def test_a_closure_runs_before_the_gradient_is_read():
    model = torch.nn.Linear(3, 1).double()
    optimizer = EditingSGD(model.parameters(), lr=0.1)
    capture = StepCapture()
    watch_step(optimizer, capture, parameter_grads(model), parameter_values(model))
    x = torch.ones(2, 3, dtype=torch.float64)

    def closure():
        optimizer.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    # d(sum of Wx + b)/dW = the column sums of x (2 each), /db = the batch size (2).
    assert capture.steps[0].grad.tolist() == [2.0, 2.0, 2.0, 2.0]
