"""The comparison's pass over a pair of tensors against the same sums computed the plain
way, in float64 on whole tensors: what every verdict of the check is computed from.

Tensors span several chunks (a last one partly filled), so that what a chunk carries
over to the next is tested too."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from harness.check.compare import CHUNK, Pair, _residual_sq, _sums, compare
from harness.verdicts import Equivalence

CPU = torch.device("cpu")
#: Elements of the tensors compared: two whole chunks and a part of a third.
SIZE = 2 * CHUNK + 1234


def random(seed: int, dtype: torch.dtype = torch.float32, size: int = SIZE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, generator=generator, dtype=torch.float64).to(dtype)


def plain_sums(measured, reference, origin=None) -> list[float]:
    """[m.r, r.r, m.m, d.d, d.r], d = m - r, on whole float64 copies (None as zeros)."""
    like = measured if measured is not None else reference
    m, r = (torch.zeros_like(like) if t is None else t for t in (measured, reference))
    m, r = m.double().reshape(-1), r.double().reshape(-1)
    if origin is not None:
        m, r = m - origin.double().reshape(-1), r - origin.double().reshape(-1)
    d = m - r
    return [float(m @ r), float(r @ r), float(m @ m), float(d @ d), float(d @ r)]


def assert_same_sums(pair: Pair, expected: list[float]) -> None:
    """Equal to float64 rounding: each sum within 1e-12 of the largest it could round to
    (|a.b| <= ||a|| ||b||), so that a sum near zero is held to the norms it comes from."""
    got = _sums(pair).tolist()
    mr, rr, mm, dd, dr = expected
    bounds = [math.sqrt(mm * rr), rr, mm, dd, math.sqrt(dd * rr)]
    for name, value, want, bound in zip(("m.r", "r.r", "m.m", "d.d", "d.r"), got, expected,
                                        bounds, strict=True):
        assert value == pytest.approx(want, rel=1e-12, abs=1e-12 * bound), name


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16))
def test_the_pass_gives_the_plain_float64_sums(dtype):
    reference = random(0, dtype)
    measured = (reference.double() * 0.75 + 1e-3 * random(1)).to(dtype)
    assert_same_sums(Pair("t", measured, reference), plain_sums(measured, reference))


def test_updates_give_the_plain_float64_sums_of_their_differences_from_the_origin():
    origin, step = random(2), random(3)
    reference = origin - 1e-3 * step
    measured = origin - 0.5e-3 * step + 1e-7 * random(4)
    expected = plain_sums(measured, reference, origin)
    assert_same_sums(Pair("t", measured, reference, origin), expected)


@pytest.mark.parametrize("origin", (None, 5))
def test_a_missing_tensor_reads_as_zeros(origin):
    tensor = random(6)
    start = random(origin) if origin is not None else None
    for measured, reference in ((None, tensor), (tensor, None)):
        expected = plain_sums(measured, reference, start)
        assert_same_sums(Pair("t", measured, reference, start), expected)


def test_tensors_of_any_shape_and_layout_are_compared_element_by_element():
    reference = random(7).reshape(2, -1)
    measured = (2 * reference.t().contiguous()).t()   # the same values, another layout
    assert not measured.is_contiguous()
    assert _sums(Pair("t", measured, reference)).tolist() == pytest.approx(
        plain_sums(measured, reference), rel=1e-12, abs=0)


def test_tensors_of_different_sizes_are_refused():
    with pytest.raises(ValueError, match="cannot compare 3 elements with 4"):
        _sums(Pair("t", torch.zeros(3), torch.zeros(4)))


def test_an_empty_tensor_sums_to_zeros():
    assert _sums(Pair("t", torch.zeros(0), torch.zeros(0))).tolist() == [0.0] * 5


def one_ulp_apart(reference: torch.Tensor, every: int) -> torch.Tensor:
    """``reference`` with every ``every``-th element moved to the next float64 up."""
    measured = reference.clone()
    measured[::every] = torch.nextafter(reference[::every], torch.tensor(math.inf,
                                                                         dtype=torch.float64))
    return measured


@pytest.mark.parametrize("with_origin", (False, True))
def test_a_difference_of_one_rounding_is_not_buried(with_origin):
    # Elements near 1 one float64 ulp (2.2e-16) apart: ||m - r||^2 ~ 1e-28 of ||r||^2,
    # which ||m||^2 - 2 m.r + ||r||^2 would bury under roundings of ~1e-16 of ||r||^2.
    reference = 1 + 0.5 * random(8, torch.float64).abs()
    measured = one_ulp_apart(reference, every=7)
    origin = torch.zeros_like(reference) if with_origin else None
    sums = _sums(Pair("t", measured, reference, origin)).tolist()
    exact = float(((measured - reference) ** 2).sum())
    assert 0 < exact < 1e-26 * sums[1]
    assert sums[3] == pytest.approx(exact, rel=1e-12, abs=0)


def on_the_grid(tensor: torch.Tensor) -> list[int]:
    """The elements of a float64 tensor of values >= 0.5 as exact integer multiples of
    2**-53 (the spacing of float64 at 0.5)."""
    assert float(tensor.min()) >= 0.5
    return [int(x * 2.0**53) for x in tensor.tolist()]


def test_a_residual_of_one_rounding_is_reported_as_computed_exactly():
    # Elements near 1 one ulp apart: the least-squares scale is 1 + 0.15 ulp, which the
    # sums (each rounded to ~1e-16 of 1.4e5) return as 1 or as a neighbour of 1 depending
    # on their order of summation. At a scale other than 1, float64 cannot compute m - s r
    # itself (s r rounds by as much as the difference), so the residual at the reported
    # scale is computed here in integers, exactly, and rounded once at the end.
    reference = 1 + 0.5 * random(9, torch.float64).abs()
    measured = one_ulp_apart(reference, every=5)
    result = compare([Pair("t", measured, reference)], ["t"], None, CPU, rtol=1e-20)
    m, r = on_the_grid(measured), on_the_grid(reference)
    num, den = result.scale.as_integer_ratio()   # s = num / den
    left = sum((a * den - num * b) ** 2 for a, b in zip(m, r, strict=True))
    mm = sum(a * a for a in m)
    exact = math.sqrt(Fraction(left, den * den * mm))
    # What the first pass computes (it stands on any CPU: its terms for s != 1, ~1e-31 of
    # rr, are below CORRECTION_FLOOR): sqrt(dd + 2(1 - s) dr + (1 - s)^2 rr) / sqrt(mm),
    # d = m - r and 1 - s exact (Sterbenz), from float64 sums of n products. Whatever the
    # order of summation and with or without FMA, each sum is within gamma_n = n u /
    # (1 - n u) of the sum of its terms' magnitudes (Higham, Accuracy and Stability of
    # Numerical Algorithms, 3.1), and the scalar arithmetic after it adds at most 5 u of
    # the three terms' magnitudes T. So residual^2 is within (gamma_n + 5 u) T / residual^2
    # of itself, mm within gamma_n, and the square roots, the division and the rounding of
    # `exact` add 3 u: about 1e-11 here, while a reported residual from another scale or
    # other tensors is off by a percent or more (the plain float64 m - s r is off by 2%).
    d = [a - b for a, b in zip(m, r, strict=True)]
    dd, dr, rr = (sum(x * y for x, y in zip(p, q, strict=True))
                  for p, q in ((d, d), (d, r), (r, r)))
    off = den - num   # (1 - s) den
    terms = dd * den * den + abs(2 * off * dr * den) + off * off * rr
    n, u = measured.numel(), 2.0**-53
    gamma = n * u / (1 - n * u)
    bound = (gamma + 5 * u) * float(Fraction(terms, left)) / 2 + gamma / 2 + 3 * u
    assert 0 < result.residual == pytest.approx(exact, rel=bound, abs=0)
    assert result.verdict is Equivalence.DIFFERS   # against a tolerance below it


@pytest.mark.parametrize("with_origin", (False, True))
def test_the_second_pass_is_the_plain_residual_at_the_scale(with_origin):
    origin = random(10) if with_origin else None
    reference, noise = random(11), random(12)
    measured = 3 * reference + 1e-6 * noise
    scale = 3.0000001
    m, r = measured.double(), reference.double()
    if origin is not None:
        m, r = m - origin.double(), r - origin.double()
    expected = float(((m - scale * r) ** 2).sum())
    got = _residual_sq(Pair("t", measured, reference, origin), scale)
    assert got == pytest.approx(expected, rel=1e-9, abs=0)


def test_a_single_one_ulp_difference_is_summed_exactly():
    reference = torch.ones(SIZE, dtype=torch.float64)
    measured = reference.clone()
    measured[7] = torch.nextafter(torch.tensor(1.0, dtype=torch.float64),
                                  torch.tensor(2.0, dtype=torch.float64))
    d_d = _sums(Pair("t", measured, reference)).tolist()[3]
    assert d_d == (2.0 ** -52) ** 2  # exactly the one element's difference, squared


def test_pairs_on_an_accelerator_are_compared_in_wider_chunks():
    """On the CPU a chunk stays in the cache; on an accelerator, where each chunk costs
    kernel launches whatever its width, chunks are wider (a meta tensor stands in here)."""
    from harness.check.compare import ACCELERATOR_CHUNK, chunk_width

    cpu = Pair("t", random(0), random(1))
    assert chunk_width([cpu]) == CHUNK
    elsewhere = torch.empty(4, device="meta")
    assert chunk_width([cpu, Pair("u", elsewhere, None)]) == ACCELERATOR_CHUNK > CHUNK


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("with_origin", (False, True))
def test_a_cuda_pass_gives_the_plain_float64_sums(with_origin):
    """The comparison runs on the tensors' own device, in one chunk of ACCELERATOR_CHUNK
    or more: the same sums as float64 copies on the CPU, to float64 rounding."""
    size = (1 << 22) + 4321
    reference, noise = random(5, size=size), random(6, size=size)
    measured = reference * 0.75 + 1e-3 * noise
    origin = random(7, size=size) if with_origin else None
    cuda = Pair("t", measured.cuda(), reference.cuda(),
                origin.cuda() if origin is not None else None)
    assert_same_sums(cuda, plain_sums(measured, reference, origin))
