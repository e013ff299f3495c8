"""Verdicts judged at the precision the step really had, and what a difference at
N = 1, k = 1 (nothing split) says."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples import mlp
from harness.check.precision import lowest
from harness.grad_check import MicroStep, Setup, check


def float32_loss(model: nn.Module, data) -> torch.Tensor:
    """A float64 model whose loss runs the output layer in float32 (as many heads do under
    mixed precision): its weight's gradient sums the samples in float32, rounding by how
    the batch is split."""
    x, y = data
    head = model[-1]
    hidden = model[:-1](x).float()
    out = nn.functional.linear(hidden, head.weight.float(), head.bias.float())
    return nn.functional.mse_loss(out, y.float())


def make_float32_loss_setup() -> Setup:
    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=float32_loss,
                 name="float32-loss")


def not_the_loss(model: nn.Module, data, where: MicroStep) -> torch.Tensor:
    """A custom micro-step that adds a term Setup.loss does not have."""
    penalty = sum(p.square().sum() for p in model.parameters())
    return mlp.mean_loss(model, data) / where.accum_steps + 1e-3 * penalty


def make_other_micro_step_setup() -> Setup:
    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                 micro_step=not_the_loss, name="not-the-loss")


def test_lowest_is_the_coarsest_rounding():
    assert lowest([torch.float64, torch.float32]) == torch.float32
    assert lowest([torch.float32, torch.bfloat16, torch.float16]) == torch.bfloat16


def test_a_loss_cast_to_float32_is_judged_at_float32():
    rows = check(make_float32_loss_setup, strategies=["local"], world_sizes=(1, 2),
                 accum_steps=(1, 2))
    assert set(rows["dtype"]) == {"float64"} and set(rows["precision"]) == {"float32"}
    assert set(rows["verdict"]) == {"matches"}, rows
    split = rows[rows["accum_steps"] * rows["world_size"] > 1]
    # float32 rounding, far above float64's tolerance (1e-9): a float64 verdict would differ.
    assert (split["residual"] > 1e-9).all()


def test_a_difference_where_nothing_is_split_blames_the_micro_step_not_the_split():
    rows = check(make_other_micro_step_setup, strategies=["local"], world_sizes=(1,),
                 accum_steps=(1,))
    grad = rows[rows["point"] == "grad"].iloc[0]
    assert grad["verdict"] == "differs"
    assert grad["fix"].startswith("nothing is split at N = 1, k = 1")
    assert "custom micro_step computes something other than Setup.loss" in grad["fix"]
    assert f"residual {grad['residual']:.3g}" in grad["fix"]
    assert "split" not in grad["fix"].split(":", 1)[1]


@pytest.mark.launches(seconds=3)  # imports transformers
def test_a_hugging_face_llama_with_window_token_normalization_matches():
    pytest.importorskip("transformers")
    rows = check("examples.hf_llama:make_window_setup", strategies=["local"],
                 world_sizes=(1, 2), accum_steps=(1, 2))
    assert set(rows["precision"]) == {"float32"}
    assert set(rows["verdict"]) == {"matches"}, rows[["world_size", "accum_steps", "point",
                                                      "verdict", "residual", "fix"]]


def test_bfloat16_rounding_never_hides_a_split_that_full_precision_shows():
    from tests.frameworks_setups import bf16_token_mean_setup

    rows = check(bf16_token_mean_setup(), strategies=["local"], world_sizes=(1, 2),
                 accum_steps=(1, 2))
    split = rows[(rows.world_size == 2) & (rows.accum_steps == 2)]
    # Under bfloat16 alone this read `matches`: its residual is below bfloat16's tolerance.
    assert (split.autocast_residual < 3e-2).all() and (split.autocast_residual > 1e-3).all()
    assert (split.verdict == "differs").all(), split
    assert (split.precision == "float64").all()
    assert split.fix.str.contains("window's token count").all()
    # Equal micro-batches (59 tokens each): the split matches, within bfloat16's rounding.
    equal = rows[(rows.world_size * rows.accum_steps == 2)]
    assert (equal.verdict == "matches").all() and (equal.precision == "bfloat16").all()
    assert (equal.autocast_residual > 0).all()


def test_the_lowest_precision_is_the_coarsest_rounding_in_any_order():
    """bfloat16 rounds coarser than float16 although both have 16 bits; e5m2 coarser than
    e4m3 although both have 8: the order the types are met in decides nothing."""
    import itertools

    for order in itertools.permutations([torch.float32, torch.float16, torch.bfloat16]):
        assert lowest(order) is torch.bfloat16, order
        assert lowest(order[:2]) is (torch.bfloat16 if torch.bfloat16 in order[:2]
                                     else torch.float16), order
    for order in itertools.permutations([torch.float8_e4m3fn, torch.float8_e5m2]):
        assert lowest(order) is torch.float8_e5m2, order
