"""The fit tells sum from mean from 'other' on vectors whose answer is known."""

import math

import pytest
import torch

from harness.fit import equivalence_verdict, fit_scale, reduction_verdict, relative_error
from harness.tolerances import relative_tolerance

RTOL = relative_tolerance(torch.float64)


def per_device_vectors(k: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(k)
    return [torch.randn(10, generator=generator, dtype=torch.float64) for _ in range(k)]


@pytest.mark.parametrize("k", [2, 3, 4, 7])
def test_mean_of_device_vectors_is_called_mean(k):
    g = per_device_vectors(k)
    fit = fit_scale(torch.stack(g).mean(0), torch.stack(g).sum(0))
    assert fit.scale == pytest.approx(1 / k, rel=1e-14)
    assert fit.residual < 1e-14
    assert reduction_verdict(fit, k, RTOL) == "mean"


@pytest.mark.parametrize("k", [2, 3, 4])
def test_sum_of_device_vectors_is_called_sum(k):
    g = per_device_vectors(k)
    fit = fit_scale(torch.stack(g).sum(0), torch.stack(g).sum(0))
    assert fit.scale == pytest.approx(1.0, rel=1e-14)
    assert reduction_verdict(fit, k, RTOL) == "sum"


def test_one_device_is_both():
    g = per_device_vectors(1)[0]
    assert reduction_verdict(fit_scale(g, g), 1, RTOL) == "sum=mean"


def test_a_scale_that_is_neither_is_other():
    g = per_device_vectors(4)
    fit = fit_scale(0.5 * torch.stack(g).sum(0), torch.stack(g).sum(0))
    assert fit.residual < 1e-14
    assert reduction_verdict(fit, 4, RTOL) == "other"


def test_no_scale_explains_a_reweighted_sum():
    """Weighting devices unequally (uneven shards, BatchNorm) is not a scale: residual says so."""
    g = per_device_vectors(3)
    fit = fit_scale(g[0] + 2 * g[1] + 3 * g[2], torch.stack(g).sum(0))
    assert fit.residual > 1e-3
    assert reduction_verdict(fit, 3, RTOL) == "other"
    assert equivalence_verdict(fit, RTOL) == "differs"


def test_a_perturbation_just_above_tolerance_is_detected():
    g = per_device_vectors(2)
    ref = torch.stack(g).sum(0)
    fit = fit_scale(ref * (1 + 1e-6), ref)
    assert equivalence_verdict(fit, RTOL) == "scaled"
    assert equivalence_verdict(fit_scale(ref, ref), RTOL) == "matches"


def test_zero_reference_gives_nan_not_a_verdict():
    fit = fit_scale(torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    assert math.isnan(fit.scale)
    assert reduction_verdict(fit, 2, RTOL) == "other"
    assert math.isnan(relative_error(torch.ones(3), torch.zeros(3)))


def test_shapes_must_match():
    with pytest.raises(ValueError, match="cannot fit shapes"):
        fit_scale(torch.ones(3), torch.ones(4))
