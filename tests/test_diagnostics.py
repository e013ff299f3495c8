"""Gradient diagnostics: the recorder on hand-computable models, and the study's experiments
on a reduced configuration (a few hundred digits) through their real code."""

import math

import pandas as pd
import pytest
import torch
from torch import nn

from harness.diagnostics import GradientRecorder, dead_relu_fraction, gradient_stats, graph_of
from harness.studies.diagnostics.model import DiagnosticsSetup
from harness.studies.diagnostics.study import DiagnosticsStudy
from harness.tolerances import relative_tolerance
from tests.distributed import run_ranks
from tests.frames import rows
from tests.runs import make_run
from tests.scheduling import launching

RTOL = relative_tolerance(torch.float64)
SMALL = DiagnosticsSetup(epochs=1, train_samples=300, learning_rates=(0.1, 10.0),
                         reported_steps=(1, 2, 5, 10))


# ------------------------------------------------------------ the recorder
def test_recorder_measures_gradient_and_update_of_a_known_linear_step():
    layer = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[3.0, 4.0]]))
    x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)  # d(w.x)/dw = x: one exact zero
    layer(x).sum().backward()
    recorder = GradientRecorder(layer)
    lr = 0.5
    with recorder.step(1, loss=7.0), torch.no_grad():
        layer.weight -= lr * layer.weight.grad
    (row,) = recorder.rows
    assert row["step"] == 1 and row["parameter"] == "weight" and row["loss"] == 7.0
    assert row["grad_norm"] == 1.0 and row["zero_grad_fraction"] == 0.5
    assert row["weight_norm"] == 5.0
    assert row["update_ratio"] == pytest.approx(lr * 1.0 / 5.0, rel=RTOL)


def test_a_parameter_no_backward_reached_has_grad_none():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).double()
    model[0].requires_grad_(False)
    model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    stats = {s.parameter: s for s in gradient_stats(model)}
    assert stats["0.weight"].grad_is_none and not stats["0.weight"].requires_grad
    assert math.isnan(stats["0.weight"].grad_norm)
    assert not stats["1.weight"].grad_is_none


def test_dead_relu_fraction_counts_units_silent_for_the_whole_batch():
    layer = nn.Linear(1, 2).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0], [-1.0]]))
        layer.bias.zero_()
    model = nn.Sequential(layer, nn.ReLU())
    with dead_relu_fraction(model) as dead:
        model(torch.tensor([[1.0], [2.0]], dtype=torch.float64))  # unit 1 is -x < 0: dead
    assert dead == {"1": 0.5}
    with dead_relu_fraction(model) as dead:
        model(torch.tensor([[1.0], [-2.0]], dtype=torch.float64))  # each unit fires once
    assert dead == {"1": 0.0}


def test_graph_of_says_whether_a_graph_was_built():
    w = torch.ones(2, requires_grad=True)
    assert graph_of(w * 2).grad_fn == "MulBackward0" and graph_of(w * 2).requires_grad
    with torch.no_grad():
        detached = w * 2
    assert graph_of(detached).grad_fn == "" and not graph_of(detached).requires_grad


# --------------------------------------------------------------- the study
@pytest.fixture(scope="module")
def local():
    study, run = DiagnosticsStudy(setup=SMALL), make_run("diagnostics")
    return pd.DataFrame([row for case in study.cases(run) for row in study.run_case(case, run)])


def blank(value) -> bool:
    """No value: NaN, None, or the empty text of a text column."""
    return value == "" or bool(pd.isna(value))




def test_schema(local):
    assert list(local.columns) == [*DiagnosticsStudy.own_columns(), "status"]
    assert set(local.experiment) == {"lr-sweep", "frozen-layer", "train-vs-eval", "no-grad"}


def test_a_dead_relu_unit_passes_no_gradient_to_the_weights_feeding_it(local):
    feeding = rows(local, experiment="lr-sweep", parameter="input.weight")
    # Each dead unit zeroes one whole row of input.weight.grad.
    assert (feeding.zero_grad_fraction >= feeding.dead_relu_fraction).all()
    all_dead = feeding[feeding.dead_relu_fraction == 1.0]
    assert (all_dead.grad_norm == 0.0).all() and (all_dead.update_ratio == 0.0).all()


def test_once_the_last_relu_layer_is_dead_only_the_output_bias_learns(local):
    sweep = rows(local, experiment="lr-sweep")
    middle = sweep[sweep.parameter == "middle.bias"].set_index(["setting", "step"])
    dead_steps = middle[middle.dead_relu_fraction == 1.0].index
    assert len(dead_steps) > 0
    for setting, step in dead_steps:
        at_step = rows(sweep, setting=setting, step=step).set_index("parameter")
        below = at_step.drop(index="output.bias")
        assert (below.grad_norm == 0.0).all() and (below.update_ratio == 0.0).all()
        assert at_step.loc["output.bias", "grad_norm"] > 0.0


def test_too_large_a_learning_rate_kills_the_relus_and_a_small_one_does_not(local):
    last = max(SMALL.reported_steps)
    large = rows(local, setting="lr=10", step=last, parameter="middle.bias").iloc[0]
    assert large.dead_relu_fraction == 1.0
    first = rows(local, setting="lr=10", step=1, parameter="middle.bias").iloc[0]
    assert first.dead_relu_fraction < 1.0, "the units were alive before the first step"
    small = rows(local, setting="lr=0.1", experiment="lr-sweep")
    assert (small.dead_relu_fraction.dropna() < 1.0).all()
    assert (small.update_ratio > 0.0).all() and (small.update_ratio < 1.0).all()


def test_a_frozen_layer_keeps_grad_none_and_its_weights(local):
    frozen = rows(local, experiment="frozen-layer", strategy="local")
    middle = frozen[frozen.parameter.str.startswith("middle.")]
    others = frozen[~frozen.parameter.str.startswith("middle.")]
    assert middle.grad_is_none.all() and (~middle.requires_grad).all()
    assert (middle.update_ratio == 0.0).all()
    assert (~others.grad_is_none).all() and (others.update_ratio > 0.0).all()


def test_train_mode_normalises_with_batch_statistics_and_eval_mode_still_backpropagates(local):
    train = rows(local, experiment="train-vs-eval", setting="train()").iloc[0]
    evaluation = rows(local, experiment="train-vs-eval", setting="eval()").iloc[0]
    assert train.bn_batch_mean < RTOL, "batch statistics: every channel has mean 0"
    assert train.bn_batch_std == pytest.approx(1.0, abs=1e-3), "and std 1 (up to BN's eps)"
    assert train.running_stats_change > 0.0 and evaluation.running_stats_change == 0.0
    assert evaluation.bn_batch_mean > 1e3 * RTOL, "running statistics do not centre this batch"
    assert not evaluation.grad_is_none and evaluation.grad_norm > 0.0
    assert blank(evaluation.error), "backward() works in eval mode"


def test_no_grad_builds_no_graph_and_leaves_requires_grad_alone(local):
    enabled = rows(local, experiment="no-grad", setting="grad enabled").iloc[0]
    disabled = rows(local, experiment="no-grad", setting="torch.no_grad()").iloc[0]
    assert enabled.output_requires_grad and enabled.output_grad_fn.endswith("Backward0")
    assert not enabled.grad_is_none and blank(enabled.error)
    assert not disabled.output_requires_grad and blank(disabled.output_grad_fn)
    assert disabled.grad_is_none and "does not require grad" in disabled.error
    assert disabled.requires_grad, "parameters keep requires_grad=True"
    assert disabled.loss == enabled.loss


# ------------------------------------------------------------------- DDP
def _ddp_rank(rank, world_size):
    study = DiagnosticsStudy(setup=SMALL)
    run = make_run("diagnostics", world_size=world_size, rank=rank)
    frames = [study.run_case(case, run) for case in study.cases(run)
              if case["strategy"] == "ddp"]
    return None if rank else pd.DataFrame([row for rows in frames for row in rows])


@pytest.fixture(scope="module")
@launching(seconds=2)
def ddp(tmp_path_factory):
    return run_ranks(2, _ddp_rank, store_dir=tmp_path_factory.mktemp("store"))[0]


def test_ddp_needs_no_find_unused_parameters_for_a_frozen_layer(ddp):
    for flag in ("False", "True"):
        frozen = rows(ddp, setting=f"middle frozen, find_unused_parameters={flag}")
        assert (frozen.steps_completed == SMALL.frozen_steps).all()
        assert frozen.error.map(blank).all()
        middle = frozen[frozen.parameter.str.startswith("middle.")]
        assert middle.grad_is_none.all()
        trained = frozen[~frozen.parameter.str.startswith("middle.")]
        assert (trained.grad_rank_spread == 0.0).all(), "the rest is all-reduced"


def test_ddp_needs_find_unused_parameters_for_an_unused_layer(ddp):
    broken = rows(ddp, setting="middle unused, find_unused_parameters=False")
    assert (broken.steps_completed == 1).all()
    assert broken.error.str.contains("Expected to have finished reduction").all()
    used = broken[~broken.parameter.str.startswith("middle.")]
    assert (used.grad_rank_spread > 1e3 * RTOL).all(), "its one step was never all-reduced"
    fixed = rows(ddp, setting="middle unused, find_unused_parameters=True")
    assert (fixed.steps_completed == SMALL.frozen_steps).all()
    assert (fixed[~fixed.parameter.str.startswith("middle.")].grad_rank_spread == 0.0).all()
