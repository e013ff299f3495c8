"""The training study, on a reduced configuration, through its real code.

A few hundred digits and two epochs keep it fast; what is asserted holds at any
size: rules that are the same mathematics stay on the same trajectory, the
never-zeroed rule applies the running sum of all gradients and leaves it, and
autograd.grad under DDP trains every rank alone.
"""

import math

import numpy as np
import pandas as pd
import pytest
import torch

import harness.studies.training.data as data
from harness.context import RunContext
from harness.studies.training.data import DIGITS_COUNT
from harness.studies.training.study import (
    RANK0_ALONE,
    REFERENCE,
    RUNNING_SUM,
    UPDATE_RULES,
    Digits,
    TrainingOptions,
    TrainingSetup,
    TrainingStudy,
)
from harness.tolerances import trajectory_tolerance
from tests.distributed import run_ranks
from tests.runs import make_run
from tests.scheduling import launching

TOL = trajectory_tolerance(torch.float64)
EPOCHS = 2
#: 4 steps per epoch: enough for accumulation to show, cheap enough for the suite.
SMALL = TrainingSetup(batch_size=50, train_samples=200, held_out=100)


@pytest.mark.launches(seconds=2)  # imports scikit-learn: seconds, not for the quick run
def test_the_digits_are_those_sklearn_loads_without_importing_it():
    from sklearn.datasets import load_digits

    images, target = data._read_digits_file()
    digits = load_digits()
    assert images.dtype == digits.images.dtype and np.array_equal(images, digits.images)
    assert np.array_equal(target, digits.target)
    assert len(target) == DIGITS_COUNT


def small_study() -> TrainingStudy:
    return TrainingStudy(TrainingOptions(epochs=EPOCHS), setup=SMALL)


def run_study_case(study, strategy: str, run: RunContext) -> pd.DataFrame | None:
    case = next(c for c in study.cases(run) if c["strategy"] == strategy)
    rows = study.run_case(case, run)
    return None if rows is None else pd.DataFrame(rows)


def by_variant(frame: pd.DataFrame, variant: str) -> pd.DataFrame:
    return frame[frame.variant == variant].sort_values("epoch")


@pytest.fixture(scope="module")
def local():
    return run_study_case(small_study(), "local", make_run("training"))


def _ddp_rank(rank, world_size):
    return run_study_case(small_study(), "ddp", make_run("training", world_size=world_size,
                                                                rank=rank))


@pytest.fixture(scope="module")
@launching(seconds=2)
def ddp(tmp_path_factory):
    frames = run_ranks(2, _ddp_rank, store_dir=tmp_path_factory.mktemp("store"))
    assert frames[1] is None, "only rank 0 returns rows"
    return frames[0]


def test_rows_cover_every_rule_and_epoch_with_the_schema(local):
    assert list(local.columns) == [*TrainingStudy.own_columns(), "status"]
    assert sorted(local.variant.unique()) == sorted(UPDATE_RULES)
    assert sorted(local.epoch.unique()) == list(range(EPOCHS + 1))
    assert (local.steps == local.epoch * 4).all()
    assert (local.train_samples == 200).all() and (local.heldout_samples == 100).all()


def test_every_rule_starts_from_the_same_weights(local, ddp):
    for frame in (local, ddp):
        start = frame[frame.epoch == 0]
        assert (start.param_distance == 0.0).all()
        assert start.heldout_accuracy.nunique() == 1


def test_zeroed_rules_stay_on_the_autograd_grad_trajectory(local, ddp):
    for frame in (local, ddp):
        for variant in ("backward-zero-grad", "optim.SGD"):
            rows = by_variant(frame, variant)
            assert (rows.twin == REFERENCE).all()
            assert (rows.twin_distance <= TOL).all() and rows.identical_to_twin.all()
            assert (rows.applied_grad_norm.dropna() == rows.fresh_grad_norm.dropna()).all()


def test_never_zeroed_rule_is_the_running_sum_and_leaves_the_reference(local, ddp):
    for frame in (local, ddp):
        rows = by_variant(frame, "backward-no-zero")
        assert (rows.twin == RUNNING_SUM).all()
        assert (rows.twin_distance <= TOL).all(), "the difference is accumulation, nothing else"
        last = rows.iloc[-1]
        assert last.param_distance > 1e6 * TOL, "it leaves the autograd.grad trajectory"
        assert last.applied_grad_norm != last.fresh_grad_norm, "it applies stale gradients"


def test_zeroed_rules_learn(local):
    rows = by_variant(local, "autograd.grad")
    assert rows.train_loss.iloc[-1] < rows.train_loss.iloc[1] < math.log(10)
    assert rows.heldout_accuracy.iloc[-1] > rows.heldout_accuracy.iloc[0]


def test_local_runs_have_one_rank(local):
    assert (local.rank_spread == 0.0).all()
    assert by_variant(local, "autograd.grad").twin.eq("").all(), "it is the reference"


def test_autograd_grad_under_ddp_skips_the_all_reduce(ddp):
    rows = by_variant(ddp, "autograd.grad")
    assert (rows.twin == RANK0_ALONE).all()
    assert (rows.twin_distance <= TOL).all(), "rank 0 trains on its own shards alone"
    assert rows.rank_spread.iloc[-1] > 1e6 * TOL, "so the ranks drift apart"
    assert rows.param_distance.iloc[-1] > 1e6 * TOL


def test_backward_under_ddp_keeps_every_rank_identical(ddp):
    for variant in ("backward-no-zero", "backward-zero-grad", "optim.SGD"):
        assert (by_variant(ddp, variant).rank_spread == 0.0).all()


def test_cases_pick_the_smallest_ddp_world_size_of_the_run():
    study = TrainingStudy()
    run = make_run("training", world_size=1)
    assert [c.id for c in study.cases(run)] == ["training/strategy=local/world_size=1"]
    run = make_run("training")
    run.world_sizes = (1, 3, 4)
    ids = [c.id for c in study.cases(run)]
    assert ids == ["training/strategy=local/world_size=1", "training/strategy=ddp/world_size=3"]


def test_digits_split_is_seeded_and_disjoint():
    first = Digits.load(0, torch.float64, torch.device("cpu"), held_out=297)
    again = Digits.load(0, torch.float64, torch.device("cpu"), held_out=297)
    assert torch.equal(first.train_x, again.train_x) and torch.equal(first.heldout_y,
                                                                     again.heldout_y)
    assert len(first.train_y) + len(first.heldout_y) == 1797
    assert first.train_x.shape[1:] == (1, 8, 8) and float(first.train_x.max()) == 1.0
    other = Digits.load(1, torch.float64, torch.device("cpu"), held_out=297)
    assert not torch.equal(first.train_y, other.train_y)


def test_the_same_case_twice_gives_identical_rows(local):
    """Determinism of the training study (tests/test_determinism.py covers the others)."""
    again = run_study_case(small_study(), "local", make_run("training"))
    pd.testing.assert_frame_equal(local, again, check_exact=True)
