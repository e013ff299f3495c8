"""Accumulation recipes against first principles, measured by the real study on 3 ranks.

World sizes 1 and 3 and k in {1, 3} keep it quick while covering a world size
and an accumulation count that are not powers of two.
"""

import pandas as pd
import pytest
import torch

from harness.studies.accumulation.recipes import matrix
from harness.studies.accumulation.study import WINDOWS
from harness.tolerances import relative_tolerance
from tests.distributed import run_cli
from tests.frames import rows as select
from tests.scheduling import launching

RTOL = relative_tolerance(torch.float64)
WORLD = 3
STEPS = (1, 3)


@pytest.fixture(scope="module")
@launching(seconds=5)
def frame(tmp_path_factory):
    out = tmp_path_factory.mktemp("accumulation")
    codes = run_cli(WORLD, ["--studies", "accumulation", "--world-sizes", "1,3",
                            "--accum-steps", ",".join(map(str, STEPS)),
                            "--strategies", "local,ddp,dp-emulated", "--out", str(out),
                            "--quiet", "--no-report"], store_dir=out.parent)
    assert codes == [0] * WORLD
    return pd.read_csv(out / "accumulation.csv")




PLAIN = dict(norm="none", shards="even", loss_normalization="micro-batch-mean", status="ok")


def test_every_case_of_the_default_matrix_has_a_row(frame):
    expected = sum(len(matrix(s, w, k, full=False)) for s, sizes in
                   [("local", [1]), ("ddp", [1, 3]), ("dp-emulated", [1, 3])]
                   for w in sizes for k in STEPS)
    assert len(frame) == expected
    assert frame.case_id.is_unique


def test_loss_over_k_and_zeroing_every_step_equals_the_big_batch(frame):
    rows = select(frame, zero_grad="every-step", loss_scaling="1/k", **PLAIN)
    assert (rows.verdict == "matches").all()
    assert (rows.full_batch_scale - 1).abs().max() < RTOL
    assert rows.relative_error.max() < RTOL


def test_without_loss_scaling_the_gradient_is_k_times_the_big_batch(frame):
    rows = select(frame, zero_grad="every-step", loss_scaling="none", **PLAIN)
    assert rows.full_batch_scale.to_numpy() == pytest.approx(rows.accum_steps.to_numpy(),
                                                             rel=RTOL)
    assert set(rows.verdict) == {"scaled", "matches"}  # k = 1 is both
    assert (rows[rows.accum_steps == 1].verdict == "matches").all()


def test_never_zeroed_gradient_is_the_sum_of_every_window_so_far(frame):
    rows = select(frame, zero_grad="never", **PLAIN)
    assert (rows.verdict == "differs").all(), "stale gradients of the previous step remain"
    expected = rows.accum_steps.where(rows.loss_scaling == "none", 1).to_numpy()
    assert rows.cumulative_scale.to_numpy() == pytest.approx(expected, rel=RTOL)
    assert rows.cumulative_residual.max() < RTOL
    assert (rows.optimizer_steps == WINDOWS).all()


def test_zeroing_every_micro_step_keeps_only_the_last_micro_batch(frame):
    rows = select(frame, zero_grad="every-micro-step", loss_scaling="1/k", **PLAIN)
    assert (select(rows, accum_steps=1).verdict == "matches").all()
    assert (select(rows, accum_steps=3).verdict == "differs").all()


def test_no_sync_all_reduces_once_per_step_instead_of_every_micro_step(frame):
    ddp = select(frame, strategy="ddp", zero_grad="every-step", loss_scaling="1/k", **PLAIN)
    for k in STEPS:
        synced = select(ddp, accum_steps=k, sync="every-micro-step").iloc[0]
        skipped = select(ddp, accum_steps=k, sync="no_sync").iloc[0]
        assert synced.allreduce_calls == k and skipped.allreduce_calls == 1
        assert synced.allreduce_bytes == k * skipped.allreduce_bytes > 0
        assert synced.verdict == skipped.verdict == "matches"


def test_dataparallel_reduce_adds_every_micro_step(frame):
    rows = select(frame, strategy="dp-emulated", world_size=3, zero_grad="every-step",
                  loss_scaling="1/k", **PLAIN)
    assert (rows.reduce_add_calls == rows.accum_steps).all()
    assert rows.allreduce_calls.isna().all()


def test_batchnorm_breaks_equivalence_and_groupnorm_keeps_it(frame):
    textbook = dict(zero_grad="every-step", shards="even", loss_normalization="micro-batch-mean",
                    status="ok")
    batchnorm = select(frame, norm="batchnorm", **textbook)
    split = batchnorm[(batchnorm.accum_steps > 1) | (batchnorm.world_size > 1)]
    assert split.fit_residual.min() > 1e-3, "micro-batch statistics are not the big batch's"
    assert (select(batchnorm, accum_steps=1, world_size=1).verdict == "matches").all()
    groupnorm = select(frame, norm="groupnorm", **textbook)
    assert groupnorm.fit_residual.max() < RTOL and (groupnorm.verdict == "matches").all()


@pytest.mark.parametrize("shards", ["uneven", "tokens"])
def test_mean_of_means_is_off_and_window_normalization_is_exact(frame, shards):
    base = dict(norm="none", shards=shards, zero_grad="every-step", status="ok")
    means = select(frame, loss_normalization="micro-batch-mean", **base)
    split = means[(means.accum_steps > 1) | ((means.world_size > 1) & (means.strategy == "ddp"))]
    assert split.relative_error.min() > 1e-3
    window = select(frame, loss_normalization="window-total", **base)
    assert window.relative_error.max() < RTOL
    assert (window.verdict == "matches").all()


def test_ddp_ranks_agree_and_syncbatchnorm_says_why_it_is_skipped(frame):
    ok = select(frame, strategy="ddp", status="ok")
    assert (ok.rank_spread == 0).all()
    if not torch.cuda.is_available():
        sync_bn = select(frame, norm="syncbatchnorm")
        assert (sync_bn.status == "skipped: SyncBatchNorm needs CUDA devices").all()
