"""Fast tests of one-line rules that otherwise only a multi-rank run exercises.

scripts/mutate.py plants a bug in each of these lines and requires these tests to
fail: where a fix is chosen, how a batch is split, which learning-rate factor a
scale asks for.
"""

import torch
from torch import nn

from harness.check.batches import piece
from harness.check.fix import Facts, scale_fix
from harness.check.setup import Setup
from harness.check.step import WholeStep, not_finite
from harness.studies.update.experiments.lr_factor import INVERSE_SCALE, SAME_LR, candidate_factor

DDP_3X2 = Facts(reduces_in_buckets=True, world_size=3, accum_steps=2)


def test_a_gradient_scaled_up_is_fixed_by_dividing_the_loss():
    assert scale_fix("grad", 6.0, DDP_3X2) == "divide the loss by 6 = N*k"


def test_a_gradient_scaled_down_is_fixed_by_multiplying_the_loss():
    assert scale_fix("grad", 1 / 3, DDP_3X2) == "multiply the loss by 3 = N"


def test_a_scaled_update_is_fixed_by_the_inverse_learning_rate_factor():
    assert scale_fix("params", 1 / 6, DDP_3X2).startswith("multiply lr by 1/s = 6 = N*k")


def test_each_rank_takes_its_contiguous_share_then_its_micro_batches_in_order():
    batch = torch.arange(8)
    pieces = [piece(batch, 2, rank, 2, micro).tolist() for rank in (0, 1) for micro in (0, 1)]
    assert pieces == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_lr_factor_of_a_gradient_scaled_by_s_is_one_over_s():
    assert candidate_factor(INVERSE_SCALE, 4.0) == 0.25
    assert candidate_factor(SAME_LR, 4.0) == 1.0
    assert candidate_factor(INVERSE_SCALE, float("nan")) == 1.0


INF, NAN = float("inf"), float("nan")


def test_a_gradient_partly_nan_or_infinite_is_not_finite():
    assert not_finite(torch.tensor([1.0, NAN, 2.0]))
    assert not_finite(torch.tensor([[INF, 0.0], [0.0, 0.0]]))
    assert not not_finite(torch.tensor([1.0, 2.0]))
    assert not not_finite(None)  # a parameter without a gradient


def test_the_scaler_skips_the_step_where_a_single_gradient_overflowed():
    model = nn.Linear(2, 1)
    setup = Setup(make_model=lambda: model, batch=lambda step: torch.zeros(1, 2),
                  loss=lambda m, x: m(x).sum(), grad_scaler=True)
    whole = WholeStep(setup, model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.device("cpu"))
    finite = torch.ones(3)
    assert whole.skips([finite, torch.tensor([1.0, INF]), finite])
    assert not whole.skips([finite, None, finite])
