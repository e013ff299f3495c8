"""DDP and DataParallel (emulated) at k = 1..4 against first principles.

One run of the real command line on 4 forked ranks (gloo, FileStore) produces
reduction.csv and seed001.csv; every test below reads what that run measured (the
run of tests/distributed.py's ``committed_layout_run``, which tests/test_compare.py
reads too).
"""

import pandas as pd
import pytest
import torch

from harness.tolerances import relative_tolerance
from tests.distributed import COMMITTED_LAYOUT_RUN, committed_layout_run
from tests.frames import rows
from tests.scheduling import launching

RTOL = relative_tolerance(torch.float64)
WORLD = 4


@pytest.fixture(scope="module")
@launching(seconds=6)
def results(tmp_path_factory):
    assert COMMITTED_LAYOUT_RUN[1] == WORLD
    out = committed_layout_run(tmp_path_factory)
    return {name: pd.read_csv(out / f"{name}.csv") for name in ("reduction", "seed001")}


@pytest.fixture(scope="module")
def reduction(results):
    return results["reduction"]




def approx(value):
    return pytest.approx(value, rel=RTOL, abs=RTOL)


SMOOTH_MODELS = ["toy", "mlp"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("model", SMOOTH_MODELS)
def test_ddp_and_fsdp_average_and_a_summed_loss_is_k_times_too_small(reduction, strategy, k,
                                                                      model):
    for loss, scale in [("mean", 1.0), ("sum", 1.0 / k)]:
        row = rows(reduction, strategy=strategy, world_size=k, model=model,
                   loss_reduction=loss).iloc[0]
        assert row.rank_weight == approx(1.0 / k)
        assert row.full_batch_scale == approx(scale)
        assert row.reduce_weight == approx(1.0 / k)
        assert row.fit_residual < RTOL
        assert row.verdict == ("sum=mean" if k == 1 else "mean")
        assert row.reduce_op == ("sum=mean" if k == 1 else "mean")
        assert row.rank_spread == 0.0, "every rank must hold the same param.grad"
        assert row.shard_sizes == ";".join(["4"] * k)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("model", SMOOTH_MODELS)
def test_dataparallel_sums_replica_gradients_of_the_gathered_loss(reduction, k, model):
    for loss, weight in [("mean", 1.0 / k), ("sum", 1.0)]:
        row = rows(reduction, strategy="dp-emulated", world_size=k, model=model,
                   loss_reduction=loss).iloc[0]
        assert row.reduce_weight == approx(1.0), "replica gradients are summed"
        assert row.rank_weight == approx(weight)
        assert row.full_batch_scale == approx(1.0), "equals the big-batch gradient"
        assert row.fit_residual < RTOL
        assert bool(row.emulated)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_loss_returned_by_forward_mean_vs_sum_of_the_per_device_vector(reduction, k):
    mean = rows(reduction, strategy="dp-emulated", world_size=k, model="loss-in-forward",
                loss_reduction="mean").iloc[0]
    summed = rows(reduction, strategy="dp-emulated", world_size=k, model="loss-in-forward",
                  loss_reduction="sum").iloc[0]
    assert mean.full_batch_scale == approx(1.0)
    assert summed.full_batch_scale == approx(float(k)), "sum of k per-device means: k times"
    assert summed.verdict == "sum" and mean.verdict == "mean"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "dp-emulated"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_batchnorm_breaks_big_batch_equivalence_and_keeps_first_device_statistics(
        reduction, strategy, k):
    row = rows(reduction, strategy=strategy, world_size=k, model="mlp-batchnorm",
               loss_reduction="mean").iloc[0]
    assert row.full_batch_residual > 1e-3, "per-device batch statistics are not the big batch's"
    assert row.rank_weight_residual < RTOL, "yet each device's own gradient is reduced exactly"
    assert row.running_stats_vs_first_shard == 0.0
    assert row.running_stats_vs_full > 1e-3


def test_batchnorm_on_one_device_is_the_big_batch(reduction):
    row = rows(reduction, strategy="ddp", world_size=1, model="mlp-batchnorm",
               loss_reduction="mean").iloc[0]
    assert row.fit_residual < RTOL and row.running_stats_vs_full == 0.0


def test_real_dataparallel_rows_say_why_they_are_skipped_without_gpus(reduction):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the dp rows are measured, not skipped")
    dp = rows(reduction, strategy="dp")
    assert len(dp) == 4 * 4 * 2
    assert dp.status.str.startswith("skipped: needs ").all()
    assert (rows(dp, world_size=2).status == "skipped: needs 2 CUDA devices, has 0").all()


def test_schema_and_context(reduction):
    required = ["study", "strategy", "backend", "device", "dtype", "world_size",
                "loss_reduction", "model", "shard_sizes", "rank_weight", "full_batch_scale",
                "fit_residual", "verdict", "status"]
    assert set(required) <= set(reduction.columns)
    ok = rows(reduction, status="ok")
    assert (ok.backend == "gloo").all() and (ok.device == "cpu").all()
    assert (ok.dtype == "float64").all() and (ok.launch_world_size == WORLD).all()
    assert reduction.case_id.is_unique


# ----------------------------------------------------------------- seed 001
@pytest.fixture(scope="module")
def seed001(results):
    return results["seed001"]


def test_every_seed001_measurement_matches_its_prediction(seed001):
    ok = rows(seed001, status="ok")
    assert len(ok) == 3 * 4 * 2 * (1 + 1 + 3), "dp-emulated, ddp and fsdp; k = 1..4; 2 losses"
    assert ok.matches.all()
    assert (ok.abs_error < RTOL).all()
    assert (ok.measured_grad_spread < RTOL).all(), "every entry of w.grad is the same number"


@pytest.mark.parametrize("k, expected", [(1, 1.0), (2, 1.5), (3, 1.5), (4, 1.5)])
def test_seed001_dataparallel_with_device_factor(seed001, k, expected):
    """Two samples: beyond 2 devices DataParallel leaves the rest idle, so 1.5 stays."""
    row = rows(seed001, strategy="dp-emulated", experiment="1-per-device-factor",
               world_size=k, loss_reduction="mean").iloc[0]
    assert row.measured_grad == approx(expected)
    assert row.devices_used == min(k, 2)
    if k >= 2:
        assert row.device_contributions == "0.5;1", "replicas send 0.5 and 1, summed to 1.5"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_seed001_ddp_and_fsdp_average_the_rank_factors(seed001, strategy, k):
    row = rows(seed001, strategy=strategy, experiment="1-per-device-factor", world_size=k,
               loss_reduction="mean").iloc[0]
    assert row.measured_grad == approx((k + 1) / 2)


def test_seed001_without_zero_grad_the_gradient_grows_linearly(seed001):
    exp3 = rows(seed001, experiment="3-no-zero-grad", status="ok")
    for _, group in exp3.groupby(["strategy", "world_size", "loss_reduction"]):
        first = group[group.iteration == 1].measured_grad.iloc[0]
        for t in (2, 3):
            assert group[group.iteration == t].measured_grad.iloc[0] == approx(t * first)
