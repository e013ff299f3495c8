"""Every verdict the harness writes, fed values on both sides of its tolerance.

A verdict compares a measurement with a prediction within a tolerance. Each
test moves the measurement away from the prediction by a known multiple of the
tolerance: half of it (the verdict must hold), twice it (it must not), and a
thousand times it (so that a tolerance loosened a millionfold inside one
verdict function is caught, not only one loosened a little). Where a study
computes a verdict inline, the test calls the smallest function of the study
that computes it, with inputs built for the purpose, so that a tolerance
changed *there* is caught too. The last tests check that every tolerance sits
strictly between the rounding it must ignore and the effect it must resolve.
"""

from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from harness.fit import (
    ScaleFit,
    combination_verdict,
    equivalence_verdict,
    fit_scale,
    reduction_verdict,
)
from harness.strategies.common import StepMeasurement
from harness.strategies.local import per_device_gradients
from harness.studies.accumulation.study import AccumulationStudy, WindowResult
from harness.studies.base import Case
from harness.studies.reduction.study import ReductionStudy, _analyse
from harness.studies.seed001.study import Seed001Study, SeedSetup, predict, seed_printed
from harness.studies.seed004.study import _row_values
from harness.studies.training.study import REFERENCE, RUNNING_SUM, EpochRecord, TrainingStudy
from harness.tasks import Batch
from harness.tolerances import (
    RELATIVE_TOLERANCE,
    TRAJECTORY_TOLERANCE,
    ZERO_NORM,
    close,
    relative_tolerance,
    trajectory_tolerance,
)
from harness.verdicts import Combination, Equivalence, Reduction
from tests.runs import make_run

DTYPES = (torch.float64, torch.float32)
INSIDE = 0.5
#: Just outside, and far outside: a millionfold looser tolerance would accept 1e3 x rtol.
OUTSIDE = (2.0, 1e3)
#: (multiple of the tolerance, whether the verdict must hold there)
SIDES = [(INSIDE, True), *((factor, False) for factor in OUTSIDE)]


def nudged(expected: float, factor: float, rtol: float) -> float:
    """``expected`` moved by ``factor`` tolerances, in ``close``'s units (relative, but
    absolute below 1: the tolerance scales with max(|expected|, 1))."""
    return expected + factor * rtol * max(abs(expected), 1.0)


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def rtol(request) -> float:
    return relative_tolerance(request.param)


# --------------------------------------------------------------- tolerances.close
@pytest.mark.parametrize("expected", [1.0, 0.25, 3.0, -2.0, 1e-3, 1e6])
@pytest.mark.parametrize("factor, holds", SIDES)
@pytest.mark.parametrize("sign", [1, -1])
def test_close(rtol, expected, factor, holds, sign):
    assert close(nudged(expected, sign * factor, rtol), expected, rtol) is holds


def test_close_never_holds_for_nan():
    assert not close(math.nan, 1.0, 1e-9) and not close(1.0, math.nan, 1e-9)


# ------------------------------------------------------------------------ harness.fit
@pytest.mark.parametrize("k", [2, 3, 4, 8])
@pytest.mark.parametrize("factor, holds", SIDES)
def test_reduction_verdict_on_the_scale(rtol, k, factor, holds):
    for sign in (1, -1):
        mean = ScaleFit(nudged(1 / k, sign * factor, rtol), 0.0)
        summed = ScaleFit(nudged(1.0, sign * factor, rtol), 0.0)
        assert reduction_verdict(mean, k, rtol) == (Reduction.MEAN if holds else Reduction.OTHER)
        assert reduction_verdict(summed, k, rtol) == (Reduction.SUM if holds else Reduction.OTHER)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("factor, holds", SIDES)
def test_reduction_verdict_on_the_residual(rtol, k, factor, holds):
    """An exact weight with a residual beyond the tolerance is no reduction at all."""
    exact = {1: Reduction.SUM_EQUALS_MEAN, 2: Reduction.MEAN, 4: Reduction.MEAN}[k]
    fit = ScaleFit(1 / k, factor * rtol)
    assert reduction_verdict(fit, k, rtol) == (exact if holds else Reduction.OTHER)


@pytest.mark.parametrize("factor, holds", SIDES)
def test_reduction_verdict_at_one_device_is_sum_and_mean(rtol, factor, holds):
    fit = ScaleFit(nudged(1.0, factor, rtol), 0.0)
    assert reduction_verdict(fit, 1, rtol) == (Reduction.SUM_EQUALS_MEAN if holds
                                               else Reduction.OTHER)


def test_reduction_verdict_of_nan_is_other():
    assert reduction_verdict(ScaleFit(math.nan, 0.0), 2, 1e-9) == Reduction.OTHER
    assert reduction_verdict(ScaleFit(0.5, math.nan), 2, 1e-9) == Reduction.OTHER


@pytest.mark.parametrize("factor, holds", SIDES)
def test_equivalence_verdict_on_the_scale(rtol, factor, holds):
    for sign in (1, -1):
        fit = ScaleFit(nudged(1.0, sign * factor, rtol), 0.0)
        assert equivalence_verdict(fit, rtol) == (Equivalence.MATCHES if holds
                                                  else Equivalence.SCALED)


@pytest.mark.parametrize("scale", [1.0, 0.5, 4.0])
@pytest.mark.parametrize("factor, holds", SIDES)
def test_equivalence_verdict_on_the_residual(rtol, scale, factor, holds):
    exact = Equivalence.MATCHES if scale == 1.0 else Equivalence.SCALED
    fit = ScaleFit(scale, factor * rtol)
    assert equivalence_verdict(fit, rtol) == (exact if holds else Equivalence.DIFFERS)


def test_equivalence_verdict_of_nan_differs():
    assert equivalence_verdict(ScaleFit(math.nan, 0.0), 1e-9) == Equivalence.DIFFERS
    assert equivalence_verdict(ScaleFit(1.0, math.nan), 1e-9) == Equivalence.DIFFERS


@pytest.mark.parametrize("factor, holds", SIDES)
def test_combination_verdict(rtol, factor, holds):
    parts = [1.0, 2.0, 4.5]
    total, mean = sum(parts), sum(parts) / len(parts)
    assert combination_verdict(nudged(total, factor, rtol), parts, rtol) == (
        Combination.SUM if holds else Combination.NEITHER)
    assert combination_verdict(nudged(mean, -factor, rtol), parts, rtol) == (
        Combination.MEAN if holds else Combination.NEITHER)
    assert combination_verdict(total, [], rtol) == Combination.UNRECORDED


# ------------------------------------------------------------------ study verdicts
def orthogonal(reference: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A vector orthogonal to ``reference`` with the same norm: adding f times it leaves the
    least-squares scale unchanged and makes the residual f / sqrt(1 + f^2) ~ f."""
    direction = torch.randn(reference.shape, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(seed))
    direction -= (direction @ reference) / (reference @ reference) * reference
    return direction * reference.norm() / direction.norm()


@pytest.mark.parametrize("factor, holds", SIDES)
def test_seed004_matches_and_matches_seed(rtol, factor, holds):
    for expected in (Fraction(-16), Fraction(6, 5)):
        measured = nudged(float(expected), factor, rtol)
        values = _row_values(measured, expected, "formula", float(expected), rtol)
        assert values["matches"] is holds and values["matches_seed"] is holds
        assert _row_values(float(expected), expected, "", measured, rtol)["matches_seed"] is holds
    assert _row_values(1.0, Fraction(1), "", None, rtol)["matches_seed"] is None


def seed001_case(strategy: str, experiment: str, k: int) -> Case:
    return Case.of("seed001", strategy=strategy, experiment=experiment, world_size=k,
                   loss_reduction="mean")


@pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
@pytest.mark.parametrize("factor, holds", SIDES)
def test_seed001_matches_matches_seed_and_contributions(dtype, factor, holds):
    """The seed's own case (DataParallel, experiment 1, 2 devices): w.grad nudged away from
    both the prediction and the printed number; each device's contribution nudged away
    from what sums to w.grad."""
    run = make_run("seed001", dtype=str(dtype).removeprefix("torch."))
    rtol = run.rtol
    case = seed001_case("dp-emulated", "1-per-device-factor", 2)
    setup = SeedSetup(case["experiment"])
    predicted, _ = predict(setup, "dp-emulated", 2, "mean", 1)
    assert seed_printed(case, 1) is not None, "the seed printed this case"
    measured = nudged(predicted, factor, rtol)
    contributions = [torch.full((8,), part, dtype=torch.float64)
                     for part in (predicted / 4, 3 * predicted / 4)]
    grad = torch.full((8,), measured, dtype=torch.float64)
    m = StepMeasurement(grads=[grad], contributions=contributions, chunk_sizes=(1, 1))
    row = Seed001Study()._row(case, setup, m, 0, run)
    assert row["matches"] is holds
    assert row["contributions_combination"] == (Combination.SUM if holds
                                                else Combination.NEITHER)
    printed = seed_printed(case, 1)
    off_printed = nudged(printed, factor, rtol)
    m = StepMeasurement(grads=[torch.full((8,), off_printed, dtype=torch.float64)],
                        contributions=contributions, chunk_sizes=(1, 1))
    assert Seed001Study()._row(case, setup, m, 0, run)["matches_seed"] is holds


def training_row(params: torch.Tensor, twin_params: torch.Tensor, applied: float, fresh: float,
                 rule: str = "backward-zero-grad", dtype: torch.dtype = torch.float64) -> dict:
    """The training study's row of one epoch of ``rule``, whose twin has ``twin_params``."""
    case = Case.of("training", strategy="local", world_size=1)
    record = EpochRecord(epoch=1, steps=30, params=params, train_loss=0.5,
                         heldout_accuracy=0.9, applied_grad_norm=applied,
                         fresh_grad_norm=fresh, rank_spread=0.0)
    twins = {REFERENCE: [twin_params, twin_params], RUNNING_SUM: [twin_params, twin_params]}
    digits = SimpleNamespace(train_y=torch.zeros(3), heldout_y=torch.zeros(2))
    return TrainingStudy()._row(case, rule, record, twins, trajectory_tolerance(dtype),
                                relative_tolerance(dtype), digits)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float64", "float32"])
@pytest.mark.parametrize("factor, holds", SIDES)
def test_training_identical_to_twin_and_applied_is_fresh(dtype, factor, holds):
    twin = torch.linspace(-1.0, 2.0, 50, dtype=torch.float64)
    rtol = trajectory_tolerance(dtype)
    moved = twin + factor * rtol * orthogonal(twin)
    row = training_row(moved, twin, 1.0, 1.0, dtype=dtype)
    assert row["twin_distance"] == pytest.approx(factor * rtol, rel=1e-6)
    assert row["identical_to_twin"] is holds
    for rule in ("backward-no-zero", "optim.SGD"):
        assert training_row(moved, twin, 1.0, 1.0, rule, dtype)["identical_to_twin"] is holds
    gradient_rtol = relative_tolerance(dtype)
    for norm in (0.3, 7.0):
        row = training_row(twin, twin, nudged(norm, factor, gradient_rtol), norm, dtype=dtype)
        assert row["applied_is_fresh"] is holds
    assert training_row(twin, twin, 1.0, math.nan, dtype=dtype)["applied_is_fresh"] is None


def accumulation_verdict(grad: torch.Tensor, big_batch: torch.Tensor, rtol: float) -> str:
    windows = [WindowResult([grad], big_batch, 8)]
    return AccumulationStudy._measurements(windows, SimpleNamespace(), rtol)["verdict"]


@pytest.mark.parametrize("factor, holds", SIDES)
def test_accumulation_verdict(rtol, factor, holds):
    big = torch.linspace(-2.0, 3.0, 40, dtype=torch.float64)
    scaled = nudged(1.0, factor, rtol) * big
    assert accumulation_verdict(scaled, big, rtol) == (Equivalence.MATCHES if holds
                                                       else Equivalence.SCALED)
    bent = big + factor * rtol * orthogonal(big)
    assert accumulation_verdict(bent, big, rtol) == (Equivalence.MATCHES if holds
                                                     else Equivalence.DIFFERS)
    assert accumulation_verdict(3 * big + factor * rtol * 3 * orthogonal(big), big, rtol) == (
        Equivalence.SCALED if holds else Equivalence.DIFFERS)


def reduction_inputs(k: int = 2, dtype: str = "float64"):
    """The reduction study's spec of an MLP step over k devices of 4 samples, and each
    device's own-shard gradient (what ``_analyse`` fits against)."""
    run = make_run("reduction", dtype=dtype)
    case = Case.of("reduction", strategy="dp-emulated", world_size=k, model="mlp",
                   loss_reduction="mean")
    spec = ReductionStudy()._spec(case, run)
    sizes = tuple(len(s) for s in spec.shards)
    chunks = Batch.cat(spec.shards).split(sizes)
    per_device = [g.to(torch.float64) for g in
                  per_device_gradients(spec.task, spec.model, chunks, "mean")]
    return run, spec, sizes, per_device


def analysed(spec, sizes, grad, contributions, rtol) -> dict:
    m = StepMeasurement(grads=[grad], contributions=contributions, chunk_sizes=sizes)
    return _analyse(spec, m, rtol)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("factor, holds", SIDES)
def test_reduction_verdict_reduce_op_and_full_batch_verdict(dtype, factor, holds):
    """param.grad = w * sum_r g_r with w nudged away from 1/k (verdict), then bent away from
    every multiple (residual); contributions scaled so that only reduce_weight is nudged
    (reduce_op); and param.grad nudged away from the big-batch gradient (full_batch_verdict)."""
    k = 2
    run, spec, sizes, per_device = reduction_inputs(k, dtype)
    rtol = run.rtol
    total = torch.stack(per_device).sum(0)
    mean = Reduction.MEAN if holds else Reduction.OTHER
    off_weight = analysed(spec, sizes, nudged(1 / k, factor, rtol) * total, per_device, rtol)
    assert off_weight["verdict"] == mean
    bent = total / k + factor * rtol * orthogonal(total / k)
    assert analysed(spec, sizes, bent, per_device, rtol)["verdict"] == mean
    exact = total / k
    shrunk = [g * (1 / k) / nudged(1 / k, factor, rtol) for g in per_device]
    row = analysed(spec, sizes, exact, shrunk, rtol)
    assert row["reduce_op"] == mean and row["verdict"] == Reduction.MEAN
    # Equal shards and a mean loss: the big-batch gradient is the mean of the shards'.
    full = fit_scale(exact, total / k)
    assert full.scale == pytest.approx(1.0, abs=1e-12)
    off_full = analysed(spec, sizes, nudged(1.0, factor, rtol) * exact, per_device, rtol)
    assert off_full["full_batch_verdict"] == (Equivalence.MATCHES if holds
                                              else Equivalence.SCALED)


# ---------------------------------------------------- tolerances against their reasons
F64 = torch.float64
#: Every tolerance of harness/tolerances.py: (the rounding it must ignore, the effect it must
#: resolve), per dtype, as its comment there states them:
#: - RELATIVE_TOLERANCE: a gradient's rounding is a few ulps times the terms summed, < 1e-13
#:   in float64 and ~1e-5 in float32 (1e-7 accumulated over a few hundred terms); the
#:   smallest effect is 1/N vs 1/(N+1), relative 1/(N(N+1)) >= 1e-3;
#: - TRAJECTORY_TOLERANCE: measured twin drift up to 1e-14 in float64 (~1e-6 in float32);
#:   a forgotten zero_grad moves the parameters by more than their norm (distance > 1);
#: - ZERO_NORM: above float64's smallest normal number, below any gradient of the
#:   harness's models (norms 1e-2..1e2).
BRACKETS: dict[str, dict[str | None, tuple[float, float]]] = {
    "RELATIVE_TOLERANCE": {"float64": (1e-13, 1e-3), "float32": (1e-5, 1e-3)},
    "TRAJECTORY_TOLERANCE": {"float64": (1e-14, 1.0), "float32": (1e-6, 1.0)},
    "ZERO_NORM": {None: (torch.finfo(F64).tiny, 1e-2)},
    # The update study's, with the numbers their comments in tolerances.py measured:
    # identical updates (1e-15 / 4.3e-7) against the smallest real effect (Adam's eps
    # under a scaled gradient, 1.7e-7, in float64; coupled weight decay, 0.13, in float32).
    "UPDATE_TOLERANCE": {"float64": (1e-15, 1.7e-7), "float32": (4.3e-7, 0.13)},
    # Adam's "up to eps" (at most 1.0e-4) against every factor that really fails (>= 0.13).
    "APPROXIMATE_UPDATE_TOLERANCE": {None: (1.0e-4, 0.13)},
    # A definition: the rule holding at lr = 1e-3 (<= 1%) against two unrelated runs (~1).
    "LINEAR_SCALING_TOLERANCE": {None: (1e-2, 1.0)},
    # check.py's: rounding on a 1e8-parameter model (float32: 2.9e-5 measured on updates)
    # against the smallest effect the examples show (BatchNorm's residual 0.043); under
    # bfloat16 autocast, 3.1e-3 measured against a factor 2 (0.5); under float16 autocast,
    # 3.4e-4 measured (on the CPU), against BatchNorm's 0.043.
    "CHECK_TOLERANCE": {"float64": (1e-12, 1e-3), "float32": (2.9e-5, 0.043),
                        "bfloat16": (3.1e-3, 0.5), "float16": (3.4e-4, 0.043)},
}


def tolerance_constants() -> dict[str, object]:
    import harness.tolerances as module

    return {name: value for name, value in vars(module).items()
            if name.isupper() and (name.endswith("TOLERANCE") or name == "ZERO_NORM")}


def test_every_tolerance_states_what_it_separates():
    unstated = set(tolerance_constants()) - set(BRACKETS)
    assert not unstated, f"tolerances without a (rounding, effect) bracket here: {unstated}"


@pytest.mark.parametrize("name", sorted(BRACKETS))
def test_every_tolerance_sits_strictly_between_rounding_and_effect(name):
    value = tolerance_constants()[name]
    values = value if isinstance(value, dict) else {None: value}
    assert set(values) == set(BRACKETS[name])
    for dtype, tolerance in values.items():
        rounding, effect = BRACKETS[name][dtype]
        assert rounding < tolerance < effect, (name, dtype)
        # At least an order of magnitude of margin on each side, as tolerances.py promises.
        assert tolerance / rounding >= 10 and effect / tolerance >= 10, (name, dtype)
        if dtype is not None:
            eps = torch.finfo(getattr(torch, dtype)).eps
            assert eps < tolerance, "above the dtype's own rounding"


def test_the_float64_tolerances_are_the_documented_ones():
    """The numbers the README and the verdict columns' docs quote."""
    assert RELATIVE_TOLERANCE["float64"] == 1e-9 and TRAJECTORY_TOLERANCE["float64"] == 1e-9
    assert RELATIVE_TOLERANCE["float32"] > RELATIVE_TOLERANCE["float64"]
    assert relative_tolerance(torch.float32) == relative_tolerance("float32")
    with pytest.raises(ValueError, match="allowed: float64, float32"):
        relative_tolerance(torch.float16)


def test_zero_norm_refuses_a_fit_against_nothing_and_not_against_a_small_gradient():
    tiny = torch.full((4,), ZERO_NORM / 10, dtype=torch.float64)
    assert math.isnan(fit_scale(torch.ones(4, dtype=torch.float64), tiny).scale)
    small = torch.full((4,), 1e-3, dtype=torch.float64)
    assert fit_scale(2 * small, small).scale == pytest.approx(2.0, rel=1e-15)
