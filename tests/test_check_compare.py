"""The check's comparison, reference and tensor dealing, in one process, against direct
computations: what a launched check reports rests on these."""

from __future__ import annotations

import math
import threading
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
from torch import nn

from harness.check import Setup
from harness.check.case import deal, merged, shard_rows
from harness.check.compare import Pair, compare, worst_tensors
from harness.check.load import copy_of
from harness.check.reference import compute_reference
from harness.strategies.ddp import DDPCheckCase
from harness.strategies.fsdp import FSDPCheckCase
from harness.strategies.local import LocalCheckCase
from harness.verdicts import Equivalence

RTOL = 1e-9
CPU = torch.device("cpu")
#: float64's unit roundoff.
U = 2.0**-53


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): a float64 sum of n products, in any order of
    summation, with or without FMA, is within gamma_n of the sum of their magnitudes
    (Higham, Accuracy and Stability of Numerical Algorithms, 3.1)."""
    return n * U / (1 - n * U)


def tensors(seed: int, *shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(*shape, generator=generator, dtype=torch.float64)
            for i, shape in enumerate(shapes)}


SHAPES = ((300, 200), (200,), (50, 7))


def judged(measured: dict, reference: dict, origin: dict | None = None):
    pairs = [Pair(name, measured[name], reference[name],
                  origin[name] if origin is not None else None) for name in reference]
    return compare(pairs, list(reference), None, CPU, RTOL)


def direct(measured: dict, reference: dict, scale: float) -> tuple[float, dict[str, float]]:
    """||m - s r|| / ||m|| and each tensor's ||m - s r|| / ||s r||, computed the plain way."""
    left = {name: float((measured[name] - scale * reference[name]).norm()) for name in reference}
    total = math.sqrt(sum(v * v for v in left.values()))
    norm = math.sqrt(sum(float(t.norm()) ** 2 for t in measured.values()))
    return total / norm, {name: left[name] / (abs(scale) * float(reference[name].norm()))
                          for name in reference}


def assert_as_computed_directly(result, measured: dict, reference: dict, rel: float) -> None:
    residual, errors = direct(measured, reference, result.scale)
    assert result.residual == pytest.approx(residual, rel=rel)
    for name, error in errors.items():
        assert result.errors[name] == pytest.approx(error, rel=rel), name


def on_one_grid(*groups: dict[str, torch.Tensor]) -> list[dict[str, list[int]]]:
    """Every element of the float64 tensors of ``groups`` as the integer x * 2**k, one k
    for all of them (from the smallest exponent among them): exact."""
    every = torch.cat([t.reshape(-1) for group in groups for t in group.values()])
    smallest = every.abs()[every != 0].min()
    k = 53 - int(torch.frexp(smallest).exponent)
    return [{name: [int(x) for x in (t * 2.0**k).reshape(-1).tolist()]
             for name, t in group.items()} for group in groups]


def dot(a: list[int], b: list[int]) -> int:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_identical_tensors_match_with_zero_residual():
    reference = tensors(0, *SHAPES)
    result = judged({k: v.clone() for k, v in reference.items()}, reference)
    assert result.verdict is Equivalence.MATCHES
    assert result.scale == 1.0 and result.residual == 0.0
    assert set(result.errors.values()) == {0.0}


@pytest.mark.parametrize("seed", (1, 2))
@pytest.mark.parametrize("scale", (0.1, 1 / 3, 0.7, 3.0))
def test_a_uniform_scale_is_fitted_and_leaves_a_rounding_sized_residual(seed, scale):
    # The first pass's sums alone leave up to ~3e-7 of cancellation here (seed 1, s = 0.1:
    # the verdict would read "differs"); the direct second pass leaves rounding only.
    reference = tensors(seed, *SHAPES)
    result = judged({k: v * scale for k, v in reference.items()}, reference)
    assert result.verdict is Equivalence.SCALED
    # m = s r (1 + e), |e| <= u elementwise, so m.r / r.r is s to u; the two sums of n
    # products carry gamma_n each, the division u more: the fitted scale is s to
    # 2 gamma_n + 3 u (1.3e-11), in any order of summation.
    n = sum(t.numel() for t in reference.values())
    offset = abs(result.scale - scale) / scale
    assert offset <= 2 * gamma(n) + 3 * U
    # At the fitted scale s', m - s' r = r (s e - (s' - s)), and computing it (with or
    # without FMA) rounds by at most u |s' r| more: the residual and each tensor's error
    # are at most 2 u plus the scale's offset, the norms' rounding (gamma_n) aside. That
    # offset is what the order of summation decides (up to 13 u among these cases on an
    # AVX-512 EPYC), so a fixed bound near 2 u would hold on one CPU and not another.
    assert result.residual <= (2 * U + offset) * (1 + 2 * gamma(n))
    assert max(result.errors.values()) <= (2 * U + offset) * (1 + offset + 2 * gamma(n))


def test_a_near_match_residual_is_the_exact_one_at_its_scale():
    # Residuals of 1e-13: the plain float64 m - s r rounds s r by up to 1e-16 of r, up to
    # 5e-5 of a tensor's residual here, so the residual at the fitted scale s = num / den
    # is computed in integers, exactly, and rounded once.
    reference = tensors(2, *SHAPES)
    noise = tensors(3, *SHAPES)
    measured = {k: v * (1 + 1e-12) + 1e-13 * noise[k] for k, v in reference.items()}
    result = judged(measured, reference)
    m, r = on_one_grid(measured, reference)
    num, den = result.scale.as_integer_ratio()
    # The first pass stands here (its terms for s != 1 are 290 to 350 times the squared
    # residual, within CORRECTION_LIMIT): per tensor dd + 2(1 - s) dr + (1 - s)^2 rr from
    # float64 sums, each within gamma_n of its terms' magnitudes, then 5 u of the three
    # terms' magnitudes T by the scalar arithmetic. So each squared residual is within
    # (gamma_n + 5 u) T of itself; the norms, the square roots, the division and the
    # rounding of `exact` add gamma_n / 2 and a few u: 1.3e-9 at most here, while the
    # residual at the next float64 scale either side is off by 1e-6 or more.
    total = {"left": 0, "terms": 0, "mm": 0}
    for name in reference:
        d = [a - b for a, b in zip(m[name], r[name], strict=True)]
        left = sum((a * den - num * b) ** 2 for a, b in zip(m[name], r[name], strict=True))
        rr = dot(r[name], r[name])
        terms = (dot(d, d) * den * den + abs(2 * (den - num) * dot(d, r[name]) * den)
                 + (den - num) ** 2 * rr)
        n = len(d)
        bound = (gamma(n) + 5 * U) * float(Fraction(terms, left)) / 2 + gamma(n) / 2 + 8 * U
        exact = math.sqrt(Fraction(left, num * num * rr))   # ||m - s r|| / ||s r||
        assert 0 < result.errors[name] == pytest.approx(exact, rel=bound, abs=0), name
        total["left"] += left
        total["terms"] += terms
        total["mm"] += dot(m[name], m[name])
    n = sum(t.numel() for t in reference.values())
    bound = (gamma(n) + 5 * U) * float(Fraction(total["terms"], total["left"])) / 2 \
        + gamma(n) / 2 + 8 * U
    exact = math.sqrt(Fraction(total["left"], den * den * total["mm"]))
    assert 0 < result.residual == pytest.approx(exact, rel=bound, abs=0)


def test_one_differing_tensor_is_the_worst_and_the_verdict_differs():
    reference = tensors(4, *SHAPES)
    measured = {k: v.clone() for k, v in reference.items()}
    measured["t2"] = measured["t2"] * 1.5
    result = judged(measured, reference)
    assert result.verdict is Equivalence.DIFFERS
    assert worst_tensors(result.errors.items(), rtol=1e-9).startswith("t2=")
    assert_as_computed_directly(result, measured, reference, rel=1e-9)


def test_worst_tensors_writes_errors_within_the_tolerance_as_0_in_model_order():
    errors = [("a", 3e-16), ("b", 0.25), ("c", 1e-15), ("d", 0.5), ("e", 2e-16)]
    # Rounding differs between machines: below rtol, only the model's order is left.
    assert worst_tensors(errors, rtol=1e-9) == "d=0.5;b=0.25;a=0"
    assert worst_tensors([("a", 1e-15), ("c", 3e-16), ("e", 1e-16)], 1e-9) == "a=0;c=0;e=0"
    assert worst_tensors([("x", math.inf), ("y", 0.0)], 1e-9) == "x=inf;y=0"


def test_updates_are_compared_from_the_origin():
    origin = tensors(5, *SHAPES)
    step = tensors(6, *SHAPES)
    reference = {k: origin[k] - 1e-3 * step[k] for k in origin}
    measured = {k: origin[k] - 0.5e-3 * step[k] for k in origin}
    result = judged(measured, reference, origin)
    assert result.verdict is Equivalence.SCALED
    assert result.scale == pytest.approx(0.5, rel=1e-9)


def test_tensors_are_dealt_by_size_so_each_rank_compares_about_half():
    # Weights and biases alternate: dealt in turn, rank 0 would get every weight.
    sizes = [4096 * 4096, 4096] * 6
    owners = deal(sizes, 2)
    load = [sum(size for size, owner in zip(sizes, owners, strict=True)
                if owner == rank) for rank in (0, 1)]
    assert load[0] == load[1]
    assert deal(sizes, 2) == owners, "every rank must deal the same way"
    assert set(deal(sizes, 1)) == {0}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3), nn.Linear(3, 2))


def linear_setup() -> Setup:
    def batch(step: int):
        generator = torch.Generator().manual_seed(step)
        return torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)

    def loss(model, data):
        x, y = data
        return nn.functional.mse_loss(model[:3](x), y)   # the last layer gets no gradient

    return Setup(make_model=make_model, batch=batch, loss=loss, steps=2)


def test_the_rank_compares_the_tensors_its_strategy_gives_it():
    model = make_model().double()
    # Every buffer, integer counters (num_batches_tracked) included: they are compared too.
    everything = {name for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    halves = [DDPCheckCase.compared_parts(model, 2, rank) for rank in (0, 1)]
    assert set(halves[0]) | set(halves[1]) == everything and not set(halves[0]) & set(halves[1])
    assert set(halves[0].values()) == {None}, "DDP compares whole tensors"
    assert LocalCheckCase.compared_parts(model, 2, 1) == dict.fromkeys(everything)
    shards = FSDPCheckCase.compared_parts(model, 2, 1)
    assert shards["0.weight"] == (3, 5) and shards["0.bias"] == (3, 5)   # 5 rows: 3 + 2
    assert shards["3.weight"] == (1, 2)


@pytest.mark.parametrize("rows", (0, 1, 5, 7, 8))
@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
def test_shard_rows_are_the_rows_torch_chunk_gives_each_rank(rows, world_size):
    tensor = torch.arange(rows)
    chunks = torch.chunk(tensor, world_size) if rows else ()
    for rank in range(world_size):
        first, stop = shard_rows(rows, world_size, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert tensor[first:stop].tolist() == expected


def test_kept_rows_cover_every_case_and_a_whole_tensor_wins():
    assert merged((3, 5), (0, 2)) == (0, 5)
    assert merged((3, 5), None) is None and merged(None, (0, 2)) is None


def test_the_reference_keeps_only_what_it_is_told_and_leaves_the_initial_model_untouched():
    setup = linear_setup()
    initial = make_model().double()
    pristine = {k: v.clone() for k, v in initial.state_dict().items()}
    kept = {"0.weight", "1.running_mean", "3.weight"}
    steps = compute_reference(setup, torch.float64, CPU, None, RTOL, "test",
                              initial=initial, keeps=dict.fromkeys(kept))
    full = compute_reference(setup, torch.float64, CPU, None, RTOL, "test")
    for name, tensor in initial.state_dict().items():
        assert torch.equal(tensor, pristine[name]), name
    assert set(steps[0].before) == kept
    assert set(steps[0].grads) == {"0.weight", "3.weight"}
    assert set(steps[1].after) == kept
    assert steps[0].unused == full[0].unused == ("3.weight", "3.bias")
    assert steps[0].before["0.weight"].data_ptr() == initial[0].weight.data_ptr(), \
        "step 0 starts from the initial model's own tensors, not a copy"
    for step, whole in zip(steps, full, strict=True):
        assert step.loss == whole.loss
        for name in kept:
            assert torch.equal(step.after[name], whole.after[name]), name


def test_the_reference_keeps_only_the_rows_it_is_told_and_says_where_they_start():
    setup = linear_setup()
    initial = make_model().double()
    steps = compute_reference(setup, torch.float64, CPU, None, RTOL, "test", initial=initial,
                              keeps={"0.weight": (3, 5), "0.bias": (1, 3), "1.weight": None})
    full = compute_reference(setup, torch.float64, CPU, None, RTOL, "test")
    for step, whole in zip(steps, full, strict=True):
        assert step.first_rows == {"0.weight": 3, "0.bias": 1}
        for state in ("before", "grads", "after"):
            kept, every = getattr(step, state), getattr(whole, state)
            assert torch.equal(kept["0.weight"], every["0.weight"][3:5]), state
            assert torch.equal(kept["0.bias"], every["0.bias"][1:3]), state
            assert torch.equal(kept["1.weight"], every["1.weight"]), state
    assert steps[0].before["0.weight"].data_ptr() != initial[0].weight.data_ptr(), \
        "rows are copied, so that the whole tensor can be freed"


class Locked(nn.Module):
    """A model deepcopy refuses (a lock among its attributes), as some wrappers are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 2)
        self.lock = threading.Lock()


def test_a_model_that_cannot_be_deep_copied_is_built_anew_at_the_templates_state():
    template = Locked().double()
    with torch.no_grad():
        template.layer.weight.add_(1.0)   # a state make_model would not give
    setup = Setup(make_model=Locked, batch=lambda i: torch.zeros(2, 3),
                  loss=lambda m, b: m.layer(b).sum())
    copy = copy_of(template, setup, torch.float64, CPU)
    assert copy is not template
    assert torch.equal(copy.layer.weight, template.layer.weight)
    assert copy.layer.weight.dtype == torch.float64


def test_ranks_that_disagree_without_a_known_cause_are_the_fix():
    from harness.check.causes import explain
    from harness.check.causes.evidence import Evidence
    from harness.check.fix import Facts

    reference = tensors(7, *SHAPES)
    measured = {k: v * 1.5 if k == "t0" else v for k, v in reference.items()}
    result = judged(measured, reference)
    facts = Facts(reduces_in_buckets=True, world_size=2, accum_steps=1, ranks_agree=False)
    apart = explain(Evidence(0, "grad", result, facts))
    assert apart.cause == "ranks-disagree"
    assert "the ranks hold different values after DDP's all-reduce" in apart.fix
    agreeing = explain(Evidence(0, "grad", result, replace(facts, ranks_agree=True)))
    assert "ranks hold" not in agreeing.fix and agreeing.cause == "no-single-scale"


def _check_cli(rank: int, world_size: int, argv: list[str]) -> int:
    from harness.grad_check.cli import main

    return main(argv)


@pytest.mark.launches(seconds=3)
@pytest.mark.parametrize("strategy", ("ddp", "local"))
def test_the_case_that_trains_the_initial_model_measures_its_update_from_the_initial_state(
        strategy, tmp_path):
    # With one strategy, the rank's last case trains the initial model itself: the
    # references' step-0 state must have been copied before that case's first step (into
    # step 0's compared gradients). A wrong origin for the updates shows in a scaled case:
    # both updates measured from it would look alike, and the fitted scale would be ~1.
    import pandas as pd

    from tests.distributed import run_ranks

    out = tmp_path / "out"
    argv = ["examples.mlp:make_setup", "examples.mlp:make_adam_setup",
            "examples.mlp:make_sum_setup", "--strategies", strategy, "--world-sizes", "2",
            "--accum-steps", "2", "--out", str(out), "--quiet"]
    assert run_ranks(2, _check_cli, argv, store_dir=tmp_path) == [0, 0]
    rows = pd.read_csv(out / "check.csv")
    summed, rows = rows[rows.setup == "mlp-sum"], rows[rows.setup != "mlp-sum"]
    assert set(rows.point) == {"grad", "params"} and set(rows.step) == {0, 1}
    assert set(rows.verdict) == {"matches"}, rows[["setup", "step", "point", "verdict"]]
    # A summed loss: sum / k on each rank, averaged over N = 2 ranks, k = 2: 1/4 of the
    # big batch's gradient, and so (plain SGD) of its update.
    assert set(summed.verdict) == {"scaled"}, summed[["point", "verdict", "scale"]]
    assert summed.scale.tolist() == pytest.approx([0.25, 0.25], rel=1e-9)


def test_an_all_zero_gradient_against_a_nonzero_reference_does_not_match():
    # Both zero is the same (a warm-up from lr 0); one of them zero is not, whichever.
    reference = tensors(5, *SHAPES)
    zeros = {name: torch.zeros_like(tensor) for name, tensor in reference.items()}
    assert judged(zeros, reference).verdict is not Equivalence.MATCHES
    assert judged(reference, zeros).verdict is not Equivalence.MATCHES
    assert judged(zeros, zeros).verdict is Equivalence.MATCHES
