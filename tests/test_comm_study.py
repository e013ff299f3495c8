"""The comm study: bus factors from first principles, the checker, a real run on 3 ranks.

World size 3 (world sizes 1..3, so the study measures k = 2 and 3) makes the
chunked collectives round their element counts: 3 does not divide a power of two.
"""

import dataclasses
import math

import pandas as pd
import pytest
import torch

from harness.report.figures import FigureWriter, style
from harness.report.section import SectionInputs
from harness.studies import STUDIES
from harness.studies.comm.collectives import (
    COLLECTIVES,
    bandwidths,
    bus_factor,
    count_wrong,
    message_elements,
    prepare,
)
from harness.studies.comm.report import SECTION
from harness.studies.comm.steps import STEP_MODELS
from harness.studies.comm.study import DEFAULT_SIZES, FULL_SIZES, TIMINGS, CommStudy
from harness.studies.comm.timing import Clock, Timing, durations
from harness.tasks import task_by_name
from harness.tolerances import relative_tolerance
from tests.distributed import run_cli
from tests.frames import rows as select
from tests.runs import make_run
from tests.scheduling import launching

WORLD = 3
CPU = torch.device("cpu")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_cuda = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")


# ------------------------------------------------------------- bus factors
def ring_bytes_sent_per_rank(collective: str, n: int, size: float) -> float:
    """Bytes one rank sends in the bandwidth-optimal ring algorithm, step by step.

    The ring cuts S into n chunks. reduce_scatter: n - 1 steps, each sending one
    chunk to the next rank (which adds it to its own). all_gather: n - 1 steps,
    each forwarding one chunk. all_reduce: a reduce_scatter, then an all_gather.
    broadcast (pipelined ring): every byte travels once over each of the n - 1
    links, i.e. S per link.
    """
    chunk = size / n
    if collective in ("reduce_scatter", "all_gather"):
        return sum(chunk for _step in range(n - 1))
    if collective == "all_reduce":
        return 2 * sum(chunk for _step in range(n - 1))
    return size


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_bus_factor_is_what_each_link_carries_per_byte_of_message(collective, n):
    size = 2.0**20
    assert bus_factor(collective, n) == pytest.approx(
        ring_bytes_sent_per_rank(collective, n, size) / size, rel=1e-15)


def test_bandwidths_are_size_over_time_and_times_the_factor():
    algbw, busbw = bandwidths("all_reduce", 4_000_000_000, 2.0, 4)
    assert algbw == 2.0, "4e9 bytes in 2 s: 2 GB/s (1e9 bytes)"
    assert busbw == 2.0 * 1.5, "2(n-1)/n = 1.5 at n = 4"
    assert bandwidths("broadcast", 10**9, 1.0, 7) == (1.0, 1.0)


@pytest.mark.parametrize("collective, size, n, expected", [
    ("all_reduce", 8, 3, 1), ("broadcast", 4, 3, 1), ("all_reduce", 64 * 1024, 3, 8192),
    ("reduce_scatter", 8, 3, 3), ("all_gather", 64 * 1024, 3, 8190),
    ("reduce_scatter", 64 * 1024, 4, 8192),
])
def test_message_elements_round_to_whole_chunks(collective, size, n, expected):
    assert message_elements(collective, size, n, 8) == expected


# ----------------------------------------------------------------- checker
def test_the_checker_counts_exactly_the_wrong_elements():
    expected = prepare("all_reduce", 0, 3, 10, torch.float64, CPU).expected
    assert count_wrong(expected.clone(), expected) == 0
    received = expected.clone()
    received[3] += 1
    received[7] = torch.nextafter(received[7], torch.tensor(math.inf, dtype=torch.float64))
    received[9] = math.nan
    assert count_wrong(received, expected) == 3, "off by one, by one ulp, NaN"
    assert count_wrong(expected[:4], expected) == 10, "a result of the wrong shape is all wrong"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_checker_catches_an_average_instead_of_a_sum_and_swapped_chunks(n):
    chunk = 5
    summed = prepare("all_reduce", 0, n, n * chunk, torch.float64, CPU)
    assert count_wrong(summed.expected / n, summed.expected) == n * chunk
    gathered = prepare("all_gather", 0, n, n * chunk, torch.float64, CPU)
    swapped = torch.cat([gathered.expected[chunk:2 * chunk], gathered.expected[:chunk],
                         gathered.expected[2 * chunk:]])
    assert count_wrong(swapped, gathered.expected) == 2 * chunk
    scattered = [prepare("reduce_scatter", r, n, n * chunk, torch.float64, CPU).expected
                 for r in range(2)]
    assert count_wrong(scattered[1], scattered[0]) == chunk, "rank 1 got rank 0's chunk"
    broadcast = prepare("broadcast", 1, n, 7, torch.float64, CPU)
    assert count_wrong(broadcast.receive, broadcast.expected) == 7, "a broadcast that did nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expected_values_are_exact_sums_of_what_the_ranks_send(dtype):
    """The pattern's sums are exact in both dtypes: wrong = 0 leaves no room for rounding."""
    n, elements = 5, 1000
    sent = torch.stack([prepare("all_reduce", r, n, elements, dtype, CPU).send
                        for r in range(n)])
    assert torch.equal(sent.sum(0), prepare("all_reduce", 0, n, elements, dtype, CPU).expected)
    assert torch.equal(sent.to(torch.int64).sum(0).to(dtype), sent.sum(0))


# -------------------------------------------------------------- the matrix
def test_the_default_matrix_is_small_and_full_sweeps_8_bytes_to_64_mib():
    assert FULL_SIZES[0] == 8 and FULL_SIZES[-1] == 64 * 2**20
    assert all(b == 4 * a for a, b in zip(FULL_SIZES[1:], FULL_SIZES[2:], strict=False))
    assert set(DEFAULT_SIZES) <= set(FULL_SIZES)
    run = make_run("comm", world_size=1)
    run = dataclasses.replace(run, world_sizes=(1, 2, 3, 4, 5))
    default = CommStudy().cases(run)
    ks = {c["world_size"] for c in default}
    assert ks == {2, 5}, "the smallest and the largest k >= 2"
    assert len(default) == len(COLLECTIVES) * 2 * len(DEFAULT_SIZES) + 2 * 2 * len(STEP_MODELS)
    full = CommStudy().cases(dataclasses.replace(
        run, config=dataclasses.replace(run.config, matrix="full")))
    assert {c["world_size"] for c in full} == {2, 3, 4, 5}
    assert {c["size_bytes"] for c in full if "size_bytes" in c.params} == set(FULL_SIZES)


def test_without_two_ranks_every_row_says_why():
    run = make_run("comm", world_size=1)
    study = CommStudy()
    rows = [row for case in study.cases(run) for row in study.run_case(case, run)]
    assert rows and all(r["status"].startswith("skipped: needs world size 2") for r in rows)


def test_timing_needs_a_checked_call_and_a_timed_one():
    with pytest.raises(ValueError, match="must be >= 1"):
        Timing(warmup=0, iterations=10)
    assert all(t.warmup >= 1 and t.iterations >= 1 for t in TIMINGS.values())


# ------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
@launching(seconds=3)
def frame(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    codes = run_cli(WORLD, ["--studies", "comm", "--out", str(out), "--quiet", "--no-report"],
                    store_dir=out.parent)
    assert codes == [0] * WORLD
    return pd.read_csv(out / "comm.csv")


def test_the_csv_has_the_documented_columns(frame):
    assert list(frame.columns) == list(STUDIES["comm"].column_names())
    assert frame.case_id.nunique() == len(COLLECTIVES) * 2 * len(DEFAULT_SIZES) \
        + 2 * 2 * len(STEP_MODELS)


def test_every_collective_returned_exactly_the_expected_values(frame):
    collectives = select(frame, status="ok")
    collectives = collectives[collectives.operation.isin(COLLECTIVES)]
    assert len(collectives) == len(COLLECTIVES) * 2 * len(DEFAULT_SIZES)
    assert (collectives.wrong == 0).all()


def test_bandwidth_columns_follow_their_definitions(frame):
    rows = frame[frame.operation.isin(COLLECTIVES)]
    for _, row in rows.iterrows():
        k = int(row.world_size)
        assert row.bus_factor == bus_factor(row.operation, k)
        assert row.algbw_GBps == pytest.approx(row.message_bytes / row.time_s / 1e9, rel=1e-12)
        assert row.busbw_GBps == pytest.approx(row.algbw_GBps * row.bus_factor, rel=1e-12)
        assert row.message_bytes == row.elements * 8, "float64"
        assert row.time_s > 0


def test_chunked_collectives_use_whole_chunks_per_rank(frame):
    rows = select(frame, operation="reduce_scatter", world_size=3, size_bytes=8)
    assert rows.elements.tolist() == [3], "at least one element per rank"
    rows = select(frame, operation="all_gather", world_size=3, size_bytes=64 * 1024)
    assert rows.elements.tolist() == [8190]


@pytest.mark.parametrize("model", STEP_MODELS)
def test_ddp_steps_all_reduce_every_gradient_once_and_nothing_under_no_sync(frame, model):
    parameters = sum(p.numel() for p in task_by_name(model).build_model(
        torch.Generator(), torch.float64).parameters())
    synced = select(frame, operation="ddp-step", model=model, sync="every-step")
    skipped = select(frame, operation="ddp-step", model=model, sync="no_sync")
    assert (synced.message_bytes == 8 * parameters).all(), "every float64 gradient, once"
    assert (synced.buckets >= 1).all() and (synced.reduction_s > 0).all()
    assert (skipped.message_bytes == 0).all() and (skipped.buckets == 0).all()
    assert (skipped.reduction_s == 0).all()
    assert (synced.batch_size == 4 * synced.world_size).all()
    for _, row in pd.concat([synced, skipped]).iterrows():
        assert row.time_s > 0 and row.forward_s > 0 and row.backward_s > 0


def test_dataparallel_rows_say_why_they_were_skipped_without_gpus(frame):
    if GPUS >= 2:
        pytest.skip("CUDA devices present: DataParallel was measured")
    rows = select(frame, operation="dp-step")
    for _, row in rows.iterrows():
        assert row.status == f"skipped: needs {row.world_size} CUDA devices, has {GPUS}"
        assert math.isnan(row.time_s)


def summarize(frame, folder):
    with style():
        return SECTION.summarize(frame, SectionInputs("comm.csv", relative_tolerance(torch.float64),
                                                      FigureWriter(folder)))


def test_the_report_section_states_the_run(frame, tmp_path):
    output = summarize(frame, tmp_path)
    checked = len(COLLECTIVES) * 2 * len(DEFAULT_SIZES)
    texts = [finding.text for finding in output.findings]
    assert texts[0].startswith("Every collective returned exactly the expected values: wrong = 0 "
                               f"in all {checked} checked calls")
    assert any(t.startswith("DDP's gradient all-reduce took") for t in texts)
    assert any(t.startswith("dp-step was not measured") for t in texts) == (GPUS < 2)
    assert all("comm.csv" in finding.source for finding in output.findings)
    assert output.answers[0].answer == "yes, every element"
    assert (tmp_path / "figures" / "comm_bandwidth.png").exists()


def test_a_wrong_result_reaches_the_report(frame, tmp_path):
    broken = frame.copy()
    broken.loc[broken.index[0], "wrong"] = 4
    output = summarize(broken, tmp_path)
    checked = len(COLLECTIVES) * 2 * len(DEFAULT_SIZES)
    first = output.findings[0].text
    assert first.startswith(f"1 of {checked} checked calls returned wrong elements (4 in all")
    assert broken.case_id.iloc[0] in first
    assert output.answers[0].answer == f"no: 1 of {checked} calls had wrong elements"


# --------------------------------------------------------------- CUDA paths
@needs_cuda
def test_cuda_clock_times_on_the_device():
    clock = Clock(torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    times = durations(lambda: x.mul_(1.0), 5, clock)
    assert len(times) == 5 and all(t > 0 for t in times)


@needs_cuda
def test_dataparallel_step_runs_on_the_gpus_present():
    from harness.studies.comm.steps import measure_dp_step

    result = measure_dp_step("mlp", GPUS, torch.float64, 0, Timing(warmup=1, iterations=3))
    assert result.step > 0 and math.isnan(result.reduction)
