"""The CPU emulation of DataParallel follows DataParallel's dataflow, step by step."""

import copy

import pytest
import torch

from harness.seeding import generator_for
from harness.strategies import dp_emulated
from harness.strategies.common import StepSpec, flat_grad
from harness.strategies.dp_emulated import EmulatedDataParallel
from harness.strategies.local import local_gradient, per_device_gradients, running_stats_after
from harness.tasks import Batch, LossInForward, make_shards, task_by_name

DTYPE = torch.float64
TOL = 1e-12


def setup(task_name: str, batch: int):
    task = task_by_name(task_name)
    generator = generator_for(0, "test", task_name, batch)
    model = task.build_model(generator, DTYPE)
    return task, model, Batch.cat(make_shards(task, [batch], generator, DTYPE))


@pytest.mark.parametrize("batch, replicas, chunks", [
    (8, 4, (2, 2, 2, 2)), (5, 4, (2, 2, 1)), (7, 3, (3, 3, 1)), (3, 4, (1, 1, 1)),
    (6, 4, (2, 2, 2)), (1, 2, (1,)),
])
def test_scatter_uses_torch_chunk_sizes_and_may_leave_devices_idle(batch, replicas, chunks):
    task, model, data = setup("mlp", batch)
    spec = StepSpec(task=task, model=model, shards=[data], reduction="mean")
    measurement = dp_emulated.measure_step(spec, replicas, torch.device("cpu"))
    assert measurement.chunk_sizes == chunks
    assert measurement.devices_used == len(chunks)


@pytest.mark.parametrize("batch, replicas", [(8, 4), (5, 4), (7, 3), (6, 2)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_replica_gradients_are_summed_into_the_original(batch, replicas, reduction):
    """Even with an uneven last chunk, the sum over replicas is the big-batch gradient."""
    task, model, data = setup("toy", batch)
    spec = StepSpec(task=task, model=model, shards=[data], reduction=reduction)
    m = dp_emulated.measure_step(spec, replicas, torch.device("cpu"))
    chunks = data.split(m.chunk_sizes)
    full = local_gradient(task, model, chunks, reduction)
    assert torch.allclose(m.grads[0], full, rtol=TOL, atol=TOL)
    assert torch.allclose(torch.stack(m.contributions).sum(0), m.grads[0], rtol=TOL, atol=TOL)
    if reduction == "sum":
        # each replica's contribution is then its own chunk's gradient
        for contribution, own in zip(m.contributions,
                                     per_device_gradients(task, model, chunks, "sum"),
                                     strict=True):
            assert torch.allclose(contribution, own, rtol=TOL, atol=TOL)


def test_uneven_chunks_weight_replicas_by_their_sample_count():
    """With a mean loss a replica contributes (its samples / B) times its own mean gradient."""
    task, model, data = setup("toy", 5)
    spec = StepSpec(task=task, model=model, shards=[data], reduction="mean")
    m = dp_emulated.measure_step(spec, 4, torch.device("cpu"))
    chunks = data.split(m.chunk_sizes)
    own = per_device_gradients(task, model, chunks, "mean")
    for size, contribution, g in zip(m.chunk_sizes, m.contributions, own, strict=True):
        assert torch.allclose(contribution, g * size / 5, rtol=TOL, atol=TOL)


def test_batchnorm_running_statistics_come_from_replica_0_only():
    task, model, data = setup("mlp-batchnorm", 8)
    wrapper = EmulatedDataParallel(copy.deepcopy(model), 4)
    with torch.no_grad():
        wrapper(data.x)
    first_chunk = running_stats_after(model, data.chunk(4)[:1])
    full = running_stats_after(model, [data])
    for name in ("norm.running_mean", "norm.running_var"):
        assert torch.equal(wrapper.module.get_buffer(name), first_chunk[name])
        assert not torch.allclose(wrapper.module.get_buffer(name), full[name])
    assert int(wrapper.module.get_buffer("norm.num_batches_tracked")) == 1


def test_loss_in_forward_gathers_one_loss_per_replica():
    task, model, data = setup("mlp", 6)
    wrapper = EmulatedDataParallel(LossInForward(copy.deepcopy(model), task), 3)
    losses = wrapper(data.x, data.y)
    assert losses.shape == (3,)
    chunk_losses = [task.loss(model(c.x), c, "mean") for c in data.chunk(3)]
    assert torch.allclose(losses, torch.stack(chunk_losses), rtol=TOL)


def test_one_device_calls_the_module_directly():
    task, model, data = setup("toy", 4)
    wrapper = EmulatedDataParallel(copy.deepcopy(model), 1)
    task.loss(wrapper(data.x), data, "mean").backward()
    assert wrapper.last_contributions == []
    assert torch.allclose(flat_grad(wrapper.module), local_gradient(task, model, [data], "mean"))
