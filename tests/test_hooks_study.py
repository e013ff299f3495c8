"""Reduction variants (DDP comm hooks and options, ZeRO, FSDP2 settings) against first principles.

One run of the real command line on 3 forked ranks measures world sizes 2 and 3
(3: the divisions by k are inexact and a sum is 3x, not 2x, the average); the
tests read what it wrote. The expected numbers are worked out here by hand from
the model's shapes, the formats' epsilons and what each variant does, never
through the study's own code.
"""

import math

import pandas as pd
import pytest
import torch

from harness.fit import ScaleFit
from harness.studies.hooks.measure import HookVerdict, hook_verdict, rounding_bound
from harness.studies.hooks.study import HooksStudy
from harness.studies.hooks.variants import POWERSGD_WARMUP, STEPS, VARIANTS
from harness.tolerances import relative_tolerance
from tests.distributed import run_cli
from tests.frames import rows
from tests.scheduling import launching

RTOL = relative_tolerance(torch.float64)
WORLD = 3
KS = (2, 3)
#: The 4-8-2 MLP: hidden.weight 8x4, hidden.bias 8, out.weight 2x8, out.bias 2.
SHAPES = [(8, 4), (8,), (2, 8), (2,)]
PARAMETERS = sum(math.prod(s) for s in SHAPES)  # 58
#: Machine epsilon (the gap above 1) of the compressed formats: 10 and 7 stored mantissa bits.
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
FLOAT16 = ["fp16_compress_hook", "reduce_dtype-float16"]
BFLOAT16 = ["bf16_compress_hook-renamed", "reduce_dtype-bfloat16"]


@pytest.fixture(scope="module")
@launching(seconds=5)
def frame(tmp_path_factory):
    out = tmp_path_factory.mktemp("hooks")
    codes = run_cli(WORLD, ["--studies", "hooks", "--world-sizes", "1,2,3", "--out", str(out),
                            "--quiet", "--no-report"], store_dir=out.parent)
    assert codes == [0] * WORLD
    return pd.read_csv(out / "hooks.csv")


def ok(frame, **where):
    return rows(frame, status="ok", **where)


# -------------------------------------------------------------------- matrix
def test_every_variant_has_a_row_per_step_at_every_world_size_from_two(frame):
    assert set(frame.world_size) == set(KS), "one rank has nothing to reduce"
    for variant in VARIANTS:
        for k in KS:
            case = rows(frame, variant=variant.name, world_size=k)
            if (case.status == "ok").all():
                assert case.step.tolist() == list(range(1, variant.steps + 1))
            else:
                assert len(case) == 1 and case.status.iloc[0].startswith("skipped: ")


def test_ddp_refuses_bf16_compress_hook_by_name_without_nccl(frame):
    skipped = rows(frame, variant="bf16_compress_hook")
    if torch.cuda.is_available():
        pytest.skip("with CUDA and NCCL DDP accepts the hook")
    assert (skipped.status.str.startswith("skipped: TypeError: BF16 all reduce")).all()
    # The same function under another name is measured: gloo all-reduces bfloat16.
    assert (rows(frame, variant="bf16_compress_hook-renamed").status == "ok").all()


# ----------------------------------------------------------------- exactness
@pytest.mark.parametrize("variant", ["allreduce_hook", "gradient_as_bucket_view",
                                     "static_graph", "bucket_cap_mb-small",
                                     "bucket_cap_mb-large", "ZeroRedundancyOptimizer",
                                     "fully_shard"])
def test_the_default_reduction_and_options_that_must_not_change_it_are_exact(frame, variant):
    measured = ok(frame, variant=variant)
    assert (measured.full_batch_scale - 1).abs().max() < RTOL
    assert measured.relative_error.max() < RTOL
    assert measured.param_distance.max() < RTOL, "five steps of the exact run, to rounding"
    assert (measured.verdict == "exact").all()
    assert (measured.model_dtype == "float64").all()
    assert (measured.wire_dtype == "float64").all()


def test_a_hook_that_forgets_to_divide_sums_and_so_does_a_divide_factor_of_one(frame):
    # DDP hands a comm hook the undivided local gradients; FSDP divides by the factor.
    for variant in ["sum-hook", "set_gradient_divide_factor"]:
        for k in KS:
            measured = ok(frame, variant=variant, world_size=k)
            assert measured.full_batch_scale.to_numpy() == pytest.approx(k, rel=RTOL)
            assert measured.fit_residual.max() < RTOL
            assert (measured.verdict == "summed").all()


def test_a_hook_that_divides_twice_over_averages(frame):
    for k in KS:
        measured = ok(frame, variant="double-divide-hook", world_size=k)
        assert measured.full_batch_scale.to_numpy() == pytest.approx(1 / k, rel=RTOL)
        assert measured.fit_residual.max() < RTOL
        assert (measured.verdict == "over-averaged").all()


def test_scale_errors_move_the_weights_away_from_the_exact_run(frame):
    for variant in ["sum-hook", "double-divide-hook"]:
        last = ok(frame, variant=variant, step=STEPS)
        assert last.param_distance.min() > 1e-3


# --------------------------------------------------------------- compression
@pytest.mark.parametrize("wire, variants", [("float16", FLOAT16), ("bfloat16", BFLOAT16)])
def test_compression_error_is_within_the_formats_epsilon_times_the_gradient_norm(
        frame, wire, variants):
    """Each element of the average passes through at most k + 2 roundings to the format
    (conversion, division by k, k - 1 additions, FSDP's post-divide), each off by at most
    half an epsilon of the magnitudes being added: ‖error‖ <= (k + 2) eps/2 ‖mean |g_r|‖,
    and ‖mean |g_r|‖ = magnitude_ratio ‖ḡ‖. Twice that allows for the second-order terms."""
    eps = EPSILON[wire]
    for variant in variants:
        measured = ok(frame, variant=variant)
        allowed = (measured.world_size + 2) * eps * measured.magnitude_ratio
        assert (measured.relative_error <= allowed).all()
        # Lossy: rounding generic numbers to the format is off by ~eps/sqrt(12) on average.
        assert measured.relative_error.min() > eps / 64
        assert (measured.wire_dtype == wire).all()
        assert (measured.verdict == "compressed").all()
        assert (measured.relative_error <= measured.error_bound).all()


def test_bfloat16_loses_more_than_float16(frame):
    fp16 = ok(frame, variant="fp16_compress_hook").relative_error.to_numpy()
    bf16 = ok(frame, variant="bf16_compress_hook-renamed").relative_error.to_numpy()
    # 3 fewer mantissa bits: 8x the rounding error, on the same gradients (same steps first).
    assert bf16.mean() > 2 * fp16.mean()


def test_compressed_all_reduces_carry_two_bytes_an_element_instead_of_eight(frame):
    for variant, size in [("allreduce_hook", 8), ("fp16_compress_hook", 2),
                          ("bf16_compress_hook-renamed", 2)]:
        measured = ok(frame, variant=variant)
        assert (measured.collective_bytes == PARAMETERS * size).all()


def test_fsdp_reduce_scatters_every_parameter_padded_to_a_multiple_of_k_rows(frame):
    for k in KS:
        padded = sum(math.ceil(s[0] / k) * k * math.prod(s[1:]) for s in SHAPES)
        for variant, size in [("fully_shard", 8), ("reduce_dtype-float16", 2)]:
            measured = ok(frame, variant=variant, world_size=k)
            assert (measured.collective_bytes == padded * size).all()
            assert (measured.collective == "reduce_scatter_single").all()
            assert (measured.collective_calls == 1).all(), "one group: the whole model"


# ------------------------------------------------------------------- buckets
def test_all_reduce_calls_are_buckets_times_steps(frame):
    for variant in ["allreduce_hook", "fp16_compress_hook", "sum-hook", "double-divide-hook",
                    "gradient_as_bucket_view", "static_graph", "bucket_cap_mb-small",
                    "bucket_cap_mb-large", "ZeroRedundancyOptimizer"]:
        for k in KS:
            measured = ok(frame, variant=variant, world_size=k)
            assert measured.collective_calls.sum() == measured.buckets.sum()
            assert len(measured) == STEPS


def test_a_bucket_cap_below_every_parameter_gives_one_bucket_per_parameter(frame):
    # DDP puts every parameter in one bucket for its first step (find_unused_parameters
    # False), then rebuilds buckets by the cap: here one per parameter tensor.
    for k in KS:
        small = ok(frame, variant="bucket_cap_mb-small", world_size=k).sort_values("step")
        assert small.buckets.tolist() == [1] + [len(SHAPES)] * (STEPS - 1)
        assert small.collective_calls.sum() == 1 + len(SHAPES) * (STEPS - 1)
        large = ok(frame, variant="bucket_cap_mb-large", world_size=k)
        assert (large.buckets == 1).all()


# ------------------------------------------------------------------ PowerSGD
def _powersgd_bytes(rank: int) -> int:
    """PowerSGD's three all-reduces after warm-up, in float64 bytes: the tensors it does not
    compress (vectors, and matrices with (n + m) r >= n m at min_compression_rate 1),
    then P (n x r) and Q (m x r) of every compressed n x m matrix."""
    uncompressed = p_size = q_size = 0
    for shape in SHAPES:
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        if len(shape) == 2 and (n + m) * r < n * m:
            p_size, q_size = p_size + n * r, q_size + m * r
        else:
            uncompressed += n * m
    return 8 * (uncompressed + p_size + q_size)


@pytest.mark.parametrize("variant, rank", [("powerSGD-rank1", 1), ("powerSGD-rank2", 2),
                                           ("powerSGD-rank1-no-error-feedback", 1)])
def test_powersgd_is_exact_during_warm_up_and_low_rank_after(frame, variant, rank):
    measured = ok(frame, variant=variant)
    warm_up = measured[measured.step <= POWERSGD_WARMUP]
    after = measured[measured.step > POWERSGD_WARMUP]
    # Warm-up: DDP's plain all-reduce of the whole bucket, divided by k.
    assert warm_up.relative_error.max() < RTOL
    assert (warm_up.collective_calls == 1).all()
    assert (warm_up.collective_bytes == PARAMETERS * 8).all()
    # Then a rank-r approximation of 8x4 gradients of rank up to 4: visibly off.
    assert after.relative_error.min() > 1e-3
    assert (after.verdict == "differs").all()
    assert (after.collective_calls == 3).all(), "uncompressed tensors, Ps, Qs"
    assert (after.collective_bytes == _powersgd_bytes(rank)).all()
    assert (measured.param_rank_spread == 0).all(), "every rank decompresses the same"


def test_powersgd_bytes_worked_out_by_hand():
    # rank 1: biases 8 + 2 uncompressed; P 8 + 2; Q 4 + 8 -> 32 elements.
    assert _powersgd_bytes(1) == 8 * (10 + 10 + 12)
    # rank 2: 2x8 is not worth it ((2 + 8) 2 = 20 >= 16): 8 + 16 + 2 uncompressed; P 16; Q 8.
    assert _powersgd_bytes(2) == 8 * (26 + 16 + 8)


# ----------------------------------------------------------------------- ZeRO
def test_zero_updates_like_the_plain_optimizer_with_a_shard_of_its_state(frame):
    zero = ok(frame, variant="ZeroRedundancyOptimizer")
    plain = ok(frame, variant="allreduce_hook")
    assert zero.param_distance.max() < RTOL
    assert zero.param_distance.to_numpy() == pytest.approx(plain.param_distance.to_numpy(),
                                                           abs=RTOL)
    assert (zero.param_rank_spread == 0).all(), "ZeRO broadcasts every updated shard"
    # SGD with momentum keeps one buffer element per parameter element: rank 0 of a
    # plain optimizer holds all 58, ZeRO's rank 0 only the parameters it owns.
    assert (plain.rank0_state_elements == PARAMETERS).all()
    assert ((zero.rank0_state_elements > 0) & (zero.rank0_state_elements < PARAMETERS)).all()


def test_fsdp_rank_zero_holds_its_rows_of_every_parameter(frame):
    for k in KS:
        held = sum(min(math.ceil(s[0] / k), s[0]) * math.prod(s[1:]) for s in SHAPES)
        measured = ok(frame, variant="fully_shard", world_size=k)
        assert (measured.rank0_state_elements == held).all()


# -------------------------------------------------------- bound and verdicts
def _fp16_average(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """What fp16_compress_hook computes, spelled out: each rank converts and divides in
    float16, the ranks' values are added one by one in float16, the sum converted back."""
    k = len(per_rank)
    total = per_rank[0].to(torch.float16) / k
    for g in per_rank[1:]:
        total = total + g.to(torch.float16) / k
    return total.to(torch.float64)


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("cancel", [False, True])
def test_the_rounding_bound_holds_for_a_float16_average(k, cancel):
    generator = torch.Generator().manual_seed(k)
    per_rank = [torch.randn(500, generator=generator, dtype=torch.float64) * 10.0**-r
                for r in range(k)]
    if cancel:  # the first two ranks nearly cancel: the average is small, rounding is not
        per_rank[1] = -per_rank[0] * (1 - 1e-3)
    exact = torch.stack(per_rank).mean(0)
    error = float((_fp16_average(per_rank) - exact).norm() / exact.norm())
    bound = rounding_bound(per_rank, torch.float16)
    assert 0 < error <= bound
    # Worst cases of k + 2 roundings in every element, against errors that partly cancel:
    # the bound is a few times to tens of times the error, not orders of magnitude more.
    assert bound < 100 * error


def test_rounding_bound_of_one_element_by_hand():
    # Two ranks both holding 1: mean |g| = 1 = |ḡ|; 4 roundings of u = 2^-11 each, and 6
    # half subnormal gaps of 2^-24.
    u = 2.0**-11
    expected = 4 * u / (1 - 4 * u) + 6 * 2.0**-24 / 2
    assert rounding_bound([torch.ones(1), torch.ones(1)], torch.float16) == pytest.approx(
        expected, rel=1e-12)


@pytest.mark.parametrize("fit, error, bound, verdict", [
    (ScaleFit(1.0, 0.0), 1e-16, 1e-15, HookVerdict.EXACT),
    (ScaleFit(1.0001, 3e-4), 3e-4, 2e-3, HookVerdict.COMPRESSED),
    (ScaleFit(3.0, 1e-16), 2.0, 1e-15, HookVerdict.SUMMED),
    (ScaleFit(1 / 3, 1e-16), 2 / 3, 1e-15, HookVerdict.OVER_AVERAGED),
    (ScaleFit(2.0, 1e-16), 1.0, 1e-15, HookVerdict.SCALED),
    (ScaleFit(0.7, 0.6), 0.62, 1e-15, HookVerdict.DIFFERS),
])
def test_hook_verdicts_at_world_size_three(fit, error, bound, verdict):
    assert hook_verdict(fit, error, bound, 3, RTOL) == verdict


@pytest.mark.parametrize("factor, holds", [(0.5, True), (2.0, False), (1e3, False)])
def test_each_hook_verdict_holds_inside_its_tolerance_and_not_outside(factor, holds):
    """Measurements moved by ``factor`` tolerances from what each verdict names (as
    tests/test_verdicts.py does for the other studies)."""
    k, quiet = 3, RTOL / 10  # a wire format whose rounding is below the run's tolerance
    exact = hook_verdict(ScaleFit(1.0, 0.0), factor * RTOL, quiet, k, RTOL)
    assert (exact == HookVerdict.EXACT) == holds
    bound = 1e-3  # a compressed format's rounding bound: the tolerance of "compressed"
    compressed = hook_verdict(ScaleFit(1.0, factor * bound), factor * bound, bound, k, RTOL)
    assert (compressed == HookVerdict.COMPRESSED) == holds
    summed = hook_verdict(ScaleFit(k * (1 + factor * RTOL), 0.0), k - 1.0, quiet, k, RTOL)
    assert (summed == HookVerdict.SUMMED) == holds
    # Below 1 the tolerance is absolute (harness.tolerances.close).
    halved = hook_verdict(ScaleFit(1 / k + factor * RTOL, 0.0), 1 - 1 / k, quiet, k, RTOL)
    assert (halved == HookVerdict.OVER_AVERAGED) == holds
    residual = hook_verdict(ScaleFit(float(k), factor * RTOL), k - 1.0, quiet, k, RTOL)
    assert (residual == HookVerdict.SUMMED) == holds


# -------------------------------------------------------------------- report
def test_the_report_section_names_what_the_rows_say(frame, tmp_path):
    from harness.report.figures import FigureWriter, style
    from harness.report.section import SectionInputs
    from harness.studies.hooks.report import SECTION

    with style():
        output = SECTION.summarize(frame, SectionInputs("hooks.csv", RTOL,
                                                        FigureWriter(tmp_path)))
    text = "\n".join(f.text for f in output.findings)
    summed = next(f for f in output.findings if "summed the ranks' gradients" in f.text)
    assert "sum-hook" in summed.text and "full_batch_scale = N" in summed.text
    assert "double-divide-hook divided the average by the world size once more" in text
    assert "bf16_compress_hook was not measured" in text or torch.cuda.is_available()
    assert (tmp_path / "figures" / "hooks_errors.png").is_file()
    assert len(output.answers) == 4


def test_the_report_section_of_a_run_without_cases_says_nothing(tmp_path):
    from harness.report.figures import FigureWriter
    from harness.report.section import SectionInputs
    from harness.studies.hooks.report import SECTION

    empty = pd.DataFrame(columns=HooksStudy.column_names())
    output = SECTION.summarize(empty, SectionInputs("hooks.csv", RTOL, FigureWriter(tmp_path)))
    assert output.findings == [] and output.blocks == [] and output.answers == []


def test_the_schema_documents_every_variant_the_study_builds_in_row_order():
    from harness.studies.hooks.schema import VARIANT_NAMES

    assert tuple(variant.name for variant in VARIANTS) == VARIANT_NAMES
