"""Real DataParallel on the GPUs present, against the CPU emulation (skipped without CUDA)."""

import pytest
import torch

from harness.seeding import generator_for
from harness.strategies import dp, dp_emulated
from harness.strategies.common import StepSpec
from harness.tasks import Batch, LossInForward, make_shards, task_by_name

pytestmark = pytest.mark.cuda
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_cuda = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")


def spec_for(task_name: str, batch: int, reduction: str, loss_in_forward: bool = False):
    task = task_by_name(task_name)
    generator = generator_for(0, "cuda-test", task_name, batch)
    model = task.build_model(generator, torch.float64)
    data = Batch.cat(make_shards(task, [batch], generator, torch.float64))
    if loss_in_forward:
        model = LossInForward(model, task)
    return StepSpec(task=task, model=model, shards=[data], reduction=reduction,
                    loss_in_forward=loss_in_forward)


@needs_cuda
@pytest.mark.parametrize("task_name", ["toy", "mlp", "mlp-batchnorm"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [8, 5])
def test_real_dataparallel_equals_the_emulation(task_name, reduction, batch):
    for k in range(1, GPUS + 1):
        spec = spec_for(task_name, batch, reduction)
        real = dp.measure_step(spec, k)
        emulated = dp_emulated.measure_step(spec, k, torch.device("cpu"))
        assert real.chunk_sizes == emulated.chunk_sizes
        assert torch.allclose(real.grads[0], emulated.grads[0], rtol=1e-10, atol=1e-12)
        for a, b in zip(real.contributions, emulated.contributions, strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
        for name, buffer in emulated.buffers.items():
            assert torch.allclose(real.buffers[name], buffer, rtol=1e-10, atol=1e-12)


@needs_cuda
def test_real_dataparallel_loss_in_forward_equals_the_emulation():
    for k in range(1, GPUS + 1):
        for reduction in ("mean", "sum"):
            spec = spec_for("mlp", 6, reduction, loss_in_forward=True)
            real = dp.measure_step(spec, k)
            emulated = dp_emulated.measure_step(spec, k, torch.device("cpu"))
            assert torch.allclose(real.grads[0], emulated.grads[0], rtol=1e-10, atol=1e-12)
